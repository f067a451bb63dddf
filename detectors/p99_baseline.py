"""The baseline of each P99Drift series: the median of the p99s of its
trailing normal windows, and their spread (log space).

Why a median of per-window p99s, and what the spread is for, is in the
rule of mmtrace.detectors.p99_drift.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from mmtrace.detectors.p99_series_rows import RowArray, SeriesRows

MAD_TO_SIGMA = 1.4826  # median absolute deviation -> standard deviation (normal data)


class Baselines(SeriesRows):
    """Per series: a ring of the log p99s of the last ``baseline_windows``
    windows that entered the baseline, and the baseline (``base``) and
    sigma computed from it once it holds ``min_baseline_windows``; NaN
    before."""

    def __init__(self, baseline_windows: int, min_baseline_windows: int) -> None:
        self.baseline_windows = baseline_windows
        self.min_baseline_windows = min_baseline_windows

    def row_arrays(self) -> Iterator[RowArray]:
        yield RowArray("hist", (self.baseline_windows,), np.float64, np.nan)
        yield RowArray("hist_pos", (), np.int64, 0)
        yield RowArray("hist_len", (), np.int64, 0)
        yield RowArray("base", (), np.float64, np.nan)
        yield RowArray("sigma", (), np.float64, np.nan)

    def push(self, rows: np.ndarray, log_p99: np.ndarray) -> None:
        """Add one window's log p99 to the history of each of ``rows``."""
        if rows.size == 0:
            return
        pos = self.hist_pos[rows]
        self.hist[rows, pos] = log_p99
        self.hist_pos[rows] = (pos + 1) % self.baseline_windows
        self.hist_len[rows] = np.minimum(self.hist_len[rows] + 1, self.baseline_windows)

    def refresh(self, rows: np.ndarray) -> None:
        """Recompute baseline and sigma of ``rows`` whose history is long enough."""
        rows = rows[self.hist_len[rows] >= self.min_baseline_windows]
        if rows.size == 0:
            return
        hist = self.hist[rows]
        lengths = self.hist_len[rows]
        centre = _leading_median(hist, lengths)
        spread = _leading_median(np.abs(hist - centre[:, None]), lengths)
        self.base[rows] = np.exp(centre)
        self.sigma[rows] = MAD_TO_SIGMA * spread

    def forget(self, sid: int) -> None:
        self.hist[sid] = np.nan
        self.hist_pos[sid] = 0
        self.hist_len[sid] = 0
        self.base[sid] = np.nan
        self.sigma[sid] = np.nan


def _leading_median(rows: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Median of each row's non-NaN entries (``lengths`` of them).

    np.nanmedian goes through masked arrays and costs ~0.3 ms a call; a
    sort puts the NaNs last, so the median sits at known positions.
    """
    ordered = np.sort(rows, axis=1)
    lower = np.take_along_axis(ordered, ((lengths - 1) // 2)[:, None], axis=1)[:, 0]
    upper = np.take_along_axis(ordered, (lengths // 2)[:, None], axis=1)[:, 0]
    return 0.5 * (lower + upper)
