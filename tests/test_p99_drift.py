"""P99 drift: detection delay, false alarms, frozen baseline, state machine, bad input."""

import json

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from mmtrace.detectors.p99_alarms import ALLOWED_TRANSITIONS
from mmtrace.detectors.p99_drift import P99Drift

WINDOW_NS = 1_000_000_000
T0_WINDOW = 5_000  # windows start at 5000 s of CLOCK_MONOTONIC, like a host up for a while


def lognormal_ms(rng, n, scale=1.0, sigma=1.0):
    """Latencies in seconds around 1 ms with a heavy right tail."""
    return rng.lognormal(np.log(1e-3), sigma, n) * scale


def window_events(rng, first_window, counts):
    """(window index, ts_ns) for ``counts[i]`` events in window first_window + i."""
    windows = np.repeat(np.arange(first_window, first_window + len(counts)), counts)
    ts = windows * WINDOW_NS + rng.integers(0, WINDOW_NS, windows.size)
    return windows, ts


def run_block(detector, rng, first_window, counts, make_values, series_id=0, contributors=None):
    """Feed ``len(counts)`` windows of one series in one batch; returns the
    anomalies with the window index (relative to T0_WINDOW) each closed in."""
    windows, ts = window_events(rng, T0_WINDOW + first_window, counts)
    values = make_values(rng, windows.size, windows - T0_WINDOW)
    ids = np.full(windows.size, series_id)
    contrib = None if contributors is None else contributors(rng, windows.size, values)
    out = detector.observe(ids, ts, values, contrib)
    out += detector.advance((T0_WINDOW + first_window + len(counts)) * WINDOW_NS)
    return out


def decided_window(anomaly):
    """The window (relative to T0_WINDOW) whose close produced the anomaly."""
    return anomaly["ts_ns"] // WINDOW_NS - 1 - T0_WINDOW


# ------------------------------------------------------------------ detection


@pytest.mark.parametrize("sigma", [0.5, 1.0])
@pytest.mark.parametrize("seed", range(4))
def test_a_2x_p99_shift_is_detected_within_consecutive_windows(seed, sigma):
    rng = np.random.default_rng(seed)
    detector = P99Drift()
    detector.series_id("runq_delay{pid=123}")
    change = 100

    def values(rng, n, window):
        return lognormal_ms(rng, n, sigma=sigma) * np.where(window >= change, 2.0, 1.0)

    anomalies = run_block(detector, rng, 0, [2000] * 130, values)
    assert [a["state"] for a in anomalies] == ["firing"]
    delay = decided_window(anomalies[0]) - change + 1  # windows of shifted data seen
    assert detector.consecutive <= delay <= detector.consecutive + 1
    evidence = anomalies[0]["evidence"]
    assert 1.5 < evidence["p99"] / evidence["baseline"] < 2.7
    assert len(evidence["windows"]) == detector.consecutive
    assert evidence["samples"] == 2000 * detector.consecutive


@pytest.mark.parametrize(
    "name, make_values, mean_count",
    [
        ("lognormal sigma 1", lambda rng, n, w: lognormal_ms(rng, n, sigma=1.0), 300),
        ("pareto shape 2.5", lambda rng, n, w: 1e-3 * (rng.pareto(2.5, n) + 1.0), 1000),
        ("sparse lognormal sigma 1", lambda rng, n, w: lognormal_ms(rng, n, sigma=1.0), 40),
    ],
)
def test_stationary_heavy_tailed_series_raise_no_alarm_in_10000_windows(name, make_values, mean_count):
    rng = np.random.default_rng(11)
    detector = P99Drift()
    detector.series_id("sync_wait{pid=1,stream=0x0}")
    anomalies = []
    block = 500
    for first in range(0, 10_000, block):
        counts = rng.poisson(mean_count, block)
        anomalies += run_block(detector, rng, first, counts, make_values)
    assert anomalies == [], f"{name}: {len(anomalies)} false alarms"
    assert detector.state(0) in ("normal", "pending")


