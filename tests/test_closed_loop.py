"""The closed loop end to end: the real daemon (eBPF, the hint policy), the
demo server on the Dispatcher whose device worker calls the real libcudart,
mixed load, and CPU contention injected on the server's CPU, with hints off
and on in turn under the same contention (demo/closed_loop.py)."""

import io
import sys
from pathlib import Path

import pytest

from mmtrace.agent.recording import file_format as recording

pytestmark = [pytest.mark.bpf, pytest.mark.slow]
DEMO = Path(__file__).resolve().parent.parent / "demo"


@pytest.fixture
def closed_loop(monkeypatch):
    pytest.importorskip("torch")
    from gpu_fixtures import cudart_path
    if cudart_path() is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    monkeypatch.syspath_prepend(str(DEMO))
    import closed_loop
    return closed_loop


def test_hints_cut_the_text_tail_under_contention_and_lapse_when_the_agent_dies(closed_loop, tmp_path):
    cl = closed_loop
    plan = cl.Plan(baseline_s=12.0, phase_s=7.0, rounds=3, detect_timeout_s=60.0)
    out = io.StringIO()
    result = cl.run(plan, tmp_path, out=out)
    sys.stdout.write(out.getvalue() + "\n".join(cl.table_lines(result)) + "\n")

    # the anomaly fires and the dispatcher applies its hint within 1 s
    assert result.first_apply_ms is not None, "no hint followed an anomaly after contention began"
    assert 0 <= result.first_apply_ms <= 1000
    # with hints on, the text stream's p99 under contention is >= 30 % lower
    off, on = (result.table[name] for name in (cl.HINTS_OFF, cl.HINTS_ON))
    assert off["n"] >= 100 and on["n"] >= 100
    assert on["p99_ms"] <= 0.7 * off["p99_ms"], result.table
    # the vision queue still makes progress in every phase
    assert all(result.vision_done[name] > 0 for name in (cl.HINTS_OFF, cl.HINTS_ON))
    # the agent killed, the dispatcher is back on its defaults within the TTL
    assert result.hints_active_at_kill > 0
    assert result.defaults_after_kill_s is not None
    assert result.defaults_after_kill_s <= plan.ttl_s + 0.2
    # the sequence is in the daemon's state and in its flight recordings
    assert result.hints_sent > 0 and result.policy["issued"].get("modality_batch", 0) >= 1
    assert any(e["outcome"] == "sent" and e["kind"] == "modality_batch"
               for e in result.policy["audit"])
    assert result.flight_recordings
    rec = recording.read_recording(result.flight_recordings[-1])
    assert "hint_audit" in rec.meta[0] and rec.footer["anomaly"]["state"] == "firing"
    assert len(rec.events["request.latency"]) > 0
    assert result.errors == 0
