"""The diagnosis on known inputs: the time split of run-queue and device
records whose intervals are known, the rules that turn shares into
verdicts, the live share detectors' thresholds, and explain's window."""

import json

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT
from mmtrace.detectors.diagnosis import DiagnosisRules, diagnose, window_shares
from mmtrace.detectors.starvation import Starvation, sorted_median, sorted_quantile
from mmtrace.detectors.time_split import ThreadInfo, TimeSplit, split_intervals

from mmtrace.agent.config.settings import DiagnosisSettings
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.recording.explain import device_roles, entropy_windows
from mmtrace.agent.recording.window_arg import parse_window

S = 1_000_000_000
MS = 1_000_000
INFOS = device_stream.default_infos()
API = {info.symbol: api_id for api_id, info in INFOS.items()}


def runq(rows):
    """(ts, delay, blocked, pid, tid, prev_tid, comm) switch-ins."""
    out = np.zeros(len(rows), RUNQ_EVENT)
    for i, (ts, delay, blocked, pid, tid, prev, comm) in enumerate(rows):
        out[i]["ts_ns"], out[i]["delay_ns"], out[i]["blocked_ns"] = ts, delay, blocked
        out[i]["pid"], out[i]["tid"], out[i]["prev_tid"], out[i]["comm"] = pid, tid, prev, comm
    return out


def calls(rows):
    """(ts, duration, symbol, pid, tid, ret, bytes) device calls, aligned."""
    out = np.zeros(len(rows), device_stream.ALIGNED_EVENT)
    for i, (ts, duration, symbol, pid, tid, ret, nbytes) in enumerate(rows):
        info = INFOS[API[symbol]]
        out[i]["ts_ns"], out[i]["duration_ns"], out[i]["api"] = ts, duration, info.id
        out[i]["kind"] = device_stream.KIND_IDS[info.kind]
        out[i]["flags"] = device_stream.FLAG_RETURNED
        out[i]["pid"], out[i]["tid"], out[i]["ret"], out[i]["bytes"] = pid, tid, ret, nbytes
        out[i]["comm"], out[i]["retired_ns"] = b"launcher", -1
    return out