def test_frozen_baseline_does_not_absorb_a_sustained_shift():
    rng = np.random.default_rng(2)
    detector = P99Drift()
    detector.series_id("submit_to_retire{pid=9}")
    shift_from, shift_to = 100, 2100

    def values(rng, n, window):
        shifted = (window >= shift_from) & (window < shift_to)
        return lognormal_ms(rng, n) * np.where(shifted, 2.0, 1.0)

    anomalies = run_block(detector, rng, 0, [1000] * 110, values)
    assert [a["state"] for a in anomalies] == ["firing"]
    frozen = detector.baseline(0)
    # 2000 windows of the shifted level: the alarm holds, the baseline stays.
    for first in range(110, shift_to, 200):
        anomalies += run_block(detector, rng, first, [1000] * min(200, shift_to - first), values)
        assert detector.state(0) == "firing"
        assert detector.baseline(0) == frozen
    assert [a["state"] for a in anomalies] == ["firing"]
    anomalies += run_block(detector, rng, shift_to, [1000] * 20, values)
    assert [a["state"] for a in anomalies] == ["firing", "resolved"]
    resolved = anomalies[1]
    windows_after_end = decided_window(resolved) - shift_to + 1
    assert detector.clear_windows <= windows_after_end <= detector.clear_windows + 1
    assert resolved["evidence"]["fired_ts_ns"] == anomalies[0]["ts_ns"]
    assert detector.state(0) == "normal"


def test_one_shifted_series_among_64_fires_alone_and_names_the_slow_thread():
    rng = np.random.default_rng(4)
    detector = P99Drift()
    names = [f"runq_delay{{pid={1000 + i}}}" for i in range(64)]
    ids = np.array([detector.series_id(n) for n in names])
    anomalies = []
    for window in range(60):
        n = 64 * 1000
        series = np.repeat(ids, 1000)
        ts = (T0_WINDOW + window) * WINDOW_NS + rng.integers(0, WINDOW_NS, n)
        threads = rng.integers(0, 10, n) + 100 * series  # ten threads per process
        values = lognormal_ms(rng, n)
        if window >= 40:
            # Thread 1707 of pid 1017 starts waiting 5x longer on the run queue.
            values[threads == 1707] *= 5.0
        anomalies += detector.observe(series, ts, values, threads)
        anomalies += detector.advance((T0_WINDOW + window + 1) * WINDOW_NS)
    assert [(a["series"], a["state"]) for a in anomalies] == [(names[17], "firing")]
    firing = anomalies[0]
    assert firing["evidence"]["top_contributors"][0][0] == 1707
    assert json.loads(json.dumps(firing)) == firing
    assert set(firing) == {"detector", "series", "state", "ts_ns", "evidence"}
    assert firing["detector"] == "p99_drift"
    assert {"windows", "p99", "baseline", "factor", "samples", "top_contributors"} <= set(firing["evidence"])
    assert all(detector.state(i) in ("normal", "pending") for i in ids if i != 17)


# ------------------------------------------------------------------ windows


def constant_windows(detector, levels, counts, series_id=0, start=0):
    """One window per (level, count): ``count`` samples all equal to ``level``."""
    out = []
    for offset, (level, count) in enumerate(zip(levels, counts)):
        window = T0_WINDOW + start + offset
        ts = window * WINDOW_NS + np.arange(count, dtype=np.int64)
        out += detector.observe(np.full(count, series_id), ts, np.full(count, level))
        out += detector.advance((window + 1) * WINDOW_NS)
    return out


def small_detector(**overrides):
    settings = dict(baseline_windows=10, min_baseline_windows=5, min_samples=10, floor=1e-4)
    settings.update(overrides)
    detector = P99Drift(**settings)
    detector.series_id("s")
    return detector


def test_empty_and_sparse_windows_neither_count_nor_break_a_run():
    detector = small_detector()
    constant_windows(detector, [0.01] * 10, [50] * 10)
    # bad, empty, bad, sparse (below min_samples), bad: fires at the third bad window.
    anomalies = constant_windows(detector, [0.03, 0.03, 0.03, 0.03, 0.03], [50, 0, 50, 5, 50], start=10)
    assert [a["state"] for a in anomalies] == ["firing"]
    assert decided_window(anomalies[0]) == 14
    assert [w["count"] for w in anomalies[0]["evidence"]["windows"]] == [50, 50, 50]


def test_a_long_silence_is_skipped_at_once_and_ends_the_resolved_state():
    detector = small_detector(consecutive=1, clear_windows=1)
    constant_windows(detector, [0.01] * 10 + [0.05, 0.01], [50] * 12)
    assert detector.state(0) == "resolved"
    assert detector.advance((T0_WINDOW + 10**9) * WINDOW_NS) == []  # a billion empty windows
    assert detector.state(0) == "normal"


