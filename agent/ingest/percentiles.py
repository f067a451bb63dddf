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
        if self.sketch is not None:
            return tuple(self.sketch.quantiles([0.5, 0.99]))
        p50, p99 = np.percentile(np.concatenate(self._parts), [50, 99])
        return float(p50), float(p99)
