"""Attention-entropy drift: a shift in how a model spreads its attention.

Input: the samples `attention_entropy.watch` hands its sink (or the hint
socket's `entropy` messages): dicts with `layer`, `head`, `value` (normalised
entropy, 0..1) and `modality`. Each `update()` call is one observation per
(layer, head, modality) it mentions; a head named twice in one call makes
two observations, in order.

The rule, per modality. For every (layer, head):

- baseline: mean and standard deviation of its raw values, learned exactly
  over the first `warmup` observations, then followed by an EWMA
  (`baseline_alpha`). A head's baseline is frozen while that head is
  deviating, and every baseline of the modality is frozen while one of its
  alarms fires, so a sustained shift is never absorbed.
- level: an EWMA of the raw values (`smoothing`, lambda). Single inputs are
  noisy (a few sampled rows of one request); the level is what is judged.
  Its spread under a steady input is sigma_L = sigma * sqrt(lambda / (2 -
  lambda)); `sigma` is floored at `sigma_floor`.
- the head *rises* on an observation when level > tau AND level - baseline
  > max(k_sigma * sigma_L, min_rise). Both are needed: a head whose natural
  level already sits above tau (some heads of real models do) only counts
  when it moves well beyond its own baseline, and a small move above the
  baseline never counts unless it crosses tau.
- the head *collapses* when baseline - level > max(k_sigma * sigma_L,
  min_fall): attention that suddenly concentrates on a few keys.
- in both cases the raw value itself must also lie beyond the baseline by
  min_rise (min_fall): one freak input lingers in the level for a few
  observations and must not make a run on its own.

Anomalies. Each kind fires once per modality, on the observation that
completes its condition, as a record with "state": "firing". It holds
while the deviation stays above half its threshold (hysteresis: for rise,
level - baseline > max(band, min_rise) / 2 on `rise_heads` heads; likewise
for collapse and spread); after `clear` observations in a row below that it
resolves (a record with "state": "resolved"), and may fire again later.

- "entropy_rise": at least `rise_heads` heads have risen on `consecutive`
  consecutive observations.
- "entropy_collapse": at least `collapse_heads` heads have collapsed on
  `consecutive` consecutive observations.
- "entropy_spread": the standard deviation of the values across heads (one
  number per observation, smoothed and baselined the same way) exceeds its
  baseline by more than `delta_sigma` on `consecutive` consecutive
  observations.

Values that are not a number in [0, 1] (NaN, negative, > 1) and malformed
samples are counted in `rejected` and otherwise ignored, as are new heads
beyond `max_heads` per modality and new modalities beyond `max_modalities`
(the sources are other processes; memory stays bounded).

Why these defaults: on all-MiniLM-L6-v2 fed one natural sentence per
forward with 8 sampled rows, a head's value moves by ~0.06 (std) from one
forward to the next; the level's band is then 4 x 0.38 x 0.06 = 0.09.
Natural held-out sentences (2100 forwards, 1 or 8 per forward) raised no
alarm; random token ids collapse several heads within ~5 forwards; shuffled
word order pushes one head from ~0.70 to ~0.87, caught within ~10 forwards
once each forward measures 32 rows or more. `tests/test_entropy_drift.py`
replays this on the real model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

__all__ = ["EntropyDriftDetector"]

_KINDS = ("entropy_rise", "entropy_collapse", "entropy_spread")
KINDS = _KINDS     # public: what exporters label
_TOLERANCE = 1e-6  # float noise around the ends of [0, 1] is accepted and clipped
_HOLD = 0.5  # a firing alarm holds while the deviation exceeds this share of its threshold


@dataclass
class _Series:
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
class _Alarm:
    firing: bool = False
    quiet: int = 0  # observations in a row without the condition, while firing
    fired_ts_ns: int = 0


class _Modality:
    def __init__(self) -> None:
        self.slots: dict[tuple[str, int], int] = {}
        self.names: list[tuple[str, int]] = []
        self.heads = _Series()
        self.spread = _Series()
        self.spread.grow(1)
        self.alarms = {kind: _Alarm() for kind in _KINDS}
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


class EntropyDriftDetector:
    """Baselines attention entropy per (layer, head, modality) and reports drift.

    See the module docstring for the rule. `update(samples)` returns the
    anomaly records those samples produced (and passes each to `on_anomaly`
    when given), as JSON-serialisable dicts:
    {"detector": "attention_entropy", "kind": "entropy_rise" |
    "entropy_collapse" | "entropy_spread", "state": "firing" | "resolved",
    "modality": ..., "ts_ns": ..., "evidence": {...}}. A firing record's
    evidence names the heads involved (layer, head, latest value, level,
    baseline mean and std), or for spread the spread and its baseline.

    Counters: accepted, rejected (samples), fired (firing records).
    Usable directly as a sink: watch(model, sink=detector.update).
    """

    def __init__(
        self,
        *,
        tau: float = 0.85,
        delta_sigma: float = 0.12,
        consecutive: int = 3,
        warmup: int = 30,
        smoothing: float = 0.25,
        k_sigma: float = 4.0,
        min_rise: float = 0.05,
        min_fall: float = 0.10,
        sigma_floor: float = 0.01,
        baseline_alpha: float = 0.02,
        rise_heads: int = 1,
        collapse_heads: int = 2,
        clear: int = 3,
        max_heads: int = 65536,
        max_modalities: int = 256,
        evidence_heads: int = 16,
        clock: Callable[[], int] = time.monotonic_ns,
        on_anomaly: Callable[[dict], object] | None = None,
    ) -> None:
        _check_range("tau", tau, 0.0, 1.0)
        _check_range("smoothing", smoothing, 0.0, 1.0, low_open=True)
        _check_range("baseline_alpha", baseline_alpha, 0.0, 1.0, low_open=True)
        for name, value in (("delta_sigma", delta_sigma), ("k_sigma", k_sigma), ("min_rise", min_rise),
                            ("min_fall", min_fall), ("sigma_floor", sigma_floor)):
            _check_range(name, value, 0.0, math.inf)
        for name, value in (("consecutive", consecutive), ("warmup", warmup), ("rise_heads", rise_heads),
                            ("collapse_heads", collapse_heads), ("clear", clear), ("max_heads", max_heads),
                            ("max_modalities", max_modalities), ("evidence_heads", evidence_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.tau = tau
        self.delta_sigma = delta_sigma
        self.consecutive = consecutive
        self.warmup = warmup
        self.smoothing = smoothing
        self.k_sigma = k_sigma
        self.min_rise = min_rise
        self.min_fall = min_fall
        self.sigma_floor = sigma_floor
        self.baseline_alpha = baseline_alpha
        self.rise_heads = rise_heads
        self.collapse_heads = collapse_heads
        self.clear = clear
        self.max_heads = max_heads
        self.max_modalities = max_modalities
        self.evidence_heads = evidence_heads
        self._clock = clock
        self._on_anomaly = on_anomaly
        # sigma of the level relative to sigma of a raw value, for a steady input
        self._level_factor = math.sqrt(smoothing / (2.0 - smoothing))
        self._modalities: dict[str | None, _Modality] = {}
        self.accepted = 0
        self.rejected = 0
        self.fired = 0

    # -- public --------------------------------------------------------------

    def update(self, samples: Iterable[dict], ts_ns: int | None = None) -> list[dict]:
        """Feed one batch of samples; returns the anomaly records (firing and
        resolved) it produced. ts_ns stamps them; by default the latest
        `ts_ns` among the samples, else the clock (CLOCK_MONOTONIC)."""
        rounds, latest_ts = self._validated_rounds(samples)
        when = ts_ns if ts_ns is not None else (latest_ts if latest_ts is not None else self._clock())
        records = []
        for modality, observations in rounds.items():
            state = self._modalities.get(modality)
            if state is None:
                state = self._modalities[modality] = _Modality()
            for keys, values in observations:
                records.extend(self._observe(state, modality, keys, values, when))
        self.fired += sum(record["state"] == "firing" for record in records)
        if self._on_anomaly is not None:
            for record in records:
                self._on_anomaly(record)
        return records

    def firing(self, modality: str | None = None) -> list[str]:
        """Kinds currently firing for `modality`."""
        state = self._modalities.get(modality)
        if state is None:
            return []
        return [kind for kind, alarm in state.alarms.items() if alarm.firing]

    def baseline(self, modality: str | None = None) -> list[dict]:
        """Per head: observations, baseline mean / std and current level."""
        state = self._modalities.get(modality)
        if state is None:
            return []
        s = state.heads
        return [
            {"layer": layer, "head": head, "count": int(s.count[k]), "mean": float(s.mean[k]),
             "std": float(math.sqrt(s.var[k])), "level": float(s.level[k])}
            for k, (layer, head) in enumerate(state.names)
        ]

    # -- input checking ----------------------------------------------------

    def _validated_rounds(self, samples):
        """Group valid samples by modality, then into observations (a head's
        n-th sample in this batch belongs to the n-th observation)."""
        rounds: dict[str | None, list[tuple[list, list]]] = {}
        seen: dict[tuple, int] = {}  # (modality, key) -> samples so far in this batch
        new_heads: dict[str | None, int] = {}
        latest_ts = None
        if isinstance(samples, dict):
            samples = [samples]
        for sample in samples:
            parsed = self._parse(sample)
            if parsed is None or not self._has_room(parsed[0], parsed[1], seen, new_heads, rounds):
                self.rejected += 1
                continue
            modality, key, value, ts = parsed
            self.accepted += 1
            if ts is not None:
                latest_ts = ts if latest_ts is None else max(latest_ts, ts)
            occurrence = seen.get((modality, key), 0)
            seen[(modality, key)] = occurrence + 1
            per_modality = rounds.setdefault(modality, [])
            if occurrence == len(per_modality):
                per_modality.append(([], []))
            per_modality[occurrence][0].append(key)
            per_modality[occurrence][1].append(value)
        return rounds, latest_ts

    def _has_room(self, modality, key, seen, new_heads, rounds) -> bool:
        state = self._modalities.get(modality)
        if state is None and modality not in rounds and len(self._modalities) + sum(
            m not in self._modalities for m in rounds
        ) >= self.max_modalities:
            return False
        if (modality, key) in seen or (state is not None and key in state.slots):
            return True
        known = 0 if state is None else len(state.names)
        if known + new_heads.get(modality, 0) >= self.max_heads:
            return False
        new_heads[modality] = new_heads.get(modality, 0) + 1
        return True

    @staticmethod
    def _parse(sample):
        if not isinstance(sample, dict):
            return None
        layer, head, value = sample.get("layer"), sample.get("head"), sample.get("value")
        modality = sample.get("modality")
        if not isinstance(layer, str) or isinstance(head, bool) or not isinstance(head, int):
            return None
        if modality is not None and not isinstance(modality, str):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        value = float(value)
        if not (-_TOLERANCE <= value <= 1.0 + _TOLERANCE):  # also false for NaN
            return None
        ts = sample.get("ts_ns")
        ts = ts if isinstance(ts, int) and not isinstance(ts, bool) else None
        return modality, (layer, head), min(max(value, 0.0), 1.0), ts

    # -- the rule --------------------------------------------------------------

    def _observe(self, state: _Modality, modality, keys, values, ts_ns) -> list[dict]:
        state.observations += 1
        idx = state.slots_for(keys)
        values = np.asarray(values, dtype=np.float64)
        heads = state.heads
        level = heads.smooth(idx, values, self.smoothing)
        warm = heads.count[idx] >= self.warmup
        mean = heads.mean[idx]
        band = self.k_sigma * self._level_factor * np.maximum(np.sqrt(heads.var[idx]), self.sigma_floor)
        # The raw value must agree: one freak input lingers in the level for
        # several observations and must not count as a run by itself.
        rising = (warm & (level > self.tau) & (level - mean > np.maximum(band, self.min_rise))
                  & (values - mean > self.min_rise))
        falling = warm & (mean - level > np.maximum(band, self.min_fall)) & (mean - values > self.min_fall)
        heads.up_run[idx] = np.where(rising, heads.up_run[idx] + 1, 0)
        heads.down_run[idx] = np.where(falling, heads.down_run[idx] + 1, 0)

        spread_now = float(values.std()) if values.shape[0] >= 2 else None
        spread_high = False
        if spread_now is not None:
            spread_high = self._judge_spread(state, spread_now)

        frozen = state.firing()
        if not frozen:
            steady = ~(rising | falling)
            heads.learn(idx[steady], values[steady], self.warmup, self.baseline_alpha)
            if spread_now is not None and not spread_high:
                state.spread.learn(np.zeros(1, dtype=np.int64), np.array([spread_now]), self.warmup,
                                   self.baseline_alpha)

        risen = idx[heads.up_run[idx] >= self.consecutive]
        collapsed = idx[heads.down_run[idx] >= self.consecutive]
        fires = {
            "entropy_rise": len(risen) >= self.rise_heads,
            "entropy_collapse": len(collapsed) >= self.collapse_heads,
            "entropy_spread": state.spread.up_run[0] >= self.consecutive,
        }
        # Hysteresis: a firing alarm holds while the deviation stays above
        # half its threshold, so a shift that hovers at the edge does not flap.
        holds = {
            "entropy_rise": np.count_nonzero(
                warm & (level - mean > _HOLD * np.maximum(band, self.min_rise))) >= self.rise_heads,
            "entropy_collapse": np.count_nonzero(
                warm & (mean - level > _HOLD * np.maximum(band, self.min_fall))) >= self.collapse_heads,
            "entropy_spread": state.spread.level[0] - state.spread.mean[0] > _HOLD * self.delta_sigma,
        }
        records = []
        for kind, met in fires.items():
            alarm = state.alarms[kind]
            if met and not alarm.firing:
                alarm.firing, alarm.quiet, alarm.fired_ts_ns = True, 0, int(ts_ns)
                involved = risen if kind == "entropy_rise" else collapsed
                records.append(self._anomaly(kind, state, modality, ts_ns, involved, values, idx))
            elif alarm.firing:
                alarm.quiet = 0 if holds[kind] else alarm.quiet + 1
                if alarm.quiet >= self.clear:
                    alarm.firing = False
                    records.append(self._resolution(kind, state, modality, ts_ns, alarm))
        return records

    def _judge_spread(self, state: _Modality, spread_now: float) -> bool:
        s = state.spread
        slot = np.zeros(1, dtype=np.int64)
        level = s.smooth(slot, np.array([spread_now]), self.smoothing)[0]
        high = bool(s.count[0] >= self.warmup and level - s.mean[0] > self.delta_sigma)
        s.up_run[0] = s.up_run[0] + 1 if high else 0
        return high

    def _anomaly(self, kind, state: _Modality, modality, ts_ns, involved, values, idx) -> dict:
        heads = state.heads
        evidence = {
            "observations": state.observations,
            "consecutive": self.consecutive,
            "tau": self.tau,
        }
        if kind == "entropy_spread":
            s = state.spread
            evidence.update(
                spread=float(s.level[0]),
                last_spread=float(values.std()),
                baseline_spread=float(s.mean[0]),
                delta=float(s.level[0] - s.mean[0]),
                delta_sigma=self.delta_sigma,
                n_heads=int(values.shape[0]),
            )
        else:
            latest = dict(zip(idx.tolist(), values.tolist()))
            deviation = np.abs(heads.level[involved] - heads.mean[involved])
            ordered = involved[np.argsort(-deviation, kind="stable")][: self.evidence_heads]
            evidence.update(
                n_heads=int(len(involved)),
                heads=[
                    {
                        "layer": state.names[k][0],
                        "head": state.names[k][1],
                        "value": latest[k],
                        "level": float(heads.level[k]),
                        "baseline": float(heads.mean[k]),
                        "baseline_std": float(math.sqrt(heads.var[k])),
                    }
                    for k in ordered.tolist()
                ],
                baseline={
                    "mean": float(heads.mean[involved].mean()),
                    "level": float(heads.level[involved].mean()),
                },
            )
        return {
            "detector": "attention_entropy",
            "kind": kind,
            "state": "firing",
            "modality": modality,
            "ts_ns": int(ts_ns),
            "evidence": evidence,
        }

    def _resolution(self, kind, state: _Modality, modality, ts_ns, alarm: _Alarm) -> dict:
        return {
            "detector": "attention_entropy",
            "kind": kind,
            "state": "resolved",
            "modality": modality,
            "ts_ns": int(ts_ns),
            "evidence": {
                "fired_ts_ns": alarm.fired_ts_ns,
                "observations": state.observations,
                "clear": self.clear,
            },
        }


def _check_range(name: str, value, low: float, high: float, low_open: bool = False) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not (is_number and (value > low if low_open else value >= low) and value <= high):
        bracket = "(" if low_open else "["
        raise ValueError(f"{name} must be a number in {bracket}{low}, {high}], got {value!r}")