def test_pending_windows_that_turn_out_to_be_noise_join_the_baseline():
    detector = small_detector(baseline_windows=5, noise_sigmas=0.0)
    constant_windows(detector, [0.010] * 5, [50] * 5)
    # Two windows 30 % up (pending), then back: the two were noise and join
    # the baseline. Last five: 0.010 0.010 0.013 0.013 0.010 -> median 0.010.
    constant_windows(detector, [0.013, 0.013, 0.010], [50] * 3, start=5)
    assert detector.state(0) == "normal"
    assert detector.baseline(0) == pytest.approx(0.010, rel=0.02)
    # Once more: 0.013 0.010 0.013 0.013 0.010 -> median 0.013. Had the
    # pending windows been dropped, the baseline would still read 0.010.
    constant_windows(detector, [0.013, 0.013, 0.010], [50] * 3, start=8)
    assert detector.baseline(0) == pytest.approx(0.013, rel=0.02)


def test_floor_keeps_tiny_absolute_shifts_quiet():
    detector = small_detector(floor=1e-3)
    constant_windows(detector, [1e-5] * 10, [50] * 10)
    assert constant_windows(detector, [1e-4] * 10, [50] * 10, start=10) == []  # 10x, but only 90 us
    assert detector.state(0) == "normal"


def test_sink_receives_each_anomaly_and_a_failing_sink_is_counted():
    received = []
    detector = small_detector(sink=received.append)
    constant_windows(detector, [0.01] * 10 + [0.05] * 3, [50] * 13)
    assert [a["state"] for a in received] == ["firing"]

    def broken(anomaly):
        raise RuntimeError("exporter down")

    detector = small_detector(sink=broken)
    out = constant_windows(detector, [0.01] * 10 + [0.05] * 3 + [0.01] * 3, [50] * 16)
    assert [a["state"] for a in out] == ["firing", "resolved"]
    assert detector.sink_errors == 2


def test_reset_forgets_baseline_and_alarm():
    detector = small_detector()
    constant_windows(detector, [0.01] * 10 + [0.05] * 3, [50] * 13)
    assert detector.state("s") == "firing"
    detector.reset("s")
    assert detector.state("s") == "normal" and detector.baseline("s") is None


def test_dropped_series_free_their_windows_and_a_returning_name_starts_afresh():
    detector = small_detector()
    names = [f"runq_delay{{pid={i}}}" for i in range(1000)]
    ids = np.array([detector.series_id(n) for n in names])
    ts = np.full(ids.size, T0_WINDOW * WINDOW_NS)
    detector.observe(ids, ts, np.full(ids.size, 0.01))       # every series holds an open window
    held = detector._windows.ring.nbytes
    kept = names[::100]                                       # ids 1, 101, 201, ... move
    assert detector.drop([n for n in names if n not in kept]) == 990
    assert detector.drop(names[1:100] + ["never seen"]) == 0
    assert detector.names == ["s"] + kept
    assert detector._windows.ring.nbytes <= held // 32                # 1024 slots down to at most 32
    detector.observe(np.array([detector.series_id(kept[3])]), ts[:1], [0.02])
    detector.advance((T0_WINDOW + 1) * WINDOW_NS)
    assert detector.snapshot(kept[3])["last_count"] == 2      # its own event, and this one
    assert detector.snapshot(kept[4])["last_count"] == 1
    sid = detector.series_id(names[550])                     # dropped, then back
    assert detector.snapshot(sid) == {"series": names[550], "state": "normal", "baseline": None,
                                      "threshold": None, "last_p99": None, "last_count": 0,
                                      "accepted": 0, "rejected": 0, "late": 0}