def launcher(split, start_s, seconds, *, runnable_ms=0, blocked_ms=0, sync_ms=0, copy_ms=0,
             pid=100, tid=101, holder=900, per_s=10):
    """A thread that, `per_s` times a second for `seconds`, waits runnable,
    sleeps, syncs and copies for the given ms (each a tenth of it per step)
    and launches once."""
    step = S // per_s
    rq, dev = [], []
    for k in range(int(seconds * per_s)):
        t0 = start_s * S + k * step
        # asleep (blocked, and inside any sync/copy), then runnable, then running
        sleep = (blocked_ms + sync_ms + copy_ms) * MS // per_s
        wait = runnable_ms * MS // per_s
        rq.append((t0 + sleep + wait, wait, sleep, pid, tid, holder, b"launcher"))
        dev.append((t0 + sleep + wait + 1000, 0, "cudaLaunchKernel", pid, tid, 0, 0))
        if sync_ms:
            dev.append((t0, sync_ms * MS // per_s, "cudaStreamSynchronize", pid, tid, 0, 0))
        if copy_ms:
            dev.append((t0 + sync_ms * MS // per_s, copy_ms * MS // per_s, "cudaMemcpy", pid,
                        tid, 0, 4 << 20))
    split.add_runq(runq(rq))
    split.add_device(calls(dev))


def fresh():
    return TimeSplit(device_roles(INFOS))


def test_intervals_are_cut_at_slice_edges_and_keep_their_length():
    rows, slices, lengths = split_intervals(np.array([0, 900, 2500]), np.array([100, 2100, 2600]),
                                            1000)
    assert sorted(zip(rows.tolist(), slices.tolist(), lengths.tolist())) == [
        (0, 0, 100), (1, 0, 100), (1, 1, 1000), (1, 2, 100), (2, 2, 100)]


def test_the_split_of_a_known_thread_adds_up_to_its_wall_time():
    split = fresh()
    launcher(split, 10, 5, runnable_ms=200, blocked_ms=300, sync_ms=100, copy_ms=50)
    shares = diagnose(split, 11 * S, 14 * S)["processes"][0]["shares"]
    assert shares == pytest.approx({"on_cpu": 0.35, "runnable": 0.2, "sync": 0.1,
                                    "copy": 0.05, "blocked": 0.3}, abs=0.01)


def test_the_wait_for_a_cpu_that_ends_a_sync_is_runnable_not_the_devices():
    """A busy host: each 100 ms step runs 20 ms, syncs (the device takes
    5 ms, then the wake-up waits 30 ms for a CPU), runs 5 ms, sleeps 35 ms
    and waits 5 ms. The sync's call lasts 35 ms; 30 of them are the CPU's."""
    split = fresh()
    rq, dev = [], []
    for k in range(30):
        t0 = 10 * S + k * 100 * MS
        rq.append((t0 + 55 * MS, 30 * MS, 5 * MS, 100, 101, 900, b"launcher"))
        rq.append((t0 + 100 * MS, 5 * MS, 35 * MS, 100, 101, 900, b"launcher"))
        dev.append((t0 + 1 * MS, 0, "cudaLaunchKernel", 100, 101, 0, 0))
        dev.append((t0 + 20 * MS, 35 * MS + 10_000, "cudaStreamSynchronize", 100, 101, 0, 0))
    split.add_runq(runq(rq))
    split.add_device(calls(dev))
    process = diagnose(split, 11 * S, 13 * S)["processes"][0]
    assert process["shares"] == pytest.approx({"on_cpu": 0.25, "runnable": 0.35, "sync": 0.05,
                                               "copy": 0.0, "blocked": 0.35}, abs=0.01)
    assert process["verdict"] == "cpu_starved"


def test_levels_alone_make_the_verdicts():
    for kwargs, verdict in (({"runnable_ms": 400, "blocked_ms": 100}, "cpu_starved"),
                            ({"sync_ms": 700}, "device_bound"),
                            ({"copy_ms": 500, "blocked_ms": 100}, "bus_bound"),
                            ({"blocked_ms": 50}, "host_bound"),
                            ({"blocked_ms": 500}, "healthy"),
                            ({"blocked_ms": 950}, "healthy")):   # idle: no level for sleep
        split = fresh()
        launcher(split, 10, 3, **kwargs)
        process = diagnose(split, 10 * S, 13 * S)["processes"][0]
        assert process["verdict"] == verdict, (kwargs, process["shares"], process["causes"])


def test_sleep_is_a_cause_only_where_it_rose_and_the_rest_shrinking_counts():
    split = fresh()
    launcher(split, 0, 10, blocked_ms=600)            # 60 % asleep, as usual
    launcher(split, 10, 5, blocked_ms=880)            # then 88 %: the rest cut from 40 to 12
    process = diagnose(split, 10 * S, 15 * S)["processes"][0]
    assert process["verdict"] == "blocked"
    assert process["reference"]["shares"]["blocked"] == pytest.approx(0.6, abs=0.01)
    # The same 88 % with nothing before it is what an idle server looks like.
    alone = fresh()
    launcher(alone, 10, 5, blocked_ms=880)
    assert diagnose(alone, 10 * S, 15 * S)["processes"][0]["verdict"] == "healthy"


def test_a_small_rise_of_a_small_share_is_no_cause():
    split = fresh()
    launcher(split, 0, 10, runnable_ms=20, blocked_ms=500)
    launcher(split, 10, 5, runnable_ms=60, blocked_ms=500)      # 2 % -> 6 %: 3x, but 4 points
    assert diagnose(split, 10 * S, 15 * S)["processes"][0]["verdict"] == "healthy"


def test_culprits_are_the_threads_that_held_the_cpu_named_by_their_own_records():
    split = fresh()
    launcher(split, 10, 3, runnable_ms=500, holder=900)
    # The hog's own switch-ins name it and its process.
    split.add_runq(runq([(10 * S + 5, 1000, 0, 899, 900, 0, b"cpu_hog")]))
    process = diagnose(split, 10 * S, 13 * S)["processes"][0]
    assert process["culprits"] == [{"pid": 899, "tid": 900, "comm": "cpu_hog", "share": 1.0}]
    assert any("cpu_hog" in link for link in process["chain"])
    assert any("pid 899 (cpu_hog)" in fix for fix in process["fixes"])


def test_a_holder_named_while_it_ran_keeps_its_name_after_it_exits():
    """Live, the holders no record names are read from /proc each window,
    while they run; asked later, a hog that has exited is still named."""
    split = fresh()
    alive = {900: ThreadInfo(899, "cpu_hog")}
    split.resolve = alive.get
    launcher(split, 10, 3, runnable_ms=500, holder=900)
    assert split.name_holders(12 * S) == 1
    assert split.name_holders(12 * S) == 0          # named once
    alive.clear()                                   # the hog exits
    process = diagnose(split, 10 * S, 13 * S)["processes"][0]
    assert process["culprits"] == [{"pid": 899, "tid": 900, "comm": "cpu_hog", "share": 1.0}]
    gone = fresh()
    launcher(gone, 10, 3, runnable_ms=500, holder=900)
    assert diagnose(gone, 10 * S, 13 * S)["processes"][0]["culprits"][0]["comm"] is None


def test_an_npu_launchers_sync_waits_are_its_queue():
    split = fresh()
    rq, dev = [], []
    for k in range(20):
        t0 = 10 * S + k * S // 10
        rq.append((t0 + 80 * MS, 0, 80 * MS, 7, 7, 0, b"npu"))
        dev.append((t0 + 80 * MS + 1000, 0, "aclopExecuteV2", 7, 7, 0, 0))
        dev.append((t0, 80 * MS, "aclrtSynchronizeStream", 7, 7, 0, 0))
    split.add_runq(runq(rq))
    split.add_device(calls(dev))
    assert diagnose(split, 10 * S, 12 * S)["processes"][0]["verdict"] == "npu_queue"


def test_failed_calls_are_no_work_but_their_time_is_the_threads():
    split = fresh()
    split.add_device(calls([(S, 2 * MS, "cudaMemcpy", 5, 5, 35, 1 << 20)] * 3))
    process = diagnose(split, S, 2 * S, pids=[5])["processes"][0]
    assert process["failed_calls"] == 3 and process["copy_bytes"] == 0
    assert process["submissions"] == 0


def test_an_entropy_shift_is_a_cause_for_the_share_of_the_window_it_held():
    split = fresh()
    launcher(split, 10, 4, blocked_ms=500)
    shifted = entropy_windows([{"detector": "attention_entropy", "kind": "entropy_rise",
                                "state": "firing", "ts_ns": 11 * S}], 13 * S)
    assert shifted == [(11 * S, 13 * S)]
    process = diagnose(split, 10 * S, 14 * S, entropy_windows=shifted)["processes"][0]
    assert process["verdict"] == "input_shift"
    assert process["causes"][0]["share"] == pytest.approx(0.5, abs=0.01)


def test_slices_coarsen_past_their_bound_and_the_shares_hold():
    split = TimeSplit(device_roles(INFOS), max_rows=64)
    launcher(split, 0, 100, runnable_ms=300, blocked_ms=200, per_s=4)
    assert split.slice_ns > S
    rows = sum(len(t.rows()) for t in (split.threads_table, split.device_table,
                                       split.culprit_table))
    assert rows <= 64
    shares = diagnose(split, 0, 100 * S)["processes"][0]["shares"]
    assert shares["runnable"] == pytest.approx(0.3, abs=0.02)


@given(st.lists(st.one_of(st.floats(0, 1), st.sampled_from([0.0, 0.1, 1 / 3, 0.5, 1e-9])),
                min_size=1, max_size=70),
       st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]), st.floats(0, 1)))
