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

import numpy as np

from mmtrace.detectors.entropy_samples import group_samples
from mmtrace.detectors.entropy_state import Alarm, ModalityState

__all__ = ["EntropyDriftDetector"]

KINDS = ("entropy_rise", "entropy_collapse", "entropy_spread")  # public: what exporters label
_HOLD = 0.5  # a firing alarm holds while the deviation exceeds this share of its threshold


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
        self._modalities: dict[str | None, ModalityState] = {}
        self.accepted = 0
        self.rejected = 0
        self.fired = 0

    # -- public --------------------------------------------------------------

    def update(self, samples: Iterable[dict], ts_ns: int | None = None) -> list[dict]:
        """Feed one batch of samples; returns the anomaly records (firing and
        resolved) it produced. ts_ns stamps them; by default the latest
        `ts_ns` among the samples, else the clock (CLOCK_MONOTONIC)."""
        grouped = group_samples(samples, {m: state.slots for m, state in self._modalities.items()},
                                self.max_heads, self.max_modalities)
        self.accepted += grouped.accepted
        self.rejected += grouped.rejected
        latest_ts = grouped.latest_ts
        when = ts_ns if ts_ns is not None else (latest_ts if latest_ts is not None else self._clock())
        records = []
        for modality, observations in grouped.rounds.items():
            state = self._modalities.get(modality)
            if state is None:
                state = self._modalities[modality] = ModalityState(KINDS)
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
        return state.baseline()

    # -- the rule --------------------------------------------------------------

    def _observe(self, state: ModalityState, modality, keys, values, ts_ns) -> list[dict]:
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

    def _judge_spread(self, state: ModalityState, spread_now: float) -> bool:
        s = state.spread
        slot = np.zeros(1, dtype=np.int64)
        level = s.smooth(slot, np.array([spread_now]), self.smoothing)[0]
        high = bool(s.count[0] >= self.warmup and level - s.mean[0] > self.delta_sigma)
        s.up_run[0] = s.up_run[0] + 1 if high else 0
        return high

    def _anomaly(self, kind, state: ModalityState, modality, ts_ns, involved, values, idx) -> dict:
        evidence = {
            "observations": state.observations,
            "consecutive": self.consecutive,
            "tau": self.tau,
        }
        if kind == "entropy_spread":
            evidence.update(state.spread_evidence(values, self.delta_sigma))
        else:
            evidence.update(state.head_evidence(involved, values, idx, self.evidence_heads))
        return {
            "detector": "attention_entropy",
            "kind": kind,
            "state": "firing",
            "modality": modality,
            "ts_ns": int(ts_ns),
            "evidence": evidence,
        }

    def _resolution(self, kind, state: ModalityState, modality, ts_ns, alarm: Alarm) -> dict:
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
