"""The daemon end to end on real eBPF: forced CPU contention on a thread
launching through the real libcudart fires a P99-drift anomaly on its
run-queue delay, and the flight recording holds the seconds before it."""

import json
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from daemon_process import FAST_P99, launch_phases, start_daemon
from mmtrace.agent.recording import file_format as recording

pytestmark = pytest.mark.bpf

CONFIG = """
ring_seconds = 30.0
metrics_address = "127.0.0.1:0"     # any free port: :9464 may be taken on a shared host
# Every firing writes its own recording: an alarm the shared host raised
# before the contention must not hold back the contention's (at 5 s apart
# it did, once in CI).
flight_min_interval_s = 0.0
""" + FAST_P99


def test_contention_fires_runq_drift_and_a_flight_recording(tmp_path):
    cudart, launcher = launch_phases()
    (tmp_path / "mmtrace.toml").write_text(CONFIG)
    state = tmp_path / "state"
    log = []
    daemon = start_daemon(["--config", tmp_path / "mmtrace.toml", "--state-dir", state,
                           "--socket", tmp_path / "hint.sock", "--lib", cudart], log)
    try:
        work = subprocess.run([launcher, "8", "6", "1"], capture_output=True, text=True,
                              timeout=60, check=True)
        time.sleep(1.5)
    finally:
        daemon.send_signal(signal.SIGTERM)
        out, _ = daemon.communicate(timeout=60)
        log.append(out)
    text = "".join(log)
    assert daemon.returncode == 0, text
    first = json.loads(work.stdout.splitlines()[0])
    pid, tid, contention_ns = first["pid"], first["launcher_tid"], first["contention_ns"]
    assert re.search(rf"anomaly p99_drift runq_delay\{{pid={pid}\}} firing", text), text
    # The alarm the contention raised (a shared host may have raised one
    # before it; each firing has its own flight recording).
    recs = [recording.read_recording(f) for f in sorted(state.glob("flight-*runq_delay*.mmtr"))]
    recs = [r for r in recs if r.footer["anomaly"]["ts_ns"] > contention_ns]
    assert recs, text
    rec = recs[0]
    assert rec.complete and not rec.warnings
    anomaly = rec.footer["anomaly"]
    assert anomaly["series"] == f"runq_delay{{pid={pid}}}"
    # fired within a few windows of the contention
    assert anomaly["ts_ns"] < contention_ns + 3e9
    runq = rec.events["cpu.runq"]
    mine = runq[runq["tid"] == tid]
    # The seconds before the alarm: calm launches, then the contention.
    assert mine["ts_ns"].min() < contention_ns - 3e9
    calm = mine[mine["ts_ns"] < contention_ns]["delay_ns"]
    hot = mine[mine["ts_ns"] >= contention_ns]["delay_ns"]
    assert len(calm) > 1000 and len(hot) > 100
    assert np.percentile(hot, 99) > 5 * np.percentile(calm, 99)
    dev = rec.events["dev.event"]
    assert np.count_nonzero(dev["pid"] == pid) > 100
    assert any(p.get("state") == "attached" for d in rec.meta for p in d.get("probes", []))
