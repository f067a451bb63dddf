"""Percentiles of a stream of values in bounded memory."""

import numpy as np

from mmtrace.detectors.quantile_sketch import QuantileSketch


class Percentiles:
    """p50/p99 of a stream of values: exact (numpy's) while they fit in
    `exact_limit` values, then from a mergeable quantile sketch (within 1 %)."""

    def __init__(self, exact_limit: int = 1 << 20):
        self.exact_limit = exact_limit
        self._parts: list[np.ndarray] = []
        self._held = 0
        self.sketch = None
        self.count = 0
        self.total = 0.0
        self.max = None

    def add(self, values: np.ndarray):
        if not len(values):
            return
        values = values.astype(np.float64)
        self.count += len(values)
        self.total += float(values.sum())
        top = float(values.max())
        self.max = top if self.max is None else max(self.max, top)
        if self.sketch is not None:
            self.sketch.add_many(values)
            return
        self._parts.append(values)
        self._held += len(values)
        if self._held > self.exact_limit:
            self.sketch = QuantileSketch()
            for part in self._parts:
                self.sketch.add_many(part)
            self._parts = []

    def p50_p99(self) -> tuple[float, float] | None:
        if not self.count:
            return None
        p50, p99 = self.quantiles([0.5, 0.99])
        return p50, p99

    def quantiles(self, qs: list[float]) -> list[float]:
        """The quantiles `qs` (each in 0..1) of the values added; at least one."""
        if self.sketch is not None:
            return [float(q) for q in self.sketch.quantiles(qs)]
        return [float(q) for q in np.percentile(np.concatenate(self._parts),
                                                [q * 100 for q in qs])]
