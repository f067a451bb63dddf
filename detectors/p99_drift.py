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
from collections import Counter
from typing import Callable

import numpy as np

from mmtrace.detectors.quantile_sketch import DEFAULT_ALPHA, LogMapping, check_quantile, quantile_columns

log = logging.getLogger(__name__)

DETECTOR = "p99_drift"
STATE_NAMES = ("normal", "pending", "firing", "resolved")
NORMAL, PENDING, FIRING, RESOLVED = range(4)
# Edges the state machine may take from one closed window to the next.
# normal/resolved -> firing only happens when consecutive == 1.
ALLOWED_TRANSITIONS = frozenset(
    {
        ("normal", "normal"), ("normal", "pending"), ("normal", "firing"),
        ("pending", "pending"), ("pending", "normal"), ("pending", "firing"),
        ("firing", "firing"), ("firing", "resolved"),
        ("resolved", "normal"), ("resolved", "pending"), ("resolved", "firing"),
    }
)
MAD_TO_SIGMA = 1.4826  # median absolute deviation -> standard deviation (normal data)
TOP_CONTRIBUTORS = 5
KEPT_CONTRIBUTORS = 64  # per incident; bounds memory on threads that come and go

Sink = Callable[[dict], None]


class P99Drift:
    """Detects a sustained rise of the windowed p99 of many latency series.

    The rule and its settings are described in the module docstring; the
    keyword-only settings rarely need changing. Memory: per series, the
    open windows' sketches (``max_open_windows`` x ~1450 int32 buckets at
    the default alpha and value range, about 23 KiB) plus the trailing
    baseline. Not thread-safe: one thread feeds and advances it.
    """

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
        self.unknown_series = 0  # events whose integer key was never registered

        # Fixed bucket layout shared by every window: column 0 holds zeros,
        # columns 1.. the log buckets from min_value to max_value.
        self.mapping = LogMapping(alpha)
        self._low_index = int(self.mapping.index(np.array([self.min_value]))[0])
        high_index = int(self.mapping.index(np.array([self.max_value]))[0])
        self._columns = high_index - self._low_index + 2
        self._column_value = np.concatenate(
            ([0.0], self.mapping.value(np.arange(self._low_index, high_index + 1)))
        )
        self._clear_scale = (self.clear_factor - 1.0) / (self.factor - 1.0)

        self._names: list[str] = []
        self._ids: dict[str, int] = {}
        self._capacity = 0
        self._next_close: int | None = None  # index of the oldest open window
        self._open: set[int] = set()  # open windows holding at least one event
        self._tails: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._incident: list[Counter] = []
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
        self._incident.append(Counter())
        return sid

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def state(self, series: str | int) -> str:
        return STATE_NAMES[self._state[self._resolve(series)]]

    def baseline(self, series: str | int) -> float | None:
        value = self._base[self._resolve(series)]
        return None if math.isnan(value) else float(value)

    def snapshot(self, series: str | int) -> dict:
        """What exporters need about one series, as plain Python values."""
        sid = self._resolve(series)
        last = self._last_p99[sid]
        return {
            "series": self._names[sid],
            "state": STATE_NAMES[self._state[sid]],
            "baseline": self.baseline(sid),
            "last_p99": None if math.isnan(last) else float(last),
            "last_count": int(self._last_count[sid]),
            "accepted": int(self._accepted[sid]),
            "rejected": int(self._rejected[sid]),
            "late": int(self._late[sid]),
        }

    @property
    def rejected(self) -> dict[str, int]:
        """Per series: NaN / infinite / negative / absurd values skipped."""
        return {name: int(self._rejected[i]) for i, name in enumerate(self._names)}

    @property
    def late(self) -> dict[str, int]:
        """Per series: events that arrived after their window had closed."""
        return {name: int(self._late[i]) for i, name in enumerate(self._names)}

    def reset(self, series: str | int) -> None:
        """Forget a series' baseline and alarm (its process restarted, say).

        Emits nothing; the series re-learns its baseline from the next window.
        """
        sid = self._resolve(series)
        self._state[sid] = NORMAL
        self._hist[sid] = np.nan
        self._hist_pos[sid] = 0
        self._hist_len[sid] = 0
        self._base[sid] = np.nan
        self._sigma[sid] = np.nan
        self._streak_n[sid] = 0
        self._clear_n[sid] = 0
        self._incident[sid].clear()

    def drop(self, names) -> int:
        """Forget series for good (their process exited): their windows,
        baseline and counters are freed, and the remaining series are packed
        so the arrays shrink with them. Ids given out before are void after
        a drop; names stay. Emits nothing. Returns how many were dropped."""
        gone = {self._ids[n] for n in names if n in self._ids}
        if not gone:
            return 0
        used = len(self._names)
        keep = np.array([i for i in range(used) if i not in gone], np.int64)
        new_id = np.full(len(self._names), -1, np.int64)
        new_id[keep] = np.arange(keep.size)
        self._names = [self._names[i] for i in keep.tolist()]
        self._ids = {name: i for i, name in enumerate(self._names)}
        self._incident = [self._incident[i] for i in keep.tolist()]
        for window, parts in list(self._tails.items()):
            moved = []
            for series, contrib, counts in parts:
                ids = new_id[series]
                mine = ids >= 0
                if mine.any():
                    moved.append((ids[mine], contrib[mine], counts[mine]))
            if moved:
                self._tails[window] = moved
            else:
                del self._tails[window]
        capacity = self._capacity
        while capacity > 8 and keep.size <= capacity // 4:
            capacity //= 2
        self._resize(capacity, keep, used)
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
        ids = self._ids_of(series)
        ts = _as_timestamps(ts_ns)
        vals = np.asarray(values, dtype=np.float64).ravel()
        contrib = None if contributors is None else np.asarray(contributors).ravel()
        _require_same_length(ids=ids, ts_ns=ts, values=vals, contributors=contrib)
        if ids.size == 0:
            return []

        known = (ids >= 0) & (ids < len(self._names))
        if not known.all():
            self.unknown_series += int(ids.size - np.count_nonzero(known))
            ids, ts, vals, contrib = _keep(known, ids, ts, vals, contrib)
        good = (vals >= 0.0) & (vals <= self.max_value) & (ts >= 0)  # NaN compares False
        if not good.all():
            self._rejected[: len(self._names)] += np.bincount(ids[~good], minlength=len(self._names))
            ids, ts, vals, contrib = _keep(good, ids, ts, vals, contrib)
        if ids.size == 0:
            return []

        windows = ts // self.window_ns
        if self._next_close is None:
            self._next_close = int(windows.min())
        on_time = windows >= self._next_close
        if not on_time.all():
            self._late[: len(self._names)] += np.bincount(ids[~on_time], minlength=len(self._names))
            ids, vals, contrib, windows = _keep(on_time, ids, vals, contrib, windows)
            if ids.size == 0:
                return []

        columns = self._columns_of(vals)
        self._accepted[: len(self._names)] += np.bincount(ids, minlength=len(self._names))
        if int(windows.max()) < self._next_close + self.max_open_windows:
            self._accumulate(ids, windows, columns, vals, contrib)
            return []
        return self._accumulate_far(ids, windows, columns, vals, contrib)

    def advance(self, now_ns: int) -> list[dict]:
        """Close every window that ended at or before ``now_ns``."""
        target = int(now_ns) // self.window_ns
        if self._next_close is None:
            self._next_close = target
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

    def _ids_of(self, series: np.ndarray) -> np.ndarray:
        keys = np.asarray(series).ravel()
        if keys.dtype.kind in "iu":
            return keys.astype(np.int64, copy=False)
        if keys.dtype.kind in "USO":
            if keys.size == 0:
                return np.zeros(0, dtype=np.int64)
            unique, inverse = np.unique(keys, return_inverse=True)
            return np.array([self.series_id(name) for name in unique.tolist()], dtype=np.int64)[inverse]
        raise TypeError(f"series must be integer ids or str names, got an array of dtype {keys.dtype}")

    def _columns_of(self, vals: np.ndarray) -> np.ndarray:
        """Sketch column of each value: 0 for zero, else its log bucket."""
        columns = self.mapping.index(np.maximum(vals, self.min_value))
        columns -= self._low_index - 1
        np.clip(columns, 1, self._columns - 1, out=columns)
        zero = vals == 0.0
        if zero.any():
            columns[zero] = 0
        return columns

    def _accumulate(self, ids, windows, columns, vals, contrib) -> None:
        """Add events whose windows are all open (within max_open_windows)."""
        n_series = len(self._names)
        first = int(windows.min())
        span = int(windows.max()) - first + 1
        flat = ids * self._columns + columns
        if span > 1:
            flat += (windows - first) * (n_series * self._columns)
        hist = np.bincount(flat, minlength=span * n_series * self._columns)
        hist = hist.reshape(span, n_series, self._columns)
        for offset in range(span):
            if hist[offset].any():
                window = first + offset
                self._ring[window % self.max_open_windows, :n_series] += hist[offset]
                self._open.add(window)
        if contrib is not None:
            self._note_tail(ids, windows, vals, contrib)

    def _accumulate_far(self, ids, windows, columns, vals, contrib) -> list[dict]:
        """A batch reaching past the open windows: feed it window by window,
        closing the oldest as the batch moves on."""
        if np.any(windows[1:] < windows[:-1]):
            order = np.argsort(windows, kind="stable")
            ids, windows, columns, vals = ids[order], windows[order], columns[order], vals[order]
            contrib = None if contrib is None else contrib[order]
        emitted: list[dict] = []
        start = 0
        while start < ids.size:
            limit = self._next_close + self.max_open_windows
            stop = int(np.searchsorted(windows, limit, side="left"))
            if stop > start:
                part = slice(start, stop)
                self._accumulate(
                    ids[part], windows[part], columns[part], vals[part],
                    None if contrib is None else contrib[part],
                )
                start = stop
            if start < ids.size:
                emitted += self._close_until(int(windows[start]) - self.max_open_windows + 1)
        return emitted

    def _note_tail(self, ids, windows, vals, contrib) -> None:
        """Count (series, contributor) of the events above the baseline."""
        tail = vals > self._base[ids]  # NaN baseline (not ready) -> False
        if not tail.any():
            return
        ids, windows, contrib = ids[tail], windows[tail], contrib[tail]
        # Contributor ids may be 64-bit pointers or strings: densify them
        # first so (window, series, contributor) packs into one int64 key.
        who, dense = np.unique(contrib, return_inverse=True)
        first = int(windows.min())
        key = ((windows - first) * len(self._names) + ids) * who.size + dense
        pairs, counts = np.unique(key, return_counts=True)
        pair_contrib = who[pairs % who.size]
        pair_series = (pairs // who.size) % len(self._names)
        pair_window = pairs // (who.size * len(self._names)) + first
        for window in np.unique(pair_window).tolist():
            mine = pair_window == window
            self._tails.setdefault(window, []).append((pair_series[mine], pair_contrib[mine], counts[mine]))

    def _close_until(self, target: int) -> list[dict]:
        emitted: list[dict] = []
        while self._next_close < target:
            due = [w for w in self._open if w < target]
            if not due:
                self._close_empty()
                self._next_close = target
                break
            window = min(due)
            if window > self._next_close:
                self._close_empty()
            emitted += self._close_window(window)
            self._next_close = window + 1
        return emitted

    def _close_empty(self) -> None:
        # An empty window is neutral, except that resolved lasts one window.
        n_series = len(self._names)
        states = self._state[:n_series]
        states[states == RESOLVED] = NORMAL

    def _close_window(self, window: int) -> list[dict]:
        n_series = len(self._names)
        slot = window % self.max_open_windows
        counts = self._ring[slot, :n_series]
        column, totals = quantile_columns(counts, self.quantile)
        p99 = self._column_value[np.maximum(column, 0)]
        p99[totals == 0] = np.nan
        counts[:] = 0
        self._open.discard(window)
        tails = self._tails.pop(window, [])
        self._last_p99[:n_series] = p99
        self._last_count[:n_series] = totals
        return self._judge(window, p99, totals, tails)

    def _judge(self, window: int, p99: np.ndarray, totals: np.ndarray, tails) -> list[dict]:
        n = len(self._names)
        state = self._state[:n]
        base = self._base[:n]
        state[state == RESOLVED] = NORMAL  # resolved lasts one window
        eligible = totals >= self.min_samples
        ready = ~np.isnan(base)
        with np.errstate(invalid="ignore"):
            # fmax skips NaN: no spread measured yet means no widening.
            fire_ratio = np.fmax(self.factor, np.exp(self.noise_sigmas * self._sigma[:n]))
            clear_ratio = 1.0 + (fire_ratio - 1.0) * self._clear_scale
            excess = p99 - base
            bad = eligible & ready & (p99 > base * fire_ratio) & (excess > self.floor)
            clear = eligible & ready & ((p99 <= base * clear_ratio) | (excess <= self.floor))
        log_p99 = np.log(np.fmax(p99, self.min_value))  # only read for windows with samples
        start_ns = window * self.window_ns
        emitted: list[dict] = []

        normal = state == NORMAL
        pending = state == PENDING
        firing = state == FIRING
        to_feed = normal & eligible & ~bad
        aborted = np.flatnonzero(pending & eligible & ~bad)
        in_streak = np.flatnonzero((normal | pending) & bad)

        # Windows of an aborted pending run were noise after all: they join
        # the baseline before the current window does.
        changed = to_feed.copy()
        for sid in aborted.tolist():
            for k in range(int(self._streak_n[sid])):
                self._push_history(np.array([sid]), np.array([self._streak_log[sid, k]]))
            self._streak_n[sid] = 0
            self._incident[sid].clear()
            state[sid] = NORMAL
            changed[sid] = True
        to_feed[aborted] = True
        fed = np.flatnonzero(to_feed)
        self._push_history(fed, log_p99[fed])

        if in_streak.size:
            fresh = in_streak[state[in_streak] == NORMAL]
            self._streak_n[fresh] = 0
            for sid in fresh.tolist():
                self._incident[sid].clear()
            k = self._streak_n[in_streak]
            self._streak_p99[in_streak, k] = p99[in_streak]
            self._streak_log[in_streak, k] = log_p99[in_streak]
            self._streak_count[in_streak, k] = totals[in_streak]
            self._streak_start[in_streak, k] = start_ns
            self._streak_n[in_streak] = k + 1
            state[in_streak] = PENDING
        incident = (state == PENDING) | firing
        self._add_contributors(tails, incident)

        fired = in_streak[self._streak_n[in_streak] >= self.consecutive]
        for sid in fired.tolist():
            state[sid] = FIRING
            self._fired_ns[sid] = start_ns + self.window_ns
            emitted.append(self._anomaly(sid, "firing", start_ns, fire_ratio[sid], self._streak(sid)))

        clearing = np.flatnonzero(firing & clear)
        self._clear_n[np.flatnonzero(firing & eligible & ~clear)] = 0
        if clearing.size:
            k = self._clear_n[clearing]
            self._clear_p99[clearing, k] = p99[clearing]
            self._clear_count[clearing, k] = totals[clearing]
            self._clear_start[clearing, k] = start_ns
            self._clear_n[clearing] = k + 1
        resolved = clearing[self._clear_n[clearing] >= self.clear_windows]
        for sid in resolved.tolist():
            state[sid] = RESOLVED
            record = self._anomaly(sid, "resolved", start_ns, fire_ratio[sid], self._clears(sid))
            record["evidence"]["fired_ts_ns"] = int(self._fired_ns[sid])
            emitted.append(record)
            self._clear_n[sid] = 0
            self._streak_n[sid] = 0
            self._incident[sid].clear()

        self._refresh_baseline(np.flatnonzero(changed))
        for record in emitted:
            self._deliver(record)
        return emitted

    def _push_history(self, rows: np.ndarray, log_p99: np.ndarray) -> None:
        if rows.size == 0:
            return
        pos = self._hist_pos[rows]
        self._hist[rows, pos] = log_p99
        self._hist_pos[rows] = (pos + 1) % self.baseline_windows
        self._hist_len[rows] = np.minimum(self._hist_len[rows] + 1, self.baseline_windows)

    def _refresh_baseline(self, rows: np.ndarray) -> None:
        rows = rows[self._hist_len[rows] >= self.min_baseline_windows]
        if rows.size == 0:
            return
        hist = self._hist[rows]
        lengths = self._hist_len[rows]
        centre = _leading_median(hist, lengths)
        spread = _leading_median(np.abs(hist - centre[:, None]), lengths)
        self._base[rows] = np.exp(centre)
        self._sigma[rows] = MAD_TO_SIGMA * spread

    def _add_contributors(self, tails, incident: np.ndarray) -> None:
        for series_ids, contrib, counts in tails:
            mine = incident[series_ids]
            if not mine.any():
                continue
            for sid, who, n in zip(series_ids[mine].tolist(), contrib[mine].tolist(), counts[mine].tolist()):
                self._incident[sid][who] += n
        for sid in np.flatnonzero(incident).tolist():
            tally = self._incident[sid]
            if len(tally) > 2 * KEPT_CONTRIBUTORS:
                self._incident[sid] = Counter(dict(tally.most_common(KEPT_CONTRIBUTORS)))

    def _streak(self, sid: int) -> list[dict]:
        n = int(self._streak_n[sid])
        return self._windows(self._streak_start[sid, :n], self._streak_p99[sid, :n], self._streak_count[sid, :n])

    def _clears(self, sid: int) -> list[dict]:
        n = int(self._clear_n[sid])
        return self._windows(self._clear_start[sid, :n], self._clear_p99[sid, :n], self._clear_count[sid, :n])

    def _windows(self, starts, p99s, counts) -> list[dict]:
        return [
            {"start_ns": int(s), "end_ns": int(s) + self.window_ns, "p99": float(p), "count": int(c)}
            for s, p, c in zip(starts.tolist(), p99s.tolist(), counts.tolist())
        ]

    def _anomaly(self, sid: int, state: str, start_ns: int, fire_ratio: float, windows: list[dict]) -> dict:
        baseline = float(self._base[sid])
        return {
            "detector": DETECTOR,
            "series": self._names[sid],
            "state": state,
            "ts_ns": int(start_ns + self.window_ns),
            "evidence": {
                "windows": windows,
                "p99": windows[-1]["p99"],
                "baseline": baseline,
                "factor": self.factor,
                "fire_ratio": float(fire_ratio),
                "threshold": max(baseline * float(fire_ratio), baseline + self.floor),
                "floor": self.floor,
                "samples": sum(w["count"] for w in windows),
                "top_contributors": [
                    [_plain(who), int(n)] for who, n in self._incident[sid].most_common(TOP_CONTRIBUTORS)
                ],
                "rejected": int(self._rejected[sid]),
            },
        }

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

    def _series_arrays(self):
        """(attribute, row shape, dtype, fresh value) of each per-series array."""
        yield "_state", (), np.int8, NORMAL
        yield "_hist", (self.baseline_windows,), np.float64, np.nan
        yield "_hist_pos", (), np.int64, 0
        yield "_hist_len", (), np.int64, 0
        yield "_base", (), np.float64, np.nan
        yield "_sigma", (), np.float64, np.nan
        for prefix, length in (("_streak", self.consecutive), ("_clear", self.clear_windows)):
            yield prefix + "_n", (), np.int64, 0
            yield prefix + "_p99", (length,), np.float64, np.nan
            yield prefix + "_count", (length,), np.int64, 0
            yield prefix + "_start", (length,), np.int64, 0
        yield "_streak_log", (self.consecutive,), np.float64, np.nan
        yield "_fired_ns", (), np.int64, 0
        yield "_last_p99", (), np.float64, np.nan
        yield "_last_count", (), np.int64, 0
        for counter in ("_accepted", "_rejected", "_late"):
            yield counter, (), np.int64, 0

    def _resize(self, capacity: int, keep: np.ndarray, used: int = 0) -> None:
        """Per-series state for ``capacity`` series; row ``i`` of the new
        arrays is row ``keep[i]`` of the old ones (``used`` of which were in
        use), the rest is fresh. Fresh arrays where the capacity changes
        (what is dropped goes back to the allocator), else packed in place."""
        in_place = capacity == self._capacity
        # keep is sorted: a prefix is taken as a slice, without a copy
        rows_kept = slice(0, keep.size) if keep.size == 0 or keep[-1] == keep.size - 1 else keep
        for name, shape_tail, dtype, fill in self._series_arrays():
            if in_place:
                rows = getattr(self, name)
                rows[: keep.size] = rows[rows_kept]
                rows[keep.size:used] = fill
            else:
                fresh = np.full((capacity,) + shape_tail, fill, dtype=dtype)
                if keep.size:
                    fresh[: keep.size] = getattr(self, name)[rows_kept]
                setattr(self, name, fresh)
        # int32: a bucket of one series would need 2**31 events in one window to wrap.
        if in_place:
            self._ring[:, : keep.size] = self._ring[:, rows_kept]
            self._ring[:, keep.size:used] = 0
        else:
            ring = np.zeros((self.max_open_windows, capacity, self._columns), dtype=np.int32)
            if keep.size:
                ring[:, : keep.size] = self._ring[:, rows_kept]
            self._ring = ring
        self._capacity = capacity

def _require(ok: bool, name: str, expected: str, got) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {got!r}")


def _require_int(value, name: str, minimum: int) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _require_same_length(**arrays) -> None:
    lengths = {name: a.size for name, a in arrays.items() if a is not None}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"observe() needs arrays of one length, got {described}")


def _as_timestamps(ts_ns) -> np.ndarray:
    ts = np.asarray(ts_ns).ravel()
    if ts.dtype.kind in "iu":
        return ts.astype(np.int64, copy=False)
    if ts.dtype.kind == "f":
        # Non-finite times become -1, which the negative-time check rejects.
        return np.where(np.isfinite(ts), ts, -1).astype(np.int64)
    raise TypeError(f"ts_ns must be integer nanoseconds, got an array of dtype {ts.dtype}")


def _leading_median(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Median of each row's non-NaN entries (``lengths`` of them).

    np.nanmedian goes through masked arrays and costs ~0.3 ms a call; a
    sort puts the NaNs last, so the median sits at known positions.
    """
    ordered = np.sort(rows, axis=1)
    lower = np.take_along_axis(ordered, ((lengths - 1) // 2)[:, None], axis=1)[:, 0]
    upper = np.take_along_axis(ordered, (lengths // 2)[:, None], axis=1)[:, 0]
    return 0.5 * (lower + upper)


def _keep(mask: np.ndarray, *arrays):
    return tuple(None if a is None else a[mask] for a in arrays)


def _plain(value):
    """numpy scalar -> the Python value json can write."""
    return value.item() if isinstance(value, np.generic) else value
