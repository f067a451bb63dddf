"""A mergeable quantile sketch with a relative-error guarantee.

Log-bucketed in the manner of DDSketch (Masson, Rim, Lee, VLDB 2019): a
positive value x lands in bucket ``i = ceil(log_gamma(x))`` with
``gamma = (1 + alpha) / (1 - alpha)``, so bucket i covers
``(gamma**(i-1), gamma**i]``, and the bucket is read back as
``2 * gamma**i / (gamma + 1)``. Every value in the bucket lies within a
relative distance ``alpha`` of that representative.

Quantile definition: ``quantile(q)`` estimates the element of rank
``floor(q * (n - 1))`` (0-based) of the sorted values, which is what
``numpy.quantile(values, q, method="lower")`` returns. The guarantee:

    |quantile(q) - exact| <= alpha * exact

for every q whose exact value is zero or lies in a bucket that has not been
collapsed (see ``max_buckets``), up to floating-point rounding of the log
at bucket edges (a few ulps).

Input: zero is counted in a dedicated zero bucket; NaN, +/-inf and negative
values are rejected and counted in ``rejected``; they never enter a
quantile.

Memory: at most ``max_buckets`` log buckets. When a batch would need more,
the lowest buckets are folded into the lowest one that is kept, so the
upper quantiles (the ones latency work cares about) keep their guarantee
while the lowest lose it. With alpha = 0.01 and 2048 buckets the kept range
spans a factor of about 6e17 between smallest and largest value, so
collapsing only happens on pathological input; the span is
``gamma ** max_buckets`` and shrinks with alpha (a factor of only ~60 at
alpha = 0.001), so raise ``max_buckets`` along with the precision.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_ALPHA = 0.01
DEFAULT_MAX_BUCKETS = 2048


class LogMapping:
    """The value <-> bucket-index mapping shared by every sketch of one alpha."""

    def __init__(self, alpha: float = DEFAULT_ALPHA) -> None:
        if not (isinstance(alpha, (int, float)) and 0.0 < alpha < 1.0):
            raise ValueError(f"alpha must be a relative error in (0, 1), got {alpha!r}")
        self.alpha = float(alpha)
        self.gamma = (1.0 + self.alpha) / (1.0 - self.alpha)
        self._inv_log_gamma = 1.0 / math.log(self.gamma)

    def index(self, values: np.ndarray) -> np.ndarray:
        """Bucket indices (int64) of strictly positive, finite values."""
        return np.ceil(np.log(values) * self._inv_log_gamma).astype(np.int64)

    def value(self, index: np.ndarray | int) -> np.ndarray | float:
        """The representative value of bucket(s) ``index``."""
        return 2.0 * np.power(self.gamma, index) / (self.gamma + 1.0)

    def same_as(self, other: "LogMapping") -> bool:
        return self.gamma == other.gamma


def rank_positions(totals: np.ndarray, q: float) -> np.ndarray:
    """0-based rank of the "lower" q-quantile for each count in ``totals``."""
    return np.floor(q * (np.asarray(totals, dtype=np.float64) - 1.0)).astype(np.int64)


def quantile_columns(counts: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a 2-D count matrix, the column holding the q-quantile.

    Returns ``(column, total)``; rows with total 0 get column -1. One
    cumulative sum over the matrix, no per-row Python.
    """
    counts = np.asarray(counts)
    totals = counts.sum(axis=1)
    rank = rank_positions(totals, q)
    cumulative = np.cumsum(counts, axis=1)
    # The first column whose running count exceeds the rank holds that rank.
    column = (cumulative <= rank[:, None]).sum(axis=1)
    column[totals == 0] = -1
    return column, totals


def check_quantile(q: float) -> float:
    if not isinstance(q, (int, float)) or not 0.0 <= q <= 1.0 or math.isnan(q):
        raise ValueError(f"quantile must be a number in [0, 1], got {q!r}")
    return float(q)