@example([0.1, 0.2], 0.5)
@example([0.3], 0.9)
@example([0.1, float("nan"), 0.2], 0.9)
@example([0.3, float("nan"), 0.1, 0.2, 0.05], 0.5)
def test_a_watchs_baseline_and_noise_are_numpys_median_and_quantile_to_the_bit(values, q):
    ordered = sorted(values)
    same = np.testing.assert_array_equal     # NaN equals NaN
    same(sorted_median(ordered), float(np.median(values)))
    same(sorted_quantile(ordered, q), float(np.quantile(values, q)))


def test_a_starved_window_fires_after_consecutive_ones_and_a_noisy_baseline_cannot_blind_it():
    watch = Starvation(level=0.1, rise_factor=1.5, rise_share=0.1, consecutive=2,
                       clear_windows=2, baseline_windows=10, baseline_cap=0.1)
    out = []
    for w in range(10):                         # a noisy host: 8-9 % runnable
        out += watch.observe(w * S, {1: (0.08 + 0.01 * (w % 2), 1.0, "x")})
    assert out == [] and watch.threshold(1) == pytest.approx(0.1)
    assert watch.observe(10 * S, {1: (0.12, 1.0, "x")}) == []
    (fired,) = watch.observe(11 * S, {1: (0.12, 1.0, "x")})
    assert fired["state"] == "firing" and fired["kind"] == "cpu_starved"
    assert fired["evidence"]["share"] == 0.12 and fired["evidence"]["threshold"] == 0.1
    assert fired["key"] == {"kind": "runq_share", "pid": 1}
    # A window the launcher hardly lived in is neutral; two calm ones resolve.
    assert watch.observe(12 * S, {1: (0.0, 0.2, "x")}) == []
    assert watch.observe(13 * S, {1: (0.02, 1.0, "x")}) == []
    (resolved,) = watch.observe(14 * S, {1: (0.02, 1.0, "x")})
    assert resolved["state"] == "resolved"


