"""P99 drift over many latency series, one numpy pass per batch.

Each series (``"runq_delay{pid=123}"``, ``"sync_wait{pid=1,stream=0x0}"``,
...) is cut into fixed time windows (default 1 s, aligned on multiples of
the window length). Every closed window yields the series' p99 from a
log-bucketed sketch (relative error ``alpha``, see quantile_sketch), and
that p99 is judged against the series' baseline.

The rule
--------
* Baseline: the median of the p99s of the trailing ``baseline_windows``
  windows that were judged normal (computed in log space). A median of
  per-window p99s compares like with like: each window's p99 comes from
  the same number of seconds of data as the baseline's members, so the
  small-sample bias of a p99 estimate cancels, and one freak window (a
  GC pause, a checkpoint) moves the baseline by one rank instead of
  carrying the whole top percent of a merged sketch. The baseline is used
  once it holds ``min_baseline_windows`` windows.
* Noise allowance: the spread of those trailing p99s, sigma = 1.4826 x
  their median absolute deviation (log space), is a measured standard
  deviation of the estimate. The fire ratio is
  ``max(factor, exp(noise_sigmas * sigma))``. A p99 from a few hundred
  samples of a heavy-tailed latency moves by 20-40 % from one window to the
  next on noise alone, so ``factor`` by itself would page several times a
  day per series; the allowance widens the ratio on such series and leaves
  it at ``factor`` on series with enough samples (sigma < log(factor) /
  noise_sigmas, e.g. ~6000 samples per window of a lognormal with sigma 1).
  With the default 4 sigmas, stationary lognormal (sigma 1) and Pareto
  (shape 2) series with 100-2000 samples per window raised no alarm in
  500 000 windows, while a 2x shift is still caught in ``consecutive``
  windows at >= 1000 samples per window. ``noise_sigmas=0`` turns the
  allowance off.
* A window is *bad* when it has at least ``min_samples`` samples,
  ``p99 > baseline * fire_ratio`` and ``p99 - baseline > floor``.
* normal -> pending at the first bad window; pending -> firing at the
  ``consecutive``-th bad window in a row; pending -> normal at a window
  with enough samples that is not bad (the held windows then join the
  baseline: they turned out to be noise).
* While pending or firing the baseline is frozen: no window enters it,
  so a sustained shift never becomes the new normal by itself.
* firing -> resolved after ``clear_windows`` windows in a row that are
  *clear*: ``p99 <= baseline * clear_ratio`` or ``p99 - baseline <=
  floor``, where ``clear_ratio = 1 + (fire_ratio - 1) * (clear_factor - 1)
  / (factor - 1)`` keeps the hysteresis proportional when the noise
  allowance widened the fire ratio. A window with enough samples that is
  not clear restarts that count.
* resolved lasts one window, then the series is normal again (or pending,
  if that window is bad).
* Windows with fewer than ``min_samples`` samples (empty ones included)
  are neutral: they neither count towards ``consecutive`` or
  ``clear_windows`` nor break a run, and never enter the baseline.

Values are in any unit as long as ``floor``, ``min_value`` and
``max_value`` share it; the defaults assume seconds. NaN, infinite,
negative and absurd (``> max_value``, default one hour) values, and events
with a negative timestamp, are counted per series in ``rejected`` and
skipped. Events for windows that were already closed are counted in
``late``. Values in ``(0, min_value)`` share the lowest bucket.

Windows close when ``advance(now_ns)`` passes their end, or when a batch
brings events more than ``max_open_windows`` windows ahead of the oldest
open one (so a recording can be fed in large batches with bounded memory).

Anomalies are plain JSON-serialisable dicts, returned by ``observe`` and
``advance`` and handed to ``sink`` when one is given::

    {"detector": "p99_drift", "series": "runq_delay{pid=123}",
     "state": "firing" | "resolved", "ts_ns": <end of the deciding window>,
     "evidence": {"windows": [{"start_ns", "end_ns", "p99", "count"}, ...],
                  "p99", "baseline", "factor", "fire_ratio", "threshold",
                  "floor", "samples", "top_contributors": [[id, n], ...],
                  "rejected", ("fired_ts_ns" when resolved)}}

``top_contributors`` ranks the contributor ids (threads, ops) of the
events above the frozen baseline during the incident, most first.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np

from mmtrace.detectors.p99_alarms import STATE_NAMES, AlarmRule, AlarmStates
from mmtrace.detectors.p99_baseline import Baselines
from mmtrace.detectors.p99_intake import Intake, as_timestamps, dense_ids, require_same_length
from mmtrace.detectors.p99_series_rows import packing, shrunk_capacity
from mmtrace.detectors.p99_windows import OpenWindows
from mmtrace.detectors.quantile_sketch import DEFAULT_ALPHA, LogMapping, check_quantile

log = logging.getLogger(__name__)

Sink = Callable[[dict], None]


class P99Drift:
    """Detects a sustained rise of the windowed p99 of many latency series.

    The rule and its settings are described in the module docstring; the
    keyword-only settings rarely need changing. Memory: per series, the
    open windows' sketches (``max_open_windows`` x ~1450 int32 buckets at
    the default alpha and value range, about 23 KiB) plus the trailing
    baseline. Not thread-safe: one thread feeds and advances it.
    """

    @classmethod
    def of(cls, p) -> "P99Drift":
        """From the daemon's [p99] settings (agent/config/settings.P99Settings)."""
        return cls(window_s=p.window_s, baseline_windows=p.baseline_windows,
                   min_baseline_windows=p.min_baseline_windows, factor=p.factor,
                   floor=p.floor_s, consecutive=p.consecutive, min_samples=p.min_samples,
                   clear_factor=p.clear_factor, clear_windows=p.clear_windows,
                   noise_sigmas=p.noise_sigmas)

    def __init__(
        self,
        window_s: float = 1.0,
        baseline_windows: int = 60,
        factor: float = 1.2,
        floor: float = 100e-6,
        consecutive: int = 3,
        min_samples: int = 20,
        clear_factor: float = 1.1,
        clear_windows: int = 3,
        alpha: float = DEFAULT_ALPHA,
        *,
        quantile: float = 0.99,
        noise_sigmas: float = 4.0,
        min_baseline_windows: int = 20,
        min_value: float = 1e-9,
        max_value: float = 3600.0,
        max_open_windows: int = 4,
        sink: Sink | None = None,
    ) -> None:
        _check_settings(window_s, baseline_windows, min_baseline_windows, factor, clear_factor, floor,
                        consecutive, clear_windows, min_samples, noise_sigmas, min_value, max_value,
                        max_open_windows)
        self.window_ns = int(round(window_s * 1e9))
        _require(self.window_ns > 0, "window_s", "at least 1 ns", window_s)
        self.baseline_windows = baseline_windows
        self.min_baseline_windows = min_baseline_windows
        self.factor = float(factor)
        self.clear_factor = float(clear_factor)
        self.floor = float(floor)
        self.consecutive = consecutive
        self.clear_windows = clear_windows
        self.min_samples = min_samples
        self.quantile = check_quantile(quantile)
        self.noise_sigmas = float(noise_sigmas)
        self.min_value = float(min_value)
        self.max_value = float(max_value)
        self.max_open_windows = max_open_windows
        self.sink = sink
        self.sink_errors = 0
        self.mapping = LogMapping(alpha)

        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        self._capacity = 0
        self._windows = OpenWindows(self.mapping, self.min_value, self.max_value, max_open_windows, self.quantile)
        self._baselines = Baselines(baseline_windows, min_baseline_windows)
        self._alarms = AlarmStates(
            AlarmRule(self.window_ns, self.factor, self.clear_factor, self.floor, consecutive, clear_windows,
                      min_samples, self.noise_sigmas, self.min_value),
            self._baselines,
        )
        self._intake = Intake(self.max_value)
        self._grow(8)

    # ----------------------------------------------------------------- series

    def series_id(self, name: str) -> int:
        """The dense id of series ``name``, registering it on first use."""
        found = self._ids.get(name)
        if found is not None:
            return found
        if not isinstance(name, str) or not name:
            raise TypeError(f"series name must be a non-empty str, got {name!r}")
        sid = len(self._names)
        if sid == self._capacity:
            self._grow(2 * self._capacity)
        self._names.append(name)
        self._ids[name] = sid
        self._alarms.add_series()
        return sid

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def state(self, series: str | int) -> str:
        return STATE_NAMES[self._alarms.state[self._resolve(series)]]

    def baseline(self, series: str | int) -> float | None:
        value = self._baselines.base[self._resolve(series)]
        return None if math.isnan(value) else float(value)

    def threshold(self, series: str | int) -> float | None:
        """The p99 a window must pass to count as bad now: the baseline times
        max(factor, exp(noise_sigmas x its spread)), and at least the floor
        above it; None before the baseline is ready."""
        sid = self._resolve(series)
        base = self.baseline(sid)
        if base is None:
            return None
        rule = self._alarms.rule
        sigma = float(self._baselines.sigma[sid])
        ratio = max(rule.factor, math.exp(rule.noise_sigmas * sigma)) if math.isfinite(sigma) \
            else rule.factor
        return max(base * ratio, base + rule.floor)

    def snapshot(self, series: str | int) -> dict:
        """What exporters need about one series, as plain Python values."""
        sid = self._resolve(series)
        return {
            "series": self._names[sid],
            "state": STATE_NAMES[self._alarms.state[sid]],
            "baseline": self.baseline(sid),
            "threshold": self.threshold(sid),
            **self._intake.snapshot(sid),
        }

    @property
    def unknown_series(self) -> int:
        """Events whose integer key was never registered."""
        return self._intake.unknown_series

    @property
    def rejected(self) -> dict[str, int]:
        """Per series: NaN / infinite / negative / absurd values skipped."""
        return self._intake.per_name("rejected", self._names)

    @property
    def late(self) -> dict[str, int]:
        """Per series: events that arrived after their window had closed."""
        return self._intake.per_name("late", self._names)

    def reset(self, series: str | int) -> None:
        """Forget a series' baseline and alarm (its process restarted, say).

        Emits nothing; the series re-learns its baseline from the next window.
        """
        sid = self._resolve(series)
        self._alarms.forget(sid)
        self._baselines.forget(sid)

    def drop(self, names) -> int:
        """Forget series for good (their process exited): their windows,
        baseline and counters are freed, and the remaining series are packed
        so the arrays shrink with them. Ids given out before are void after
        a drop; names stay. Emits nothing. Returns how many were dropped."""
        gone = {self._ids[n] for n in names if n in self._ids}
        if not gone:
            return 0
        used = len(self._names)
        keep, new_id = packing(used, gone)
        self._names = [self._names[i] for i in keep.tolist()]
        self._ids = {name: i for i, name in enumerate(self._names)}
        self._alarms.keep_series(keep)
        self._windows.renumber_tails(new_id)
        self._resize(shrunk_capacity(self._capacity, keep.size), keep, used)
        return len(gone)

    # ------------------------------------------------------------------ input

    def observe(
        self,
        series: np.ndarray,
        ts_ns: np.ndarray,
        values: np.ndarray,
        contributors: np.ndarray | None = None,
    ) -> list[dict]:
        """Take a batch of events; returns anomalies of windows it closed.

        ``series``: dense ids from ``series_id`` (ints) or series names
        (str array). ``ts_ns``: event times (CLOCK_MONOTONIC ns).
        ``values``: the latencies. ``contributors``: optional thread / op
        ids, reported for the slow events of an incident.
        """
        ids = dense_ids(series, self.series_id)
        ts = as_timestamps(ts_ns)
        vals = np.asarray(values, dtype=np.float64).ravel()
        contrib = None if contributors is None else np.asarray(contributors).ravel()
        require_same_length(ids=ids, ts_ns=ts, values=vals, contributors=contrib)
        if ids.size == 0:
            return []

        n_series = len(self._names)
        intake = self._intake
        ids, ts, vals, contrib = intake.checked(ids, ts, vals, contrib, n_series)
        if ids.size == 0:
            return []
        windows = ts // self.window_ns
        if self._windows.next_close is None:
            self._windows.next_close = int(windows.min())
        ids, vals, contrib, windows = intake.on_time(self._windows.next_close, ids, vals, contrib, windows, n_series)
        if ids.size == 0:
            return []

        columns = self._windows.columns_of(vals)
        intake.count_accepted(ids, n_series)
        base = self._baselines.base
        if int(windows.max()) < self._windows.next_close + self.max_open_windows:
            self._windows.accumulate(ids, windows, columns, vals, contrib, n_series, base)
            return []
        emitted: list[dict] = []
        for target in self._windows.feed_far(ids, windows, columns, vals, contrib, n_series, base):
            emitted += self._close_until(target)
        return emitted

    def open_from(self, now_ns: int) -> int:
        """The start of the first window advance(now_ns) leaves open: an
        event stamped before it is late once that advance has run."""
        return int(now_ns) // self.window_ns * self.window_ns

    def advance(self, now_ns: int) -> list[dict]:
        """Close every window that ended at or before ``now_ns``."""
        target = int(now_ns) // self.window_ns
        if self._windows.next_close is None:
            self._windows.next_close = target
            return []
        return self._close_until(target)

    # ------------------------------------------------------------- internals

    def _resolve(self, series: str | int) -> int:
        if isinstance(series, (int, np.integer)):
            if 0 <= series < len(self._names):
                return int(series)
            raise KeyError(f"no series with id {series}; ids run 0..{len(self._names) - 1}")
        sid = self._ids.get(series)
        if sid is None:
            raise KeyError(f"no series named {series!r}")
        return sid

    def _close_until(self, target: int) -> list[dict]:
        emitted: list[dict] = []
        for window in self._windows.closing(target):
            if window is None:
                self._alarms.pass_empty_window(len(self._names))
            else:
                emitted += self._close_window(window)
        return emitted

    def _close_window(self, window: int) -> list[dict]:
        n_series = len(self._names)
        p99, totals, tails = self._windows.close(window, n_series)
        self._intake.last_p99[:n_series] = p99
        self._intake.last_count[:n_series] = totals
        emitted = self._alarms.judge(window, p99, totals, tails, self._names, self._intake.rejected)
        for record in emitted:
            self._deliver(record)
        return emitted

    def _deliver(self, record: dict) -> None:
        if self.sink is None:
            return
        try:
            self.sink(record)
        except Exception:  # a broken sink must not stop detection; it is counted and logged
            self.sink_errors += 1
            log.exception("p99_drift sink failed on an anomaly for %s", record["series"])

    def _grow(self, capacity: int) -> None:
        """(Re)allocate per-series state for ``capacity`` series, keeping what exists."""
        self._resize(capacity, np.arange(self._capacity))

    def _resize(self, capacity: int, keep: np.ndarray, used: int = 0) -> None:
        for part in (self._windows, self._baselines, self._alarms, self._intake):
            part.resize(capacity, keep, used)
        self._capacity = capacity


