"""detectors/call_failures.py: a storm of failed calls fires after
`consecutive` bad windows and resolves after `clear_windows` good ones; a
failure now and then, or failures that are a small share of the calls, do
not fire. And over a recording, `report` lists the storm."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mmtrace.agent.cli import cli
from mmtrace.agent.recording import file_format
from mmtrace.bpf import device as device_stream
from mmtrace.detectors.call_failures import CallFailures

S = 10**9
ERR = "cudaErrorIllegalAddress (700)"


def calls(pid, start_s, seconds, per_s, failing_share):
    """`per_s` calls a second for `seconds`, the first `failing_share` of
    each second's failing."""
    n = int(seconds * per_s)
    ts = start_s * S + np.arange(n) * (S // per_s)
    failed = (np.arange(n) % per_s) < failing_share * per_s
    api = ["cudaLaunchKernel"] * n
    error = [ERR if f else None for f in failed]
    return np.full(n, pid), ts, failed, api, error


def feed_all(detector, *parts):
    out = []
    for part in parts:
        out += detector.feed(*part)
    return out


def test_a_storm_fires_after_three_bad_windows_and_resolves_after_five_good():
    d = CallFailures()
    found = feed_all(d, calls(7, 0, 2, 100, 0.0), calls(7, 2, 4, 100, 1.0),
                     calls(7, 6, 8, 100, 0.0))
    assert [(a["state"], a["ts_ns"]) for a in found] == [("firing", 5 * S), ("resolved", 11 * S)]
    firing = found[0]
    assert firing["detector"] == "call_failures" and firing["series"] == "failed_calls{pid=7}"
    ev = firing["evidence"]
    assert ev["pid"] == 7 and ev["since_ns"] == 2 * S and ev["failed"] == 300
    assert ev["errors"] == [{"api": "cudaLaunchKernel", "error": ERR, "count": 300}]


@pytest.mark.parametrize("part, why", [
    (calls(7, 0, 10, 100, 0.2), "a fifth of the calls: under min_share"),
    (calls(7, 0, 10, 5, 1.0), "5 a second: under min_failures"),
])
def test_what_is_no_storm_does_not_fire(part, why):
    d = CallFailures()
    assert d.feed(*part) + d.tick(20 * S) == [], why


def test_a_process_that_goes_quiet_resolves_on_the_clock():
    d = CallFailures(consecutive=2, clear_windows=3)
    found = d.feed(*calls(9, 0, 3, 50, 1.0))
    found += d.tick(4 * S)       # the third window closes: still firing
    assert [a["state"] for a in found] == ["firing"]
    found += d.tick(10 * S)
    assert [(a["state"], a["ts_ns"]) for a in found] == [("firing", 2 * S), ("resolved", 6 * S)]
    assert d.processes == {}     # forgotten once nothing is pending


def test_processes_are_judged_apart_and_bounded():
    d = CallFailures(consecutive=1, max_processes=2)
    found = feed_all(d, calls(1, 0, 1, 20, 1.0), calls(2, 0, 1, 20, 0.0),
                     calls(3, 0, 1, 20, 1.0))
    found += d.tick(2 * S)
    assert [(a["evidence"]["pid"], a["state"]) for a in found] == [(1, "firing")]
    assert d.skipped == 20


@pytest.mark.parametrize("kw", [dict(window_s=0), dict(min_failures=0), dict(min_share=0),
                                dict(min_share=1.5), dict(consecutive=0), dict(clear_windows=0)])
def test_settings_out_of_range_are_refused(kw):
    with pytest.raises(ValueError, match="expected window_s > 0"):
        CallFailures(**kw)


def _storm_recording(path, symbol: str, ret: int, symbol_ids=None, symbol_names=None):
    """A recording whose process 77 fails every launch of `symbol` with
    `ret` for 5 s (500 calls from 10 s on)."""
    api = next(i for i, info in device_stream.default_infos().items() if info.symbol == symbol)
    n = 500
    ev = np.zeros(n, device_stream.DEV_EVENT)
    ev["ts_ns"] = 10 * S + np.arange(n) * (S // 100)
    ev["api"], ev["kind"] = api, device_stream.KIND_IDS["launch"]
    ev["pid"] = ev["tid"] = 77
    ev["op_id"] = np.arange(1, n + 1)
    ev["flags"], ev["ret"] = device_stream.FLAG_RETURNED, ret
    if symbol_ids is not None:
        ev["symbol_id"] = symbol_ids
    meta = {"apis": device_stream.default_table().to_json()}
    if symbol_names:
        meta["symbol_names"] = symbol_names
    w = file_format.RecordingWriter(path, {"dev.event": device_stream.DEV_EVENT})
    w.write_meta(meta)
    w.write_events("dev.event", ev)
    w.close({})
    return path


def test_report_points_at_the_storm(tmp_path):
    """A recording whose process fails every launch for 5 s."""
    path = _storm_recording(tmp_path / "storm.mmtr", "cudaLaunchKernel", 700)
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    [storm] = [a for a in json.loads(result.output)["anomalies"]
               if a["detector"] == "call_failures"]
    assert storm["state"] == "firing" and storm["ts_ns"] == 13 * S
    assert storm["evidence"]["errors"] == [{"api": "cudaLaunchKernel", "error": ERR,
                                            "count": 300}]
    text = CliRunner().invoke(cli, ["report", str(path)]).output
    assert f"failed_calls{{pid=77}} firing: 300 failed calls, most cudaLaunchKernel {ERR}" \
        in text


def test_report_names_each_failed_aclnn_op_apart(tmp_path):
    """aclnn launches of one API id are named by their op: a storm of them
    failing with one code counts each op apart (the rarest named first
    here, to catch a count by id and code alone naming all by it)."""
    step = np.arange(500) % 10          # Matmul, then Mul 3 times, then Add 6 times
    path = _storm_recording(tmp_path / "aclnn.mmtr", "aclnn", 561000,
                            np.where(step == 0, 1, np.where(step < 4, 3, 2)),
                            {"1": "aclnnMatmul", "2": "aclnnAdd", "3": "aclnnMul"})
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    [storm] = [a for a in json.loads(result.output)["anomalies"]
               if a["detector"] == "call_failures"]
    assert [(e["api"], e["count"]) for e in storm["evidence"]["errors"]] == [
        ("aclnnAdd", 180), ("aclnnMul", 90), ("aclnnMatmul", 30)]


def test_counted_by_pair_keys_as_call_by_call():
    """The daemon hands each call's (API, code) key too: the storm's
    errors, their counts and their order (ties by first seen) are those of
    a count call by call."""
    rng = np.random.default_rng(3)
    n = 4000
    pid = rng.choice([7, 8], n)
    ts = np.sort(rng.integers(0, 6 * S, n))
    pairs = rng.choice([5, 1, 3, 9], n)          # keys out of their first-seen order
    failed = rng.random(n) < 0.9
    text = {5: ("cudaMemcpy", "e5"), 1: ("cudaLaunchKernel", "e1"), 3: ("aclnnAdd", "e3"),
            9: ("cudaMemcpy", "e9")}
    api = np.array([text[k][0] if f else None for k, f in zip(pairs, failed)], object)
    error = np.array([text[k][1] if f else None for k, f in zip(pairs, failed)], object)
    by_call, by_pair = CallFailures(consecutive=1), CallFailures(consecutive=1)
    want, got = [], []
    for lo in range(0, n, 700):
        part = slice(lo, lo + 700)
        want += by_call.feed(pid[part], ts[part], failed[part], api[part], error[part])
        got += by_pair.feed(pid[part], ts[part], failed[part], api[part], error[part],
                            pairs[part])
    want += by_call.tick(10 * S)
    got += by_pair.tick(10 * S)
    assert want and got == want
