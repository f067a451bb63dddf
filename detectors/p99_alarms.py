"""The alarm state machine of P99Drift: each closed window's p99 judged
against the series' baseline, and the anomaly records it decides.

The rule (bad and clear windows, normal -> pending -> firing -> resolved,
the frozen baseline) is in the docstring of mmtrace.detectors.p99_drift.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from mmtrace.detectors.p99_baseline import Baselines
from mmtrace.detectors.p99_series_rows import RowArray, SeriesRows

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
TOP_CONTRIBUTORS = 5
KEPT_CONTRIBUTORS = 64  # per incident; bounds memory on threads that come and go


@dataclass(frozen=True)
class AlarmRule:
    """The settings the state machine judges by (see P99Drift)."""

    window_ns: int
    factor: float
    clear_factor: float
    floor: float
    consecutive: int
    clear_windows: int
    min_samples: int
    noise_sigmas: float
    min_value: float


@dataclass
class _Verdicts:
    """One closed window, judged for every series."""

    eligible: np.ndarray  # enough samples to count
    bad: np.ndarray
    clear: np.ndarray
    fire_ratio: np.ndarray
    p99: np.ndarray
    log_p99: np.ndarray
    totals: np.ndarray
    start_ns: int


class AlarmStates(SeriesRows):
    """Per series: its state, the windows of its current bad streak and
    clearing run (the evidence), and the contributors of its incident."""

    def __init__(self, rule: AlarmRule, baselines: Baselines) -> None:
        self.rule = rule
        self.baselines = baselines
        self._clear_scale = (rule.clear_factor - 1.0) / (rule.factor - 1.0)
        self.incidents: list[Counter] = []

    def row_arrays(self) -> Iterator[RowArray]:
        yield RowArray("state", (), np.int8, NORMAL)
        for prefix, length in (("streak", self.rule.consecutive), ("clear", self.rule.clear_windows)):
            yield RowArray(prefix + "_n", (), np.int64, 0)
            yield RowArray(prefix + "_p99", (length,), np.float64, np.nan)
            yield RowArray(prefix + "_count", (length,), np.int64, 0)
            yield RowArray(prefix + "_start", (length,), np.int64, 0)
        yield RowArray("streak_log", (self.rule.consecutive,), np.float64, np.nan)
        yield RowArray("fired_ns", (), np.int64, 0)

    def add_series(self) -> None:
        self.incidents.append(Counter())

    def keep_series(self, keep: np.ndarray) -> None:
        """Incidents of the series kept by a drop, in their new order."""
        self.incidents = [self.incidents[i] for i in keep.tolist()]

    def forget(self, sid: int) -> None:
        self.state[sid] = NORMAL
        self.streak_n[sid] = 0
        self.clear_n[sid] = 0
        self.incidents[sid].clear()

    def pass_empty_window(self, n_series: int) -> None:
        # An empty window is neutral, except that resolved lasts one window.
        if not n_series:
            return
        states = self.state[:n_series]
        states[states == RESOLVED] = NORMAL

    def judge(self, window: int, p99: np.ndarray, totals: np.ndarray, tails,
              names: list[str], rejected: np.ndarray) -> list[dict]:
        """Move every series' state on by one closed window; returns the
        firing and resolved records it decided."""
        state = self.state[: len(names)]
        state[state == RESOLVED] = NORMAL  # resolved lasts one window
        v = self._verdicts(window, p99, totals)
        normal = state == NORMAL
        pending = state == PENDING
        firing = state == FIRING
        changed = self._feed_baseline(v, normal, pending)
        in_streak = self._extend_streaks(v, np.flatnonzero((normal | pending) & v.bad))
        self._add_contributors(tails, (state == PENDING) | firing)
        emitted = self._fire(v, in_streak, names, rejected)
        emitted += self._resolve(v, firing, names, rejected)
        self.baselines.refresh(np.flatnonzero(changed))
        return emitted

    def _verdicts(self, window: int, p99: np.ndarray, totals: np.ndarray) -> _Verdicts:
        rule = self.rule
        n = p99.size
        base = self.baselines.base[:n]
        eligible = totals >= rule.min_samples
        ready = ~np.isnan(base)
        with np.errstate(invalid="ignore"):
            # fmax skips NaN: no spread measured yet means no widening.
            fire_ratio = np.fmax(rule.factor, np.exp(rule.noise_sigmas * self.baselines.sigma[:n]))
            clear_ratio = 1.0 + (fire_ratio - 1.0) * self._clear_scale
            excess = p99 - base
            bad = eligible & ready & (p99 > base * fire_ratio) & (excess > rule.floor)
            clear = eligible & ready & ((p99 <= base * clear_ratio) | (excess <= rule.floor))
        log_p99 = np.log(np.fmax(p99, rule.min_value))  # only read for windows with samples
        return _Verdicts(eligible, bad, clear, fire_ratio, p99, log_p99, totals, window * rule.window_ns)

    def _feed_baseline(self, v: _Verdicts, normal: np.ndarray, pending: np.ndarray) -> np.ndarray:
        """Normal windows join the baseline; returns the series whose history changed."""
        to_feed = normal & v.eligible & ~v.bad
        aborted = np.flatnonzero(pending & v.eligible & ~v.bad)
        # Windows of an aborted pending run were noise after all: they join
        # the baseline before the current window does.
        changed = to_feed.copy()
        for sid in aborted.tolist():
            for k in range(int(self.streak_n[sid])):
                self.baselines.push(np.array([sid]), np.array([self.streak_log[sid, k]]))
            self.streak_n[sid] = 0
            self.incidents[sid].clear()
            self.state[sid] = NORMAL
            changed[sid] = True
        to_feed[aborted] = True
        fed = np.flatnonzero(to_feed)
        self.baselines.push(fed, v.log_p99[fed])
        return changed

    def _extend_streaks(self, v: _Verdicts, in_streak: np.ndarray) -> np.ndarray:
        """Bad windows of normal and pending series extend (or start) their
        streak, and make them pending."""
        if in_streak.size:
            fresh = in_streak[self.state[in_streak] == NORMAL]
            self.streak_n[fresh] = 0
            for sid in fresh.tolist():
                self.incidents[sid].clear()
            k = self.streak_n[in_streak]
            self.streak_p99[in_streak, k] = v.p99[in_streak]
            self.streak_log[in_streak, k] = v.log_p99[in_streak]
            self.streak_count[in_streak, k] = v.totals[in_streak]
            self.streak_start[in_streak, k] = v.start_ns
            self.streak_n[in_streak] = k + 1
            self.state[in_streak] = PENDING
        return in_streak

    def _fire(self, v: _Verdicts, in_streak: np.ndarray, names, rejected) -> list[dict]:
        emitted = []
        fired = in_streak[self.streak_n[in_streak] >= self.rule.consecutive]
        for sid in fired.tolist():
            self.state[sid] = FIRING
            self.fired_ns[sid] = v.start_ns + self.rule.window_ns
            windows = self._windows(self.streak_start, self.streak_p99, self.streak_count, sid, self.streak_n)
            emitted.append(self._anomaly(sid, "firing", v, windows, names, rejected))
        return emitted

    def _resolve(self, v: _Verdicts, firing: np.ndarray, names, rejected) -> list[dict]:
        """Clear windows of series that were firing count towards resolving;
        a window with enough samples that is not clear restarts the count."""
        clearing = np.flatnonzero(firing & v.clear)
        self.clear_n[np.flatnonzero(firing & v.eligible & ~v.clear)] = 0
        if clearing.size:
            k = self.clear_n[clearing]
            self.clear_p99[clearing, k] = v.p99[clearing]
            self.clear_count[clearing, k] = v.totals[clearing]
            self.clear_start[clearing, k] = v.start_ns
            self.clear_n[clearing] = k + 1
        emitted = []
        resolved = clearing[self.clear_n[clearing] >= self.rule.clear_windows]
        for sid in resolved.tolist():
            self.state[sid] = RESOLVED
            windows = self._windows(self.clear_start, self.clear_p99, self.clear_count, sid, self.clear_n)
            record = self._anomaly(sid, "resolved", v, windows, names, rejected)
            record["evidence"]["fired_ts_ns"] = int(self.fired_ns[sid])
            emitted.append(record)
            self.clear_n[sid] = 0
            self.streak_n[sid] = 0
            self.incidents[sid].clear()
        return emitted

    def _add_contributors(self, tails, incident: np.ndarray) -> None:
        for series_ids, contrib, counts in tails:
            mine = incident[series_ids]
            if not mine.any():
                continue
            for sid, who, n in zip(series_ids[mine].tolist(), contrib[mine].tolist(), counts[mine].tolist()):
                self.incidents[sid][who] += n
        for sid in np.flatnonzero(incident).tolist():
            tally = self.incidents[sid]
            if len(tally) > 2 * KEPT_CONTRIBUTORS:
                self.incidents[sid] = Counter(dict(tally.most_common(KEPT_CONTRIBUTORS)))

    def _windows(self, starts, p99s, counts, sid: int, held) -> list[dict]:
        """The evidence windows series ``sid`` holds (``held[sid]`` of them)."""
        n = int(held[sid])
        return [
            {"start_ns": int(s), "end_ns": int(s) + self.rule.window_ns, "p99": float(p), "count": int(c)}
            for s, p, c in zip(starts[sid, :n].tolist(), p99s[sid, :n].tolist(), counts[sid, :n].tolist())
        ]

    def _anomaly(self, sid: int, state: str, v: _Verdicts, windows: list[dict], names, rejected) -> dict:
        rule = self.rule
        baseline = float(self.baselines.base[sid])
        fire_ratio = float(v.fire_ratio[sid])
        return {
            "detector": DETECTOR,
            "series": names[sid],
            "state": state,
            "ts_ns": int(v.start_ns + rule.window_ns),
            "evidence": {
                "windows": windows,
                "p99": windows[-1]["p99"],
                "baseline": baseline,
                "factor": rule.factor,
                "fire_ratio": fire_ratio,
                "threshold": max(baseline * fire_ratio, baseline + rule.floor),
                "floor": rule.floor,
                "samples": sum(w["count"] for w in windows),
                "top_contributors": [
                    [_plain(who), int(n)] for who, n in self.incidents[sid].most_common(TOP_CONTRIBUTORS)
                ],
                "rejected": int(rejected[sid]),
            },
        }


def _plain(value):
    """numpy scalar -> the Python value json can write."""
    return value.item() if isinstance(value, np.generic) else value