def _check_settings(window_s, baseline_windows, min_baseline_windows, factor, clear_factor, floor,
                    consecutive, clear_windows, min_samples, noise_sigmas, min_value, max_value,
                    max_open_windows) -> None:
    _require(window_s > 0 and math.isfinite(window_s), "window_s", "a positive number of seconds", window_s)
    _require_int(baseline_windows, "baseline_windows", 1)
    _require_int(min_baseline_windows, "min_baseline_windows", 1)
    _require(min_baseline_windows <= baseline_windows, "min_baseline_windows",
             f"at most baseline_windows={baseline_windows}", min_baseline_windows)
    _require(factor > 1.0 and math.isfinite(factor), "factor", "a number > 1", factor)
    _require(1.0 <= clear_factor <= factor, "clear_factor", f"a number in [1, factor={factor}]", clear_factor)
    _require(floor >= 0.0 and math.isfinite(floor), "floor", "a number >= 0", floor)
    _require_int(consecutive, "consecutive", 1)
    _require_int(clear_windows, "clear_windows", 1)
    _require_int(min_samples, "min_samples", 1)
    _require(noise_sigmas >= 0.0 and math.isfinite(noise_sigmas), "noise_sigmas", "a number >= 0", noise_sigmas)
    _require(0.0 < min_value < max_value and math.isfinite(max_value), "min_value/max_value",
             "0 < min_value < max_value < inf", (min_value, max_value))
    _require_int(max_open_windows, "max_open_windows", 1)


def _require(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {got!r}")


def _require_int(value, name: str, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