def test_a_busy_hosts_usual_waiting_is_no_alarm_but_half_the_time_always_is():
    """The defaults, on a host whose background makes a launcher wait 20-35 %
    of every second (the detection bench's busy host): quiet for a minute,
    it fires when that grows by half, and a launcher that waits 60 % from
    its first second fires with no baseline at all."""
    busy = Starvation()
    out = []
    for w in range(60):
        out += busy.observe(w * S, {1: (0.2 + 0.15 * ((w * 7) % 5) / 4, 1.0, "x")})
    assert out == []
    assert busy.baseline(1) == pytest.approx(0.2 + 0.15 * 2 / 4)
    assert busy.threshold(1) == pytest.approx(min(0.5, busy.baseline(1) * 1.5))
    assert busy.observe(60 * S, {1: (0.42, 1.0, "x")}) == []
    assert busy.observe(61 * S, {1: (0.42, 1.0, "x")}) == []      # three windows in a row fire
    (fired,) = busy.observe(62 * S, {1: (0.42, 1.0, "x")})
    assert fired["state"] == "firing" and fired["evidence"]["threshold"] == 0.4125
    # The daemon's watch (noise_quantile 0.9): a second in ten of this
    # launcher waits 35 %, so its threshold stays rise_share above that.
    noisy = Starvation(noise_quantile=0.9)
    for w in range(60):
        assert noisy.observe(w * S, {1: (0.2 + 0.15 * ((w * 7) % 5) / 4, 1.0, "x")}) == []
    assert noisy.threshold(1) == pytest.approx(0.35 + 0.1)
    assert noisy.observe(60 * S, {1: (0.42, 1.0, "x")}) == []
    assert noisy.observe(61 * S, {1: (0.42, 1.0, "x")}) == []
    assert noisy.observe(62 * S, {1: (0.46, 1.0, "x")}) == []
    assert noisy.observe(63 * S, {1: (0.46, 1.0, "x")}) == []
    (fired,) = noisy.observe(64 * S, {1: (0.46, 1.0, "x")})
    assert fired["evidence"]["threshold"] == 0.45
    fresh_host = Starvation()
    assert fresh_host.observe(0, {2: (0.6, 1.0, "y")}) == []
    assert fresh_host.observe(S, {2: (0.6, 1.0, "y")}) == []
    (starved,) = fresh_host.observe(2 * S, {2: (0.6, 1.0, "y")})
    assert starved["evidence"]["threshold"] == 0.5 and starved["evidence"]["baseline"] is None


def test_a_launchers_own_noise_is_no_alarm_and_the_daemon_watches_with_it():
    """Alone on a host, a launcher sleeping between 2 ms steps waits 15 % of
    a median second and 24 % of one in ten (bench_detection.py
    --background none): the median's rule alone puts the threshold at
    0.25 and two such seconds in a row fired it. The noise term keeps it
    quiet there, and three hogs (half its time waiting) still fire it."""
    seconds = (0.10, 0.12, 0.13, 0.14, 0.15, 0.15, 0.16, 0.18, 0.22, 0.24)
    shares = [seconds[(w * 7) % 10] for w in range(60)]      # median 0.15, p90 0.222
    # Two windows in a row fired then (the default is three now).
    plain, noisy = Starvation(consecutive=2), Starvation(noise_quantile=0.9, consecutive=2)
    for w, share in enumerate(shares):
        plain.observe(w * S, {1: (share, 1.0, "x")})
        noisy.observe(w * S, {1: (share, 1.0, "x")})
    assert plain.threshold(1) == pytest.approx(0.25)
    assert noisy.threshold(1) == pytest.approx(0.322)
    spike = [(60, 0.26), (61, 0.26)]
    assert [a["state"] for w, x in spike for a in plain.observe(w * S, {1: (x, 1.0, "x")})] \
        == ["firing"]
    assert [a for w, x in spike for a in noisy.observe(w * S, {1: (x, 1.0, "x")})] == []
    hogs = [a for w in (62, 63) for a in noisy.observe(w * S, {1: (0.48, 1.0, "x")})]
    assert [a["state"] for a in hogs] == ["firing"]
    assert Starvation.of(DiagnosisSettings()).noise_quantile == 0.9
    assert Starvation.of(DiagnosisSettings()).consecutive == 3
    assert Starvation.of(DiagnosisSettings(), state="on_cpu").noise_quantile is None