def incident_with_a_drop(drop: bool, kept_of_8: tuple = (0, 1)):
    """64 series, pid 1017's thread 1707 slow from window 40; with `drop`,
    the series whose index modulo 8 is not in `kept_of_8` (not a prefix:
    every id after the first few moves) are dropped at window 42 while their events sit in open windows and
    among the tails: 48 leave 16, and the arrays shrink; 40 leave 24, and
    they are packed in place. The anomalies of the series kept, and the
    detector."""
    rng = np.random.default_rng(4)
    detector = P99Drift()
    names = [f"runq_delay{{pid={1000 + i}}}" for i in range(64)]
    gone = [n for i, n in enumerate(names) if i % 8 not in kept_of_8]   # 1009, 1017 stay
    anomalies = []
    for window in range(60):
        live = names if window <= 42 else [n for n in names if n not in gone]
        ids = np.array([detector.series_id(n) for n in live])
        n = len(live) * 1000
        series = np.repeat(ids, 1000)
        pids = np.repeat([names.index(name) for name in live], 1000)
        ts = (T0_WINDOW + window) * WINDOW_NS + rng.integers(0, WINDOW_NS, n)
        threads = rng.integers(0, 10, n) + 100 * pids
        values = lognormal_ms(rng, n) * np.where((pids == 9) & (window >= 44), 3.0, 1.0)
        if window >= 40:
            values[threads == 1707] *= 5.0
        anomalies += detector.observe(series, ts, values, threads)
        if window == 42 and drop:
            assert detector.drop(gone) == len(gone)
        anomalies += detector.advance((T0_WINDOW + window + 1) * WINDOW_NS)
    return [a for a in anomalies if a["series"] not in gone], detector, names, gone


@pytest.mark.parametrize("kept_of_8", [(0, 1), (0, 1, 2)], ids=["arrays-shrink", "in-place"])
def test_a_drop_in_the_middle_of_an_incident_changes_no_other_verdict(kept_of_8):
    """Pid 1009 steps up 3x just after the drop, so its baseline, streak
    and windows from before the drop all decide: every anomaly of a kept
    series, evidence and all, is the same whether the others were dropped
    or not."""
    kept, detector, names, gone = incident_with_a_drop(True, kept_of_8)
    control, undropped, _, _ = incident_with_a_drop(False, kept_of_8)
    assert detector._capacity == (32 if kept_of_8 == (0, 1) else 64)
    assert kept == control
    fired = [(a["series"], a["state"]) for a in kept]
    assert (names[17], "firing") in fired and (names[9], "firing") in fired, fired
    slow = next(a for a in kept if a["series"] == names[17])
    assert slow["evidence"]["top_contributors"][0][0] == 1707
    assert detector.names == [n for n in names if n not in gone]
    assert [detector.snapshot(n) for n in detector.names] == \
        [undropped.snapshot(n) for n in detector.names]
    newcomer = "runq_delay{pid=4242}"                  # takes a row a dropped series left
    assert detector.snapshot(detector.series_id(newcomer)) == {
        "series": newcomer, "state": "normal", "baseline": None, "threshold": None,
        "last_p99": None,
        "last_count": 0, "accepted": 0, "rejected": 0, "late": 0}


# ------------------------------------------------------------------ batching


def stream(seed=8, windows=130, per_window=3000):
    rng = np.random.default_rng(seed)
    series_names = np.array(["a", "b", "c"])
    w, ts = window_events(rng, T0_WINDOW, [per_window] * windows)
    which = rng.integers(0, 3, w.size)
    values = lognormal_ms(rng, w.size) * np.where((which == 1) & (w >= T0_WINDOW + 100), 3.0, 1.0)
    return series_names[which], ts, values


def without_contributors(anomalies):
    # Contributor tallies use the baseline known when a batch arrives, which
    # depends on batching; everything else must not.
    return [{**a, "evidence": {k: v for k, v in a["evidence"].items() if k != "top_contributors"}} for a in anomalies]