class QuantileSketch:
    """Mergeable relative-error quantile sketch over non-negative values.

    >>> s = QuantileSketch(alpha=0.01)
    >>> s.add_many(np.array([1.0, 2.0, 3.0, 4.0, 100.0]))
    >>> abs(s.quantile(0.5) - 3.0) <= 0.01 * 3.0
    True
    """

    def __init__(self, alpha: float = DEFAULT_ALPHA, max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        if not isinstance(max_buckets, int) or max_buckets < 2:
            raise ValueError(f"max_buckets must be an int >= 2, got {max_buckets!r}")
        self.mapping = LogMapping(alpha)
        self.max_buckets = max_buckets
        self.zero_count = 0
        self.rejected = 0
        self.collapsed = False  # True once low buckets were folded together
        self._counts = np.zeros(0, dtype=np.int64)
        self._offset = 0  # bucket index of self._counts[0]
        self._min = math.inf
        self._max = -math.inf

    @property
    def alpha(self) -> float:
        return self.mapping.alpha

    @property
    def count(self) -> int:
        """Values accepted so far (zeros included, rejected ones not)."""
        return self.zero_count + int(self._counts.sum())

    @property
    def bucket_count(self) -> int:
        return int(self._counts.size)

    @property
    def min(self) -> float | None:
        return None if self.count == 0 else self._min

    @property
    def max(self) -> float | None:
        return None if self.count == 0 else self._max

    def add(self, value: float) -> None:
        self.add_many(np.array([value], dtype=np.float64))

    def add_many(self, values: np.ndarray) -> None:
        """Add a batch in one vectorised pass."""
        values = np.asarray(values, dtype=np.float64).ravel()
        if values.size == 0:
            return
        valid = np.isfinite(values) & (values >= 0.0)
        n_bad = values.size - int(np.count_nonzero(valid))
        if n_bad:
            self.rejected += n_bad
            values = values[valid]
            if values.size == 0:
                return
        self._min = min(self._min, float(values.min()))
        self._max = max(self._max, float(values.max()))
        positive = values[values > 0.0]
        self.zero_count += values.size - positive.size
        if positive.size:
            self._add_indices(self.mapping.index(positive))

    def _add_indices(self, indices: np.ndarray) -> None:
        lo = int(indices.min())
        hi = int(indices.max())
        if self._counts.size:
            lo = min(lo, self._offset)
            hi = max(hi, self._offset + self._counts.size - 1)
        lo = self._fit(lo, hi)
        if lo != self._offset or hi - lo + 1 != self._counts.size:
            self._counts = self._rebased(lo, hi)
        np.maximum(indices, lo, out=indices)
        self._counts += np.bincount(indices - lo, minlength=hi - lo + 1)

    def _fit(self, lo: int, hi: int) -> int:
        """The lowest bucket to keep so that [lo, hi] fits in max_buckets."""
        if hi - lo + 1 > self.max_buckets:
            self.collapsed = True
            return hi - self.max_buckets + 1
        return lo

    def _rebased(self, lo: int, hi: int) -> np.ndarray:
        """This sketch's counts laid out over buckets [lo, hi], folding any below lo."""
        out = np.zeros(hi - lo + 1, dtype=np.int64)
        if self._counts.size:
            own = np.arange(self._offset, self._offset + self._counts.size)
            np.add.at(out, np.maximum(own, lo) - lo, self._counts)
        self._offset = lo
        return out

    def merge(self, other: "QuantileSketch") -> None:
        """Fold ``other`` into this sketch; both must share alpha."""
        if not isinstance(other, QuantileSketch):
            raise TypeError(f"can only merge a QuantileSketch, got {type(other).__name__}")
        if not self.mapping.same_as(other.mapping):
            raise ValueError(
                f"cannot merge sketches of different alpha: this one has {self.alpha}, "
                f"the other {other.alpha}"
            )
        self.zero_count += other.zero_count
        self.rejected += other.rejected
        self.collapsed = self.collapsed or other.collapsed
        self._min = min(self._min, other._min)
        self._max = max(self._max, other._max)
        if other._counts.size == 0:
            return
        lo = other._offset
        hi = other._offset + other._counts.size - 1
        if self._counts.size:
            lo = min(lo, self._offset)
            hi = max(hi, self._offset + self._counts.size - 1)
        lo = self._fit(lo, hi)
        merged = self._rebased(lo, hi)
        theirs = np.arange(other._offset, other._offset + other._counts.size)
        np.add.at(merged, np.maximum(theirs, lo) - lo, other._counts)
        self._counts = merged

    def copy(self) -> "QuantileSketch":
        twin = QuantileSketch(self.alpha, self.max_buckets)
        twin.merge(self)
        return twin

    def quantile(self, q: float) -> float | None:
        """The "lower" q-quantile within relative error alpha; None when empty."""
        q = check_quantile(q)
        total = self.count
        if total == 0:
            return None
        rank = int(rank_positions(np.array([total]), q)[0])
        if rank < self.zero_count:
            return 0.0
        cumulative = np.cumsum(self._counts)
        column = int(np.searchsorted(cumulative, rank - self.zero_count, side="right"))
        estimate = float(self.mapping.value(self._offset + column))
        # Clamping to the observed range only moves the estimate closer.
        return min(max(estimate, self._min), self._max)

    def quantiles(self, qs: list[float]) -> list[float | None]:
        return [self.quantile(q) for q in qs]