def test_a_quiet_launcher_fires_on_a_smaller_rise_and_sleep_only_on_a_rise():
    quiet = Starvation(level=0.1, rise_factor=1.5, rise_share=0.04, consecutive=1,
                       baseline_windows=10)
    for w in range(5):
        quiet.observe(w * S, {1: (0.01, 1.0, "x")})
    assert quiet.threshold(1) == pytest.approx(0.05)
    sleep = Starvation(level=None, rise_factor=1.5, rise_share=0.1, consecutive=1,
                       baseline_windows=10, baseline_cap=1.0, state="blocked")
    assert sleep.threshold(1) is None
    assert sleep.observe(0, {1: (0.99, 1.0, "x")}) == []       # no baseline: nothing fires
    for w in range(1, 6):
        sleep.observe(w * S, {1: (0.6, 1.0, "x")})
    assert sleep.threshold(1) == pytest.approx(0.7333, abs=1e-3)    # the rest cut 1.5x
    (fired,) = sleep.observe(6 * S, {1: (0.8, 1.0, "x")})
    assert fired["detector"] == "time_share" and fired["kind"] == "blocked"


def test_window_shares_are_what_the_live_watches_read():
    split = fresh()
    launcher(split, 10, 2, runnable_ms=250, blocked_ms=250)
    shares, lived, comm = window_shares(split, 10 * S, 11 * S)[100]
    assert shares["runnable"] == pytest.approx(0.25, abs=0.01) and lived == pytest.approx(1.0)
    assert comm == "launcher"


@pytest.mark.parametrize("text, expected", [
    ("12.5:20", (12_500_000_000, 20_000_000_000)),
    ("1234567890123:1234567890999", (1234567890123, 1234567890999)),
    ("10:11", (10 * S, 11 * S)),
])
def test_windows_are_read_in_seconds_or_nanoseconds(text, expected):
    assert parse_window(text) == expected


@pytest.mark.parametrize("text, message", [
    ("20:10", "END after START"), ("abc", "START:END"),
    ("1:" + "9" * 30, r"below 2\*\*63 ns"), ("1:" + "9" * 65, "START:END"),
    ("1.0:9999999.0", "at most"), ("110000000000:111000000000", "read in s"),
    ("-1:5", "START:END"),
])
def test_bad_windows_say_what_was_expected(text, message):
    with pytest.raises(MmtraceError, match=message):
        parse_window(text)


def test_rules_come_from_the_settings_by_name():
    from mmtrace.agent.config.settings import DiagnosisSettings
    rules = DiagnosisRules.of(DiagnosisSettings(starved_share=0.3, reference_s=20.0))
    assert rules.starved_share == 0.3 and rules.reference_s == 20.0
    assert rules.sync_share == DiagnosisSettings().sync_share


def write_launcher_recording(path, seconds, runq_dtype=RUNQ_EVENT, config=None, **kwargs):
    """A recording of launcher()'s records, through the real writer."""
    from mmtrace.agent.recording import file_format as recording
    split = fresh()
    captured = {}
    split.add_runq = lambda r: captured.setdefault("runq", r)
    split.add_device = lambda d: captured.setdefault("dev", d)
    launcher(split, 10, seconds, **kwargs)
    rq = np.zeros(len(captured["runq"]), runq_dtype)
    for name in runq_dtype.names:
        rq[name] = captured["runq"][name]
    dev = np.zeros(len(captured["dev"]), device_stream.DEV_EVENT)
    for name in device_stream.DEV_EVENT.names:
        dev[name] = captured["dev"][name]
    w = recording.RecordingWriter(path, {"cpu.runq": runq_dtype,
                                         "dev.event": device_stream.DEV_EVENT})
    w.write_meta({"apis": device_stream.default_table().to_json(),
                  **({"config": config} if config is not None else {})})
    w.write_events("cpu.runq", rq)
    w.write_events("dev.event", dev[np.argsort(dev["ts_ns"], kind="stable")])
    w.close({"duration_s": float(seconds), "lost_events": 0, "counters": {}})
    return path


