"""Hint round trip: from an anomaly record's creation in the daemon to the
hint applied in a dispatcher, through the daemon's tick, the hint policy,
the socket and the dispatcher's agent link.

    python bench/bench_hint_loop.py [--anomalies 200]

A child process runs the daemon's loop (Daemon.tick every tick_s with a
real HintServer; no eBPF, so no root) and, every 100 ms, hands its alarms.act()
a firing run-queue alarm for a new process, resolved one tick later: the
same path a detector's record takes. The policy answers each with a
cpu_contention hint whose evidence carries `detected_ns`, the daemon's
CLOCK_MONOTONIC stamp when the record arrived. A Dispatcher in this
process stamps each hint as apply_hint() takes it; the round trip is the
difference (one clock for both processes). The closed-loop A/B figures
come from the demo (scripts/demo, or python demo/closed_loop.py --json
FILE, as root).

Writes bench/out/hint_loop.json.
"""

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mmtrace.dispatch import Dispatcher

INJECT_EVERY_S = 0.1


class TimedDispatcher(Dispatcher):
    def __init__(self, *args, **kwargs):
        self.applied = []
        super().__init__(*args, **kwargs)

    def apply_hint(self, hint):
        now = time.monotonic_ns()
        super().apply_hint(hint)
        detected = (hint.get("evidence") or {}).get("detected_ns")
        if hint.get("kind") == "cpu_contention" and detected:
            self.applied.append((now - detected) / 1e6)


def agent(sock: str, anomalies: int):
    """The child: the daemon's loop, fed one alarm per INJECT_EVERY_S at
    the start of a tick, where a detector's records arrive."""
    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.socket.hint_socket import HintServer
    from mmtrace.dispatch.policy import PolicySettings

    class InjectingDaemon(Daemon):
        inject: list = []

        def tick(self, now_ns=None):
            records, self.inject = self.inject, []
            self.alarms.act(records)
            super().tick(now_ns)

    logging.getLogger("mmtrace").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as state:
        cfg = DaemonConfig(socket=Path(sock), state_dir=Path(state), flight_min_interval_s=1e9,
                           policy=PolicySettings(max_hints_per_window=1 << 20))
        daemon = InjectingDaemon(cfg)
        daemon.server = HintServer(cfg.socket)
        pending, sent, next_at = [], 0, time.monotonic() + 1.0
        while sent < anomalies or pending:
            daemon.inject += [{**a, "state": "resolved"} for a in pending]
            pending = []
            if sent < anomalies and time.monotonic() >= next_at:
                next_at += INJECT_EVERY_S
                sent += 1
                pid = 100000 + sent         # the key, as ingest gives an alarm one
                alarm = {"detector": "p99_drift", "series": f"runq_delay{{pid={pid}}}",
                         "key": {"kind": "runq_delay", "pid": pid},
                         "state": "firing", "ts_ns": time.monotonic_ns(),
                         "evidence": {"p99": 0.004, "baseline": 0.001}}
                daemon.inject.append(alarm)
                pending.append(alarm)
            daemon.tick()
            time.sleep(cfg.tick_s)
        time.sleep(0.5)
        daemon.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--anomalies", type=int, default=200)
    parser.add_argument("--agent", nargs=2, metavar=("SOCKET", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        return agent(args.agent[0], int(args.agent[1]))
    with tempfile.TemporaryDirectory() as tmp:
        sock = os.path.join(tmp, "hint.sock")
        child = subprocess.Popen([sys.executable, __file__, "--agent", sock, str(args.anomalies)])
        deadline = time.monotonic() + 30
        while not os.path.exists(sock) and time.monotonic() < deadline:
            time.sleep(0.05)
        d = TimedDispatcher(["gpu0"], lambda device, modality, items: items, socket=sock)
        child.wait(timeout=60 + args.anomalies * INJECT_EVERY_S * 2)
        d.close()
    rt = np.array(d.applied)
    result = {"host": platform.node(), "cpus": os.cpu_count(), "anomalies": args.anomalies,
              "hints_applied": int(len(rt)),
              "round_trip_ms": {"p50": round(float(np.percentile(rt, 50)), 3),
                                "p90": round(float(np.percentile(rt, 90)), 3),
                                "p99": round(float(np.percentile(rt, 99)), 3),
                                "max": round(float(rt.max()), 3)} if len(rt) else None}
    out = Path(__file__).resolve().parent / "out"
    out.mkdir(exist_ok=True)
    (out / "hint_loop.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
