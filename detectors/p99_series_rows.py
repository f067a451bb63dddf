"""Per-series numpy state of P99Drift, one row per dense series id.

Each part of the detector (open windows, baselines, alarm states, input
counters) keeps what it knows about series ``i`` in row ``i`` of its
arrays, so a batch is judged in one numpy pass over all series. The arrays
grow by doubling as series register; when series are dropped, the rows of
the ones kept are packed to the front, in place or into smaller fresh
arrays, so that what exited processes held goes back to the allocator.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowArray:
    """One per-series array: attribute ``name`` of shape ``lead + (capacity,) + tail``."""

    name: str
    tail: tuple
    dtype: type
    fill: object
    lead: tuple = ()  # axes before the series axis (the ring's open-window slots)

    def rows(self, index) -> tuple:
        """Index selecting rows ``index`` along the series axis."""
        return (slice(None),) * len(self.lead) + (index,)


class SeriesRows:
    """Holder of per-series arrays that grow, shrink and pack together."""

    capacity = 0

    def row_arrays(self) -> Iterator[RowArray]:
        raise NotImplementedError

    def resize(self, capacity: int, keep: np.ndarray, used: int = 0) -> None:
        """Per-series state for ``capacity`` series; row ``i`` of the new
        arrays is row ``keep[i]`` of the old ones (``used`` of which were in
        use), the rest is fresh. Fresh arrays where the capacity changes
        (what is dropped goes back to the allocator), else packed in place."""
        in_place = capacity == self.capacity
        # keep is sorted: a prefix is taken as a slice, without a copy
        rows_kept = slice(0, keep.size) if keep.size == 0 or keep[-1] == keep.size - 1 else keep
        for spec in self.row_arrays():
            if in_place:
                rows = getattr(self, spec.name)
                rows[spec.rows(slice(0, keep.size))] = rows[spec.rows(rows_kept)]
                rows[spec.rows(slice(keep.size, used))] = spec.fill
            else:
                fresh = np.full(spec.lead + (capacity,) + spec.tail, spec.fill, dtype=spec.dtype)
                if keep.size:
                    fresh[spec.rows(slice(0, keep.size))] = getattr(self, spec.name)[spec.rows(rows_kept)]
                setattr(self, spec.name, fresh)
        self.capacity = capacity


def packing(used: int, gone: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """For a drop of ids ``gone`` among ``used``: the old ids kept, in
    order, and the new id of every old one (-1 where dropped)."""
    keep = np.array([i for i in range(used) if i not in gone], np.int64)
    new_id = np.full(used, -1, np.int64)
    new_id[keep] = np.arange(keep.size)
    return keep, new_id


def shrunk_capacity(capacity: int, kept: int) -> int:
    """Halve the capacity while a quarter of it or less is in use (not below 8)."""
    while capacity > 8 and kept <= capacity // 4:
        capacity //= 2
    return capacity

