"""P99-drift throughput: the vectorised detector against two naive ones.

    python bench/bench_p99_drift.py [--events 1000000] [--series 64] [--repeat 5]

Feeds ``--events`` latency events (lognormal around 1 ms, sigma 1) of
``--series`` series spread over 10 one-second windows, with thread ids as
contributors, into a P99Drift whose baselines are already warm (so the
tail / contributor path runs too), closing every window. Times:

* the detector, whole input as one batch and in ring-buffer-sized batches;
* naive numpy: per window and per series, a boolean mask and
  ``np.percentile(..., method="lower")`` on the raw values;
* naive Python: a per-event loop appending to per-(series, window) lists,
  sorted at window close, on a 100 000-event subset.

Prints events/s and the ratios, checks the detector's window p99s against
the exact ones (relative error <= alpha), and writes
bench/out/p99_drift.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from mmtrace.detectors.p99_drift import P99Drift

WINDOW_NS = 1_000_000_000
FIRST_WINDOW = 10_000
WARM_WINDOWS = 25
TIMED_WINDOWS = 10
THREADS_PER_SERIES = 8
PYTHON_SUBSET = 100_000


def make_events(rng, n_events: int, n_series: int, first_window: int, n_windows: int):
    """Events in time order, as a ring buffer would deliver them."""
    ts = np.sort(rng.integers(first_window * WINDOW_NS, (first_window + n_windows) * WINDOW_NS, n_events))
    series = rng.integers(0, n_series, n_events)
    threads = series * 100 + rng.integers(0, THREADS_PER_SERIES, n_events)
    values = rng.lognormal(np.log(1e-3), 1.0, n_events)
    return series, ts, values, threads


def warm_detector(n_series: int, seed: int) -> P99Drift:
    detector = P99Drift()
    for i in range(n_series):
        detector.series_id(f"runq_delay{{pid={1000 + i}}}")
    rng = np.random.default_rng(seed)
    series, ts, values, threads = make_events(rng, 400 * n_series * WARM_WINDOWS, n_series, FIRST_WINDOW, WARM_WINDOWS)
    detector.observe(series, ts, values, threads)
    detector.advance((FIRST_WINDOW + WARM_WINDOWS) * WINDOW_NS)
    return detector


def time_detector(events, n_series: int, batch: int, repeat: int) -> dict:
    series, ts, values, threads = events
    end_ns = (FIRST_WINDOW + WARM_WINDOWS + TIMED_WINDOWS) * WINDOW_NS
    seconds = []
    for attempt in range(repeat):
        detector = warm_detector(n_series, seed=attempt)
        start = time.perf_counter()
        for lo in range(0, series.size, batch):
            hi = lo + batch
            detector.observe(series[lo:hi], ts[lo:hi], values[lo:hi], threads[lo:hi])
            detector.advance(int(ts[lo]))  # a daemon advances with its clock after each batch
        detector.advance(end_ns)
        seconds.append(time.perf_counter() - start)
    return summarise(series.size, seconds) | {"batch": batch, "detector": detector}


def naive_numpy(events, n_series: int, repeat: int) -> dict:
    series, ts, values, _ = events
    seconds = []
    for _ in range(repeat):
        start = time.perf_counter()
        windows = ts // WINDOW_NS
        p99 = {}
        for window in np.unique(windows).tolist():
            in_window = windows == window
            for sid in range(n_series):
                chosen = values[in_window & (series == sid)]
                if chosen.size:
                    p99[(sid, window)] = float(np.percentile(chosen, 99, method="lower"))
        seconds.append(time.perf_counter() - start)
    return summarise(series.size, seconds) | {"p99": p99}


def naive_python(events, n_events: int) -> dict:
    series, ts, values, _ = events
    series, ts, values = series[:n_events].tolist(), ts[:n_events].tolist(), values[:n_events].tolist()
    start = time.perf_counter()
    lists: dict[tuple[int, int], list[float]] = {}
    for sid, t, value in zip(series, ts, values):
        if value != value or value < 0 or value > 3600.0:
            continue
        lists.setdefault((sid, t // WINDOW_NS), []).append(value)
    p99 = {}
    for key, bucket in lists.items():
        bucket.sort()
        p99[key] = bucket[int(0.99 * (len(bucket) - 1))]
    return summarise(n_events, [time.perf_counter() - start])


def summarise(n_events: int, seconds: list[float]) -> dict:
    best, median = min(seconds), statistics.median(seconds)
    return {
        "events": n_events,
        "seconds_best": best,
        "seconds_median": median,
        "events_per_s_best": n_events / best,
        "events_per_s_median": n_events / median,
    }


def worst_p99_error(detector: P99Drift, exact: dict, last_window: int) -> float:
    """Largest relative error of the detector's last-window p99s vs exact."""
    worst = 0.0
    for sid in range(len(detector.names)):
        truth = exact.get((sid, last_window))
        got = detector.snapshot(sid)["last_p99"]
        if truth and got is not None:
            worst = max(worst, abs(got - truth) / truth)
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--series", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "p99_drift.json")
    args = parser.parse_args(argv)

    events = make_events(
        np.random.default_rng(42), args.events, args.series, FIRST_WINDOW + WARM_WINDOWS, TIMED_WINDOWS
    )
    runs = [time_detector(events, args.series, batch, args.repeat) for batch in (args.events, 65_536, 8_192)]
    numpy_run = naive_numpy(events, args.series, max(1, args.repeat // 2))
    python_run = naive_python(events, min(PYTHON_SUBSET, args.events))
    alpha = runs[0]["detector"].mapping.alpha
    error = worst_p99_error(runs[0].pop("detector"), numpy_run.pop("p99"), FIRST_WINDOW + WARM_WINDOWS + TIMED_WINDOWS - 1)
    for run in runs[1:]:
        run.pop("detector")

    best = max(run["events_per_s_median"] for run in runs)
    result = {
        "benchmark": "p99_drift",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "series": args.series,
        "windows": TIMED_WINDOWS,
        "detector": runs,
        "naive_numpy_percentile": numpy_run,
        "naive_python_loop": python_run,
        "speedup_vs_numpy_percentile": best / numpy_run["events_per_s_median"],
        "speedup_vs_python_loop": best / python_run["events_per_s_median"],
        "goal_events_per_s": 10_000_000,
        "worst_window_p99_relative_error": error,
        "alpha": alpha,
        "host": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                 "machine": platform.machine()},
    }
    for run in runs:
        print(f"P99Drift, batch {run['batch']:>9,}: {run['events_per_s_median'] / 1e6:7.1f} M events/s median,"
              f" {run['events_per_s_best'] / 1e6:7.1f} best")
    print(f"naive numpy percentile:   {numpy_run['events_per_s_median'] / 1e6:7.2f} M events/s"
          f"  (detector is {result['speedup_vs_numpy_percentile']:.0f}x faster)")
    print(f"naive Python loop (100k): {python_run['events_per_s_median'] / 1e6:7.2f} M events/s"
          f"  (detector is {result['speedup_vs_python_loop']:.0f}x faster)")
    print(f"window p99 worst relative error vs exact: {error:.4f} (alpha {alpha})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if best >= result["goal_events_per_s"] and error <= alpha + 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
