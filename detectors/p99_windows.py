"""The open time windows of P99Drift: one log-bucketed sketch per (window,
series), and the contributors of the events above the baseline.

Windows are indexed by ``ts_ns // window_ns``. At most ``max_open_windows``
are open at once; they share a ring of count arrays, slot ``window %
max_open_windows``. A window's p99 is read from its sketch when it closes
(relative error ``alpha``, see quantile_sketch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mmtrace.detectors.p99_series_rows import RowArray, SeriesRows
from mmtrace.detectors.quantile_sketch import LogMapping, quantile_columns

# (series ids, contributor ids, event counts) of one batch's tail events in one window
Tail = tuple[np.ndarray, np.ndarray, np.ndarray]


class OpenWindows(SeriesRows):
    """The sketches of the open windows and the tails noted in them."""

    def __init__(self, mapping: LogMapping, min_value: float, max_value: float,
                 max_open_windows: int, quantile: float) -> None:
        self.mapping = mapping
        self.min_value = min_value
        self.max_open_windows = max_open_windows
        self.quantile = quantile
        # Fixed bucket layout shared by every window: column 0 holds zeros,
        # columns 1.. the log buckets from min_value to max_value.
        self._low_index = int(mapping.index(np.array([min_value]))[0])
        high_index = int(mapping.index(np.array([max_value]))[0])
        self.columns = high_index - self._low_index + 2
        self._column_value = np.concatenate(([0.0], mapping.value(np.arange(self._low_index, high_index + 1))))
        self.next_close: int | None = None  # index of the oldest open window
        self._open: set[int] = set()  # open windows holding at least one event
        self._tails: dict[int, list[Tail]] = {}

    def row_arrays(self) -> Iterator[RowArray]:
        # int32: a bucket of one series would need 2**31 events in one window to wrap.
        yield RowArray("ring", (self.columns,), np.int32, 0, lead=(self.max_open_windows,))

    def columns_of(self, vals: np.ndarray) -> np.ndarray:
        """Sketch column of each value: 0 for zero, else its log bucket."""
        columns = self.mapping.index(np.maximum(vals, self.min_value))
        columns -= self._low_index - 1
        np.clip(columns, 1, self.columns - 1, out=columns)
        zero = vals == 0.0
        if zero.any():
            columns[zero] = 0
        return columns

    def accumulate(self, ids, windows, columns, vals, contrib, n_series: int, base: np.ndarray) -> None:
        """Add events whose windows are all open (within max_open_windows);
        with contributors, note those of the events above ``base``."""
        first = int(windows.min())
        span = int(windows.max()) - first + 1
        flat = ids * self.columns + columns
        if span > 1:
            flat += (windows - first) * (n_series * self.columns)
        hist = np.bincount(flat, minlength=span * n_series * self.columns)
        hist = hist.reshape(span, n_series, self.columns)
        for offset in range(span):
            if hist[offset].any():
                window = first + offset
                self.ring[window % self.max_open_windows, :n_series] += hist[offset]
                self._open.add(window)
        if contrib is not None:
            self._note_tail(ids, windows, vals, contrib, n_series, base)

    def _note_tail(self, ids, windows, vals, contrib, n_series: int, base: np.ndarray) -> None:
        """Count (series, contributor) of the events above the baseline."""
        tail = vals > base[ids]  # NaN baseline (not ready) -> False
        if not tail.any():
            return
        ids, windows, contrib = ids[tail], windows[tail], contrib[tail]
        # Contributor ids may be 64-bit pointers or strings: densify them
        # first so (window, series, contributor) packs into one int64 key.
        who, dense = np.unique(contrib, return_inverse=True)
        first = int(windows.min())
        key = ((windows - first) * n_series + ids) * who.size + dense
        pairs, counts = np.unique(key, return_counts=True)
        pair_contrib = who[pairs % who.size]
        pair_series = (pairs // who.size) % n_series
        pair_window = pairs // (who.size * n_series) + first
        for window in np.unique(pair_window).tolist():
            mine = pair_window == window
            self._tails.setdefault(window, []).append((pair_series[mine], pair_contrib[mine], counts[mine]))

    def feed_far(self, ids, windows, columns, vals, contrib, n_series: int, base: np.ndarray) -> Iterator[int]:
        """A batch reaching past the open windows, fed window by window:
        each time the rest of it lies beyond the open windows, yields the
        window before which the caller must close every window first."""
        if np.any(windows[1:] < windows[:-1]):
            order = np.argsort(windows, kind="stable")
            ids, windows, columns, vals = ids[order], windows[order], columns[order], vals[order]
            contrib = None if contrib is None else contrib[order]
        start = 0
        while start < ids.size:
            limit = self.next_close + self.max_open_windows
            stop = int(np.searchsorted(windows, limit, side="left"))
            if stop > start:
                part = slice(start, stop)
                self.accumulate(ids[part], windows[part], columns[part], vals[part],
                                None if contrib is None else contrib[part], n_series, base)
                start = stop
            if start < ids.size:
                yield int(windows[start]) - self.max_open_windows + 1

    def closing(self, target: int) -> Iterator[int | None]:
        """The windows to close before ``target``, oldest first, for the
        caller to ``close``; None stands for a run of windows without events
        (neutral, but resolved lasts one window)."""
        while self.next_close < target:
            due = [w for w in self._open if w < target]
            window = min(due) if due else None
            if window is None or window > self.next_close:
                yield None
            if window is None:
                self.next_close = target
                return
            yield window
            self.next_close = window + 1

    def close(self, window: int, n_series: int) -> tuple[np.ndarray, np.ndarray, list[Tail]]:
        """Close ``window``: (p99 per series, NaN where empty; event count
        per series; its tails). Its ring slot is free again."""
        slot = window % self.max_open_windows
        counts = self.ring[slot, :n_series]
        column, totals = quantile_columns(counts, self.quantile)
        p99 = self._column_value[np.maximum(column, 0)]
        p99[totals == 0] = np.nan
        counts[:] = 0
        self._open.discard(window)
        return p99, totals, self._tails.pop(window, [])

    def renumber_tails(self, new_id: np.ndarray) -> None:
        """Series ids in the tails become ``new_id[old]``; -1 drops them."""
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