def test_batching_and_event_order_do_not_change_the_outcome():
    names, ts, values = stream()
    end = (ts.max() // WINDOW_NS + 1) * WINDOW_NS

    whole = P99Drift(min_samples=20)
    one_batch = whole.observe(names, ts, values) + whole.advance(end)

    order = np.argsort(ts)
    pieces = P99Drift(min_samples=20)
    in_pieces = []
    for part in np.array_split(order, 300):
        in_pieces += pieces.observe(names[part], ts[part], values[part])
        in_pieces += pieces.advance(int(ts[part].min()))  # what a daemon's clock would allow
    in_pieces += pieces.advance(end)

    assert [a["state"] for a in one_batch] == ["firing"] and one_batch[0]["series"] == "b"
    assert without_contributors(in_pieces) == without_contributors(one_batch)


def test_string_names_and_registered_ids_are_the_same_series():
    names, ts, values = stream(windows=120)
    by_name = P99Drift()
    by_id = P99Drift()
    ids = np.array([by_id.series_id(n) for n in ["a", "b", "c"]])[np.searchsorted(["a", "b", "c"], names)]
    end = (ts.max() // WINDOW_NS + 1) * WINDOW_NS
    assert by_name.observe(names, ts, values) + by_name.advance(end) == by_id.observe(ids, ts, values) + by_id.advance(end)
    assert by_name.names == by_id.names == ["a", "b", "c"]


# ------------------------------------------------------------------ bad input


def test_bad_values_are_counted_per_series_and_skipped():
    names, ts, values = stream(windows=120)
    clean = P99Drift()
    end = (ts.max() // WINDOW_NS + 1) * WINDOW_NS
    expected = clean.observe(names, ts, values) + clean.advance(end)

    rng = np.random.default_rng(1)
    junk = np.array([np.nan, -1.0, np.inf, -np.inf, 7200.0] * 200)
    junk_names = rng.choice(["a", "c"], junk.size)
    junk_ts = rng.integers(ts.min(), ts.max(), junk.size)
    dirty = P99Drift()
    got = dirty.observe(
        np.concatenate([names, junk_names]), np.concatenate([ts, junk_ts]), np.concatenate([values, junk])
    ) + dirty.advance(end)

    assert without_contributors(got) == without_contributors(expected)
    counted = {n: int(np.sum(junk_names == n)) for n in ["a", "c"]}
    assert dirty.rejected == {"a": counted["a"], "b": 0, "c": counted["c"]}
    assert dirty.snapshot("a")["accepted"] == clean.snapshot("a")["accepted"]


def test_late_unknown_and_untimed_events_are_counted_not_fatal():
    detector = small_detector()
    constant_windows(detector, [0.01] * 3, [50] * 3)
    late_ts = np.array([T0_WINDOW * WINDOW_NS + 5])
    assert detector.observe(np.array([0]), late_ts, np.array([0.01])) == []
    assert detector.late == {"s": 1}
    assert detector.observe(np.array([7]), late_ts, np.array([0.01])) == []
    assert detector.unknown_series == 1
    assert detector.observe(np.array([0]), np.array([np.nan]), np.array([0.01])) == []
    assert detector.observe(np.array([0]), np.array([-3]), np.array([0.01])) == []
    assert detector.rejected == {"s": 2}
    assert detector.observe(np.array([], dtype=int), np.array([], dtype=int), np.array([])) == []


def test_mismatched_arrays_are_refused_naming_the_lengths():
    detector = small_detector()
    with pytest.raises(ValueError, match="ids=2, ts_ns=1, values=2"):
        detector.observe(np.array([0, 0]), np.array([1]), np.array([0.1, 0.2]))
    with pytest.raises(TypeError, match="dtype float64"):
        detector.observe(np.array([0.5]), np.array([1]), np.array([0.1]))


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"factor": 1.0}, "factor must be a number > 1, got 1.0"),
        ({"clear_factor": 1.5}, r"clear_factor must be a number in \[1, factor=1.2\], got 1.5"),
        ({"consecutive": 0}, "consecutive must be an int >= 1, got 0"),
        ({"window_s": -1}, "window_s must be a positive number of seconds, got -1"),
        ({"min_baseline_windows": 90}, "min_baseline_windows must be at most baseline_windows=60, got 90"),
    ],
)
def test_bad_settings_name_what_was_expected(setting, message):
    with pytest.raises(ValueError, match=message):
        P99Drift(**setting)


# ------------------------------------------------------------------ state machine

LEVELS = [0.010, 0.0105, 0.011, 0.013, 0.02, 0.05]
COUNTS = [0, 3, 10, 40]
# A series' windows as stretches of one (level, samples) each, so that
# sustained shifts, returns and gaps all come up often.
regimes = st.lists(
    st.tuples(st.sampled_from(LEVELS), st.sampled_from(COUNTS), st.integers(1, 6)), min_size=1, max_size=12
).map(lambda stretches: [(level, count) for level, count, n in stretches for _ in range(n)][:40])


