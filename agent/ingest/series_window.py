"""The percentiles of one latency series (`runq_delay{pid=P}`,
`sync_wait{pid=P,stream=0x..}`, `submit_to_retire{pid=P}`) over a stretch
of events: cut by the very functions that feed the P99 detector
(latency_series), so a figure asked for is the detector's own. The live
daemon asks it of its rings, `mmtrace mcp` of a recording's replay."""

import re

import numpy as np

from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.ingest.percentiles import Percentiles

MAX_NAME = 200
# as series_keys.SeriesKey writes them: anything else names no series, and
# would answer "count 0" as if the series were quiet
_NAME = re.compile(r"(?:runq_delay|submit_to_retire)\{pid=(?:0|[1-9][0-9]{0,9})\}"
                   r"|sync_wait\{pid=(?:0|[1-9][0-9]{0,9}),stream=0x[0-9a-f]{1,16}\}")


def check_name(name) -> str:
    """`name` when it names a kernel stream's series; ValueError saying what is
    expected otherwise."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME \
            or not _NAME.fullmatch(name):
        shown = f"{len(name)} characters" if isinstance(name, str) and len(name) > 80 \
            else repr(name)
        raise ValueError(f"expected a series name such as runq_delay{{pid=1234}}, "
                         f"sync_wait{{pid=1234,stream=0x0}} or submit_to_retire{{pid=1234}} "
                         f"(at most {MAX_NAME} characters), got {shown}")
    return name


class SeriesWindow:
    """The values of the series `name` from `start_ns` on, fed event batches."""

    def __init__(self, name: str, start_ns: int, end_ns: int | None = None):
        self.name = check_name(name)
        self.start_ns, self.end_ns = start_ns, end_ns
        self.values = Percentiles()
        self.first_ns: int | None = None
        self.last_ns: int | None = None

    def _pick(self, key) -> int:
        return 0 if str(key) == self.name else -1

    def add_runq(self, runq: np.ndarray, submitters: ls.Submitters):
        self._add(ls.runq_series(self._pick, runq, submitters))

    def add_device(self, aligned: np.ndarray):
        """Aligned device events (retired_ns known where retired)."""
        self._add(ls.sync_series(self._pick, aligned))
        self._add(ls.retire_series(self._pick, aligned))

    def _add(self, series: ls.Series):
        keep = (series.ids == 0) & (series.ts_ns >= self.start_ns)
        if self.end_ns is not None:
            keep &= series.ts_ns < self.end_ns
        if not keep.any():
            return
        ts = series.ts_ns[keep]
        self.values.add(series.values_s[keep])
        low, high = int(ts.min()), int(ts.max())
        self.first_ns = low if self.first_ns is None else min(self.first_ns, low)
        self.last_ns = high if self.last_ns is None else max(self.last_ns, high)

    def summary(self) -> dict:
        """count, and p50 / p90 / p99 / max / mean in milliseconds (None when
        no event of the series fell in the window)."""
        v = self.values
        out = {"series": self.name, "start_ns": self.start_ns, "end_ns": self.end_ns,
               "count": v.count, "first_ns": self.first_ns, "last_ns": self.last_ns,
               "p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
        if v.count:
            p50, p90, p99 = v.quantiles([0.5, 0.9, 0.99])
            out.update(p50_ms=p50 * 1e3, p90_ms=p90 * 1e3, p99_ms=p99 * 1e3,
                       max_ms=v.max * 1e3, mean_ms=v.total / v.count * 1e3)
        return out
