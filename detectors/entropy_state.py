"""What the attention-entropy drift detector knows about one modality: the
baseline and level of each (layer, head) and of the spread across heads,
and the state of its alarms (the rule is in entropy_drift)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LevelSeries:
    """Baseline and level of many series at once (numpy arrays by slot)."""

    count: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    mean: np.ndarray = field(default_factory=lambda: np.zeros(0))
    var: np.ndarray = field(default_factory=lambda: np.zeros(0))
    level: np.ndarray = field(default_factory=lambda: np.zeros(0))
    up_run: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    down_run: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def grow(self, size: int) -> None:
        extra = size - self.count.shape[0]
        if extra <= 0:
            return
        self.count = np.concatenate([self.count, np.zeros(extra, dtype=np.int64)])
        self.mean = np.concatenate([self.mean, np.zeros(extra)])
        self.var = np.concatenate([self.var, np.zeros(extra)])
        self.level = np.concatenate([self.level, np.full(extra, np.nan)])
        self.up_run = np.concatenate([self.up_run, np.zeros(extra, dtype=np.int64)])
        self.down_run = np.concatenate([self.down_run, np.zeros(extra, dtype=np.int64)])

    def smooth(self, idx: np.ndarray, values: np.ndarray, smoothing: float) -> np.ndarray:
        previous = self.level[idx]
        level = np.where(np.isnan(previous), values, smoothing * values + (1.0 - smoothing) * previous)
        self.level[idx] = level
        return level

    def learn(self, idx: np.ndarray, values: np.ndarray, warmup: int, alpha: float) -> None:
        """Exact running mean / variance (Welford) up to `warmup`, EWMA after."""
        count = self.count[idx] + 1
        mean, var = self.mean[idx], self.var[idx]
        delta = values - mean
        exact = count <= warmup
        new_mean = np.where(exact, mean + delta / count, mean + alpha * delta)
        # var holds the population variance in both regimes.
        exact_var = (var * (count - 1) + delta * (values - new_mean)) / count
        ewma_var = (1.0 - alpha) * (var + alpha * delta * delta)
        self.count[idx] = count
        self.mean[idx] = new_mean
        self.var[idx] = np.where(exact, exact_var, ewma_var)


@dataclass
class Alarm:
    firing: bool = False
    quiet: int = 0  # observations in a row without the condition, while firing
    fired_ts_ns: int = 0


class ModalityState:
    """The heads of one modality (slot per (layer, head)), their spread, and
    one alarm per kind."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.slots: dict[tuple[str, int], int] = {}
        self.names: list[tuple[str, int]] = []
        self.heads = LevelSeries()
        self.spread = LevelSeries()
        self.spread.grow(1)
        self.alarms = {kind: Alarm() for kind in kinds}
        self.observations = 0

    def slots_for(self, keys: list[tuple[str, int]]) -> np.ndarray:
        for key in keys:
            if key not in self.slots:
                self.slots[key] = len(self.names)
                self.names.append(key)
        self.heads.grow(len(self.names))
        return np.fromiter((self.slots[key] for key in keys), dtype=np.int64, count=len(keys))

    def firing(self) -> bool:
        return any(alarm.firing for alarm in self.alarms.values())

    def head_evidence(self, involved: np.ndarray, values: np.ndarray, idx: np.ndarray, limit: int) -> dict:
        """The heads of an alarm, the `limit` farthest from their baseline
        first, with their latest value, level and baseline."""
        heads = self.heads
        latest = dict(zip(idx.tolist(), values.tolist()))
        deviation = np.abs(heads.level[involved] - heads.mean[involved])
        ordered = involved[np.argsort(-deviation, kind="stable")][:limit]
        return {
            "n_heads": int(len(involved)),
            "heads": [
                {
                    "layer": self.names[k][0],
                    "head": self.names[k][1],
                    "value": latest[k],
                    "level": float(heads.level[k]),
                    "baseline": float(heads.mean[k]),
                    "baseline_std": float(math.sqrt(heads.var[k])),
                }
                for k in ordered.tolist()
            ],
            "baseline": {
                "mean": float(heads.mean[involved].mean()),
                "level": float(heads.level[involved].mean()),
            },
        }

    def spread_evidence(self, values: np.ndarray, delta_sigma: float) -> dict:
        s = self.spread
        return {
            "spread": float(s.level[0]),
            "last_spread": float(values.std()),
            "baseline_spread": float(s.mean[0]),
            "delta": float(s.level[0] - s.mean[0]),
            "delta_sigma": delta_sigma,
            "n_heads": int(values.shape[0]),
        }

    def baseline(self) -> list[dict]:
        """Per head: observations, baseline mean / std and current level."""
        s = self.heads
        return [
            {"layer": layer, "head": head, "count": int(s.count[k]), "mean": float(s.mean[k]),
             "std": float(math.sqrt(s.var[k])), "level": float(s.level[k])}
            for k, (layer, head) in enumerate(self.names)
        ]