@settings(max_examples=150, deadline=None)
@given(
    consecutive=st.integers(1, 4),
    clear_windows=st.integers(1, 3),
    noise_sigmas=st.sampled_from([0.0, 3.0]),
    runs=st.lists(regimes, min_size=3, max_size=3),
)
@example(  # always covers firing and resolved, whatever the generator draws
    consecutive=2, clear_windows=2, noise_sigmas=3.0,
    runs=[[(0.010, 40)] * 4 + [(0.05, 40)] * 3 + [(0.010, 40)] * 3, [(0.010, 40)] * 5, [(0.02, 10)] * 5],
)
def test_state_machine_properties(consecutive, clear_windows, noise_sigmas, runs):
    detector = P99Drift(
        baseline_windows=6, min_baseline_windows=3, min_samples=10, floor=1e-4,
        consecutive=consecutive, clear_windows=clear_windows, noise_sigmas=noise_sigmas,
    )
    names = ["x", "y", "z"]
    seen = set()
    for name in names:
        detector.series_id(name)
    n_windows = max(len(r) for r in runs)
    history = {name: ["normal"] for name in names}
    fed = {name: [] for name in names}  # (level, count) per window
    for window in range(n_windows):
        ids, values = [], []
        for sid, run in enumerate(runs):
            level, count = run[window] if window < len(run) else (0.0, 0)
            fed[names[sid]].append((level, count))
            ids += [sid] * count
            values += [level] * count
        ts = (T0_WINDOW + window) * WINDOW_NS + np.arange(len(ids), dtype=np.int64)
        before = {name: detector.baseline(name) for name in names}
        out = detector.observe(np.array(ids, dtype=np.int64), ts, np.array(values))
        out += detector.advance((T0_WINDOW + window + 1) * WINDOW_NS)
        for name in names:
            prev, now = history[name][-1], detector.state(name)
            history[name].append(now)
            assert (prev, now) in ALLOWED_TRANSITIONS
            if consecutive > 1:
                assert now != "firing" or prev in ("pending", "firing")
            if prev in ("pending", "firing") and now in ("pending", "firing"):
                assert detector.baseline(name) == before[name], "baseline moved while an alarm was open"
        for anomaly in out:
            name = anomaly["series"]
            assert history[name][-1] == anomaly["state"]
            eligible = [(lvl, c) for lvl, c in fed[name] if c >= detector.min_samples]
            evidence = anomaly["evidence"]
            baseline = evidence["baseline"]
            if anomaly["state"] == "firing":
                # the last `consecutive` windows with enough samples were all above both bars
                assert len(evidence["windows"]) == consecutive
                assert len(eligible) >= detector.min_baseline_windows + consecutive
                for level, count in eligible[-consecutive:]:
                    assert level * 1.01 > baseline * detector.factor
                    assert level - baseline > detector.floor * 0.99
                assert [w["count"] for w in evidence["windows"]] == [c for _, c in eligible[-consecutive:]]
            else:
                # the last `clear_windows` windows with enough samples were all clear
                assert len(evidence["windows"]) == clear_windows
                clear_ratio = 1 + (evidence["fire_ratio"] - 1) * (detector.clear_factor - 1) / (detector.factor - 1)
                for level, count in eligible[-clear_windows:]:
                    assert level <= baseline * clear_ratio * 1.01 or level - baseline <= detector.floor * 1.01
            seen.add(anomaly["state"])
    for name in names:
        states = [s for s in history[name] if s in ("firing", "resolved")]
        # resolved never comes without a firing before it
        changes = [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]
        assert changes[:1] in ([], ["firing"])
        assert all(a != b for a, b in zip(changes, changes[1:]))
    event("alarm states reached: " + ",".join(sorted(seen)) if seen else "no alarm")


@pytest.mark.parametrize("consecutive", [1, 2, 3, 5])
def test_a_clear_step_fires_exactly_at_the_consecutive_th_window(consecutive):
    detector = small_detector(consecutive=consecutive)
    constant_windows(detector, [0.01] * 10, [50] * 10)
    anomalies = constant_windows(detector, [0.03] * 8, [50] * 8, start=10)
    assert [decided_window(a) for a in anomalies] == [10 + consecutive - 1]
    states = []
    for offset in range(consecutive):
        fresh = small_detector(consecutive=consecutive)
        constant_windows(fresh, [0.01] * 10 + [0.03] * (offset + 1), [50] * (11 + offset))
        states.append(fresh.state(0))
    assert states == ["pending"] * (consecutive - 1) + ["firing"]
