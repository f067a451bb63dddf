"""The agent side of the socket storm test, run as its own process: the
daemon's socket handling (Daemon.tick with a real HintServer, no eBPF),
broadcasting one hint a second, and writing what it saw to a JSON file.

Usage: storm_agent.py SOCKET STATE_DIR OUT_JSON"""

import json
import sys
import time
from pathlib import Path

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.socket.hint_socket import HintServer


def main(sock, state_dir, out):
    daemon = Daemon(DaemonConfig(socket=Path(sock), state_dir=Path(state_dir)))
    daemon.server = HintServer(daemon.config.socket)
    seq, next_hint, next_report = 0, 0.0, 0.0
    while True:
        daemon.tick()
        now = time.monotonic()
        if now >= next_hint:
            seq += 1
            next_hint = now + 1.0
            daemon.server.broadcast({"v": 1, "type": "hint", "id": f"storm-{seq}",
                                     "kind": "priority", "target": "vision", "value": "low",
                                     "ttl_s": 2.0, "reason": "storm test", "evidence": {},
                                     "issued_ns": time.monotonic_ns()})
        if now >= next_report:
            next_report = now + 0.25
            clients = list(daemon.server.clients.values())
            report = {"clients": len(clients), "names": sorted(c.name for c in clients),
                      "samples": int(daemon.streams.request_ring.window()["value_s"].size),
                      "errors_sent": daemon.server.errors_sent,
                      "dropped_clients": daemon.server.dropped_clients}
            Path(out + ".tmp").write_text(json.dumps(report))
            Path(out + ".tmp").replace(out)
        time.sleep(daemon.config.tick_s)


if __name__ == "__main__":
    main(*sys.argv[1:4])
