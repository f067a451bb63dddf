"""The intake of P99Drift: a batch's events checked, and what each series'
input came to (events taken, skipped as absurd or late, the p99 and count
of its last closed window)."""

from __future__ import annotations

import math

from collections.abc import Callable, Iterator

import numpy as np

from mmtrace.detectors.p99_series_rows import RowArray, SeriesRows


class Intake(SeriesRows):
    """Per-series counters of the input, and the checks that feed them."""

    def __init__(self, max_value: float) -> None:
        self.max_value = max_value
        self.unknown_series = 0  # events whose integer key was never registered

    def row_arrays(self) -> Iterator[RowArray]:
        yield RowArray("last_p99", (), np.float64, np.nan)
        yield RowArray("last_count", (), np.int64, 0)
        for counter in ("accepted", "rejected", "late"):
            yield RowArray(counter, (), np.int64, 0)

    def checked(self, ids, ts, vals, contrib, n_series: int) -> tuple:
        """The events of known series with a sane value and time. NaN,
        infinite, negative and absurd values, and negative times, are
        counted in ``rejected``; unknown ids in ``unknown_series``."""
        known = (ids >= 0) & (ids < n_series)
        if not known.all():
            self.unknown_series += int(ids.size - np.count_nonzero(known))
            ids, ts, vals, contrib = _keep(known, ids, ts, vals, contrib)
        good = (vals >= 0.0) & (vals <= self.max_value) & (ts >= 0)  # NaN compares False
        if not good.all():
            self.rejected[:n_series] += np.bincount(ids[~good], minlength=n_series)
            ids, ts, vals, contrib = _keep(good, ids, ts, vals, contrib)
        return ids, ts, vals, contrib

    def on_time(self, next_close: int, ids, vals, contrib, windows, n_series: int) -> tuple:
        """The events for windows still open; the others are counted in ``late``."""
        on_time = windows >= next_close
        if not on_time.all():
            self.late[:n_series] += np.bincount(ids[~on_time], minlength=n_series)
            ids, vals, contrib, windows = _keep(on_time, ids, vals, contrib, windows)
        return ids, vals, contrib, windows

    def count_accepted(self, ids, n_series: int) -> None:
        self.accepted[:n_series] += np.bincount(ids, minlength=n_series)

    def snapshot(self, sid: int) -> dict:
        last = self.last_p99[sid]
        return {
            "last_p99": None if math.isnan(last) else float(last),
            "last_count": int(self.last_count[sid]),
            "accepted": int(self.accepted[sid]),
            "rejected": int(self.rejected[sid]),
            "late": int(self.late[sid]),
        }

    def per_name(self, counter: str, names: list[str]) -> dict[str, int]:
        rows = getattr(self, counter)
        return {name: int(rows[i]) for i, name in enumerate(names)}


def dense_ids(series, series_id: Callable[[str], int]) -> np.ndarray:
    """Integer ids as they are; str names through ``series_id``."""
    keys = np.asarray(series).ravel()
    if keys.dtype.kind in "iu":
        return keys.astype(np.int64, copy=False)
    if keys.dtype.kind in "USO":
        if keys.size == 0:
            return np.zeros(0, dtype=np.int64)
        unique, inverse = np.unique(keys, return_inverse=True)
        return np.array([series_id(name) for name in unique.tolist()], dtype=np.int64)[inverse]
    raise TypeError(f"series must be integer ids or str names, got an array of dtype {keys.dtype}")


def as_timestamps(ts_ns) -> np.ndarray:
    ts = np.asarray(ts_ns).ravel()
    if ts.dtype.kind in "iu":
        return ts.astype(np.int64, copy=False)
    if ts.dtype.kind == "f":
        # Non-finite times become -1, which the negative-time check rejects.
        return np.where(np.isfinite(ts), ts, -1).astype(np.int64)
    raise TypeError(f"ts_ns must be integer nanoseconds, got an array of dtype {ts.dtype}")


def require_same_length(**arrays) -> None:
    lengths = {name: a.size for name, a in arrays.items() if a is not None}
    if len(set(lengths.values())) > 1:
        described = ", ".join(f"{name}={n}" for name, n in lengths.items())
        raise ValueError(f"observe() needs arrays of one length, got {described}")


def _keep(mask: np.ndarray, *arrays):
    return tuple(None if a is None else a[mask] for a in arrays)
