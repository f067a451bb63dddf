"""The input of the attention-entropy drift detector: samples checked and
grouped into observations.

Samples come from `attention_entropy.watch` in this process or, through the
hint socket, from other processes, so each one is checked, and the heads
and modalities a batch may add are bounded (memory stays bounded whatever
the senders do).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_TOLERANCE = 1e-6  # float noise around the ends of [0, 1] is accepted and clipped

# modality -> its observations, each (keys (layer, head), values)
Rounds = dict[str | None, list[tuple[list, list]]]


@dataclass
class Grouped:
    rounds: Rounds = field(default_factory=dict)
    latest_ts: int | None = None
    accepted: int = 0
    rejected: int = 0


def group_samples(samples: Iterable[dict] | dict, known: Mapping[str | None, Mapping],
                  max_heads: int, max_modalities: int) -> Grouped:
    """Group valid samples by modality, then into observations (a head's
    n-th sample in this batch belongs to the n-th observation). `known`:
    the heads (layer, head) already held per modality."""
    out = Grouped()
    limits = _Room(known, max_heads, max_modalities, out.rounds)
    if isinstance(samples, dict):
        samples = [samples]
    for sample in samples:
        parsed = parse_sample(sample)
        if parsed is None or not limits.admits(parsed[0], parsed[1]):
            out.rejected += 1
            continue
        modality, key, value, ts = parsed
        out.accepted += 1
        if ts is not None:
            out.latest_ts = ts if out.latest_ts is None else max(out.latest_ts, ts)
        occurrence = limits.seen.get((modality, key), 0)
        limits.seen[(modality, key)] = occurrence + 1
        per_modality = out.rounds.setdefault(modality, [])
        if occurrence == len(per_modality):
            per_modality.append(([], []))
        per_modality[occurrence][0].append(key)
        per_modality[occurrence][1].append(value)
    return out


class _Room:
    """Whether a batch may add one more head or modality."""

    def __init__(self, known, max_heads: int, max_modalities: int, rounds: Rounds) -> None:
        self.known = known
        self.max_heads = max_heads
        self.max_modalities = max_modalities
        self.rounds = rounds
        self.seen: dict[tuple, int] = {}  # (modality, key) -> samples so far in this batch
        self.new_heads: dict[str | None, int] = {}

    def admits(self, modality, key) -> bool:
        heads = self.known.get(modality)
        if heads is None and modality not in self.rounds and len(self.known) + sum(
            m not in self.known for m in self.rounds
        ) >= self.max_modalities:
            return False
        if (modality, key) in self.seen or (heads is not None and key in heads):
            return True
        held = 0 if heads is None else len(heads)
        if held + self.new_heads.get(modality, 0) >= self.max_heads:
            return False
        self.new_heads[modality] = self.new_heads.get(modality, 0) + 1
        return True


def parse_sample(sample):
    """(modality, (layer, head), value clipped to [0, 1], ts_ns or None),
    or None for a malformed sample or a value outside [0, 1]."""
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
