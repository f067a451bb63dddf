"""Whom a hint reaches. A client's request latencies and entropy are its
own word: an alarm they raise steers only the processes whose samples made
that series (by the kernel's SO_PEERCRED pid, not a pid the client names).
An alarm on the kernel's streams (the run queue) goes to every subscriber.
A victim dispatcher runs in a process of its own."""

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.ingest.series_keys import RUNQ, SeriesKey

VICTIM = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b'{"v":1,"type":"hello","client":"victim","pid":4242}\\n{"v":1,"type":"subscribe"}\\n'
          b'{"v":1,"type":"sample","series":"own","modality":"text","value_ms":3}\\n')
print("ready", flush=True)
sys.stdin.readline()
sys.path.insert(0, sys.argv[2])
from test_hint_scope import hints_of
print(json.dumps(hints_of(s)), flush=True)
"""


class IdleCpu:
    """The host's CPU as the policy reads it: 10 % busy, so a latency
    alarm is taken for a bottleneck elsewhere (degrade)."""
    def read(self):
        return 0.1


def hints_of(sock) -> list[str]:
    sock.settimeout(1.0)
    got = b""
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    except TimeoutError:
        pass
    return [json.loads(line)["kind"] for line in got.splitlines()
            if json.loads(line).get("type") == "hint"]


def test_forged_samples_steer_only_the_forger_and_kernel_alarms_reach_everyone(tmp_path):
    cfg = DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock")
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    daemon.steering.inputs.cpu = IdleCpu()
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, str(cfg.socket),
                               str(Path(__file__).parent)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    forger = socket.socket(socket.AF_UNIX)
    try:
        assert victim.stdout.readline() == "ready\n"
        forger.connect(str(cfg.socket))
        # It even claims to be the victim's pid: the kernel says otherwise.
        forger.sendall(b'{"v":1,"type":"hello","client":"forger","pid":4242}\n'
                       b'{"v":1,"type":"subscribe"}\n' + b"".join(
                           json.dumps({"v": 1, "type": "sample", "series": "e2e",
                                       "modality": "vision", "value_ms": 900}).encode() + b"\n"
                           for _ in range(20)))
        deadline = time.monotonic() + 10
        while sum(c.subscribed for c in daemon.server.clients.values()) < 2 or \
                "request_latency{series=e2e,modality=vision}" not in daemon.messages.request_senders:
            assert time.monotonic() < deadline, "the clients were not served"
            daemon.tick()
        forged = "request_latency{series=e2e,modality=vision}"
        assert set(daemon.messages.request_senders[forged]) == {__import__("os").getpid()}
        daemon.alarms.act([{"detector": "p99_drift", "series": forged, "state": "firing", "ts_ns": 1,
                      "evidence": {"p99": 0.9, "baseline": 0.01}}])
        daemon.tick()
        kernel = SeriesKey(RUNQ, pid=victim.pid)      # a kernel series, as ingest makes it
        daemon.streams.series_id(kernel)
        daemon.alarms.act([{"detector": "p99_drift", "series": str(kernel),
                      "state": "firing", "ts_ns": 2, "evidence": {"p99": 0.004,
                                                                   "baseline": 0.001}}])
        daemon.tick()
        sent = [h["kind"] for h in daemon.steering.audit() if h.get("outcome") == "sent"]
        assert "degrade" in sent and "cpu_contention" in sent, sent
        for _ in range(10):
            daemon.tick()
        victim.stdin.write("read\n")
        victim.stdin.flush()
        seen_by_victim = json.loads(victim.stdout.readline())
        seen_by_forger = hints_of(forger)
    finally:
        forger.close()
        victim.kill()
        victim.wait()
        daemon.close()
    assert "degrade" in seen_by_forger and "cpu_contention" in seen_by_forger, seen_by_forger
    assert seen_by_victim == ["cpu_contention"], seen_by_victim