def test_report_weighs_the_streams_and_says_when_it_is_too_short(tmp_path):
    from mmtrace.agent.recording import file_format as recording
    from mmtrace.agent.recording.report import format_text, summarize
    short = summarize(recording.read_recording(
        write_launcher_recording(tmp_path / "s.mmtr", 8, runnable_ms=400, blocked_ms=100)))
    (process,) = short["diagnosis"]["processes"]
    assert process["verdict"] == "cpu_starved" and process["pid"] == 100
    assert short["detector_notes"] and "20 s of normal windows" in short["detector_notes"][0]
    text = format_text(short)
    assert "cpu_starved" in text and "mmtrace explain" in text and "20 s of normal" in text
    long = summarize(recording.read_recording(
        write_launcher_recording(tmp_path / "l.mmtr", 40, runnable_ms=30, blocked_ms=500,
                                 per_s=50)))
    assert long["detector_notes"] == []
    learnt = [b for b in long["p99_baselines"] if b["baseline_s"] is not None]
    assert learnt and all(b["threshold_s"] > b["baseline_s"] for b in learnt)
    assert long["diagnosis"]["processes"][0]["verdict"] == "healthy"


def test_a_recording_from_before_blocked_time_is_explained_and_says_so(tmp_path, mmtrace_cli):
    old = np.dtype([(n, RUNQ_EVENT.fields[n][0]) for n in RUNQ_EVENT.names if n != "blocked_ns"])
    path = write_launcher_recording(tmp_path / "old.mmtr", 6, runq_dtype=old, runnable_ms=400,
                                    blocked_ms=100)
    run = mmtrace_cli("explain", path, "--json")
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    assert "predates blocked time" in answer["note"]
    assert answer["processes"][0]["verdict"] == "cpu_starved"


@pytest.mark.parametrize("args, message", [
    (["--window", "5:1"], "END after START"),
    (["--window", "x"], "START:END"),
    ([], "no such file"),
    (["--window", "0:1"], "outside what there is to explain"),
    (["--pid", "99999"], "no GPU/NPU call or switch-in of that process"),
])
def test_explain_refuses_bad_input_in_one_line(tmp_path, mmtrace_cli, args, message):
    path = tmp_path / "nothing.mmtr"
    if "no such file" != message:
        write_launcher_recording(path, 4, runnable_ms=100)
    run = mmtrace_cli("explain", path, *args)
    assert run.returncode == 2
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr
    assert message in run.stderr.lower() or message in run.stderr


def test_settings_a_recording_carries_are_checked_before_use(tmp_path, mmtrace_cli):
    """A flight recording carries the daemon's settings; a crafted or foreign
    one whose [diagnosis] is not numbers gets the defaults, not a crash."""
    bad = write_launcher_recording(tmp_path / "bad.mmtr", 6, runnable_ms=400,
                                   config={"diagnosis": {"reference_s": "x",
                                                         "min_reference_s": -5}})
    run = mmtrace_cli("explain", bad, "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["rules"]["reference_s"] == 10.0
    good = write_launcher_recording(tmp_path / "good.mmtr", 6, runnable_ms=400,
                                    config={"diagnosis": {"starved_share": 0.5}})
    answer = json.loads(mmtrace_cli("explain", good, "--json").stdout)
    assert answer["rules"]["starved_share"] == 0.5
    assert answer["processes"][0]["verdict"] == "healthy"       # 40 % < 50 %, no reference


def test_a_window_out_of_the_ordinary_teaches_no_baseline():
    """While a launcher is starved its time on the CPU falls; that is not
    its usual, and after the hogs go its CPU time must not look like a rise."""
    on_cpu = Starvation(level=None, rise_factor=1.5, rise_share=0.1, consecutive=2,
                        baseline_windows=10, baseline_cap=1.0, state="on_cpu")
    for w in range(5):
        on_cpu.observe(w * S, {1: (0.5, 1.0, "x")})
    for w in range(5, 15):                  # starved: on_cpu 0.1, another part disturbed
        assert on_cpu.observe(w * S, {1: (0.1, 1.0, "x")}, disturbed={1}) == []
    assert on_cpu.baseline(1) == pytest.approx(0.5)
    assert on_cpu.observe(15 * S, {1: (0.5, 1.0, "x")}) == []
    assert on_cpu.observe(16 * S, {1: (0.5, 1.0, "x")}) == []
