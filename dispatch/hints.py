"""Hints from the agent, held for their TTL, and what they change.

Every hint is the socket's JSON object: {"v": 1, "type": "hint", "id",
"kind", "target", "value", "ttl_s", "reason", "evidence", "issued_ns"}. A
hint lives `ttl_s` seconds (MIN_TTL_S..MAX_TTL_S, else it is refused)
from the moment it is applied; a newer hint of the same kind and target
replaces it. When every hint has expired the dispatcher is back on its
defaults, so an agent that dies leaves no trace. What each kind does,
always bounded and undone at expiry:

- modality_batch: target a modality, value an integer >= 1: that queue's
  batch cap. It can only lower the configured `batch_max` (a larger value
  means the configured one).
- priority: target a modality, value "urgent" | "high" | "normal" | "low":
  that queue's priority.
- route_affinity: target a modality, value a device name or a list of
  them: new sessions and session-less requests of that modality go only to
  those devices. Sessions already placed stay where their state is.
- prefer_device: device weights for placing new work. Either target "*"
  (or null) with value {device: weight, ...}, or target a device with
  value a number, that device's weight. Weights are finite numbers in
  0..MAX_WEIGHT; a device no hint names weighs 1; a hint that would leave
  every device at 0 is refused. (Should the expiry of one hint leave the
  others weighing every device 0, placement treats them all alike.) A device may also be named by its ordinal
  in the dispatcher's device list ("0", "1", ...), as the agent's
  `mmtrace_gpu_device_weight{gpu=...}` gauge does.
- degrade: target a modality or "*", value an integer level 0..MAX_DEGRADE.
  Level 1 and up: requests submitted with core=False for that modality are
  refused at once (their future fails with Shed) instead of queueing.
  Levels above 1 are reserved and act as 1.
- cpu_contention: target the thread series the agent saw waiting, value
  the p99 ratio (run-queue drift) or the runnable share over its
  threshold (starvation), a number or null. While one is active the telemetry
  sender flushes CONTENDED_FLUSH_FACTOR times less often, so the reporter
  takes less CPU from the threads that submit device work.
"""

import math
from dataclasses import dataclass, field

from mmtrace.dispatch.durations import check_duration
from mmtrace.dispatch.queue_config import check_batch_max, check_priority

HINT_KINDS = ("modality_batch", "priority", "route_affinity", "prefer_device",
              "degrade", "cpu_contention")
MIN_TTL_S = 0.001     # shorter is over before a dispatcher's loop could act on it
MAX_TTL_S = 3600.0
MAX_WEIGHT = 1e6
MAX_DEGRADE = 3
MAX_HINTS = 256
ALL = "*"


@dataclass
class Hint:
    id: str
    kind: str
    target: str
    value: object
    ttl_s: float
    reason: str
    evidence: object
    issued_ns: int | None
    applied_ns: int
    expires_ns: int

    def view(self, now_ns: int) -> dict:
        return {"id": self.id, "kind": self.kind, "target": self.target, "value": self.value,
                "ttl_s": self.ttl_s, "reason": self.reason, "evidence": self.evidence,
                "issued_ns": self.issued_ns, "applied_ns": self.applied_ns,
                "expires_ns": self.expires_ns,
                "expires_in_s": max(0.0, (self.expires_ns - now_ns) / 1e9)}


@dataclass
class Effects:
    """What the active hints change, against the defaults."""
    batch_cap: dict[str, int] = field(default_factory=dict)
    priority: dict[str, str] = field(default_factory=dict)
    routes: dict[str, list[str]] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    degrade: dict[str, int] = field(default_factory=dict)
    cpu_contention: bool = False

    def degraded(self, modality: str) -> bool:
        return self.degrade.get(modality, self.degrade.get(ALL, 0)) >= 1


def _number(value, where: str, low: float, high: float) -> float:
    # isfinite() of floats only: a 400-digit int would overflow the conversion
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            or (isinstance(value, float) and not math.isfinite(value))
            or not low <= value <= high):
        raise ValueError(f"{where}: expected a number in {low:g}..{high:g}, got {value!r}")
    return value


class HintBook:
    def __init__(self, devices: list[str], modalities: list[str]):
        self.devices = list(devices)
        self.modalities = list(modalities)
        self.active: dict[tuple[str, str], Hint] = {}
        self.applied = 0
        self.expired = 0
        self.effects = Effects()
        self.next_expiry_ns: int | None = None

    def apply(self, message: dict, now_ns: int) -> Hint:
        """Validate `message` and hold it; ValueError naming what is wrong."""
        if not isinstance(message, dict):
            raise ValueError(f"hint: expected a JSON object, got {type(message).__name__}")
        if message.get("v") != 1 or isinstance(message.get("v"), bool):
            raise ValueError(f"hint: expected \"v\": 1, got {message.get('v')!r}")
        if message.get("type") != "hint":
            raise ValueError(f"hint: expected \"type\": \"hint\", got {message.get('type')!r}")
        kind = message.get("kind")
        if kind not in HINT_KINDS:
            raise ValueError(f"hint: expected kind one of {list(HINT_KINDS)}, got {kind!r}")
        ttl = check_duration(message.get("ttl_s"), f"{kind} hint ttl_s", MIN_TTL_S, MAX_TTL_S)
        target, value = getattr(self, f"_check_{kind}")(message.get("target"), message.get("value"))
        issued = message.get("issued_ns")
        hint = Hint(id=str(message.get("id", "")), kind=kind, target=target, value=value,
                    ttl_s=ttl, reason=str(message.get("reason", "")),
                    evidence=message.get("evidence"),
                    issued_ns=issued if isinstance(issued, int) and not isinstance(issued, bool) else None,
                    applied_ns=now_ns, expires_ns=now_ns + int(ttl * 1e9))
        key = (kind, target)
        before = dict(self.active)
        if key not in self.active and len(self.active) >= MAX_HINTS:
            del self.active[min(self.active, key=lambda k: self.active[k].expires_ns)]
        self.active.pop(key, None)          # re-inserted last: newest applies last
        self.active[key] = hint
        self._recompute()
        if self.effects.weights and not any(self.effects.weights.values()):
            self.active = before            # a refused hint changes nothing
            self._recompute()
            raise ValueError("prefer_device hint: expected at least one device with a weight "
                             f"above 0 once applied, got {dict.fromkeys(self.devices, 0.0)}")
        self.applied += 1
        return hint

    def expire(self, now_ns: int) -> bool:
        """Drop the hints whose TTL has passed; True when any was dropped."""
        gone = [k for k, h in self.active.items() if h.expires_ns <= now_ns]
        for k in gone:
            del self.active[k]
        if gone:
            self.expired += len(gone)
            self._recompute()
        return bool(gone)

    def views(self, now_ns: int) -> list[dict]:
        return [h.view(now_ns) for h in self.active.values()]

    def _recompute(self):
        fx = Effects()
        weights = {}
        for h in self.active.values():
            if h.kind == "modality_batch":
                fx.batch_cap[h.target] = h.value
            elif h.kind == "priority":
                fx.priority[h.target] = h.value
            elif h.kind == "route_affinity":
                fx.routes[h.target] = h.value
            elif h.kind == "prefer_device":
                weights.update(h.value)
            elif h.kind == "degrade":
                fx.degrade[h.target] = h.value
            elif h.kind == "cpu_contention":
                fx.cpu_contention = True
        if weights:
            fx.weights = {d: weights.get(d, 1.0) for d in self.devices}
        self.effects = fx
        self.next_expiry_ns = min((h.expires_ns for h in self.active.values()), default=None)

    # ---- one check per kind: (target, value) normalised, or ValueError

    def _modality(self, kind: str, target, allow_all: bool = False) -> str:
        if target in self.modalities or (allow_all and target == ALL):
            return target
        expected = self.modalities + ([ALL] if allow_all else [])
        raise ValueError(f"{kind} hint: expected target one of {expected}, got {target!r}")

    def _device(self, kind: str, name) -> str:
        if name in self.devices:
            return name
        if isinstance(name, str) and name.isascii() and name.isdigit() \
                and int(name) < len(self.devices):
            return self.devices[int(name)]
        raise ValueError(f"{kind} hint: expected a device among {self.devices} "
                         f"or its ordinal, got {name!r}")

    def _check_modality_batch(self, target, value):
        return self._modality("modality_batch", target), check_batch_max(value, "modality_batch hint value")

    def _check_priority(self, target, value):
        return self._modality("priority", target), check_priority(value, "priority hint value")

    def _check_route_affinity(self, target, value):
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list) or not names:
            raise ValueError(f"route_affinity hint: expected a device name or a non-empty list, got {value!r}")
        devices = sorted({self._device("route_affinity", n) for n in names}, key=self.devices.index)
        return self._modality("route_affinity", target), devices

    def _check_prefer_device(self, target, value):
        if target in (None, ALL):
            if not isinstance(value, dict) or not value:
                raise ValueError(f"prefer_device hint: expected value {{device: weight}} for target "
                                 f"{target!r}, got {value!r}")
            return ALL, {self._device("prefer_device", d): float(_number(w, f"prefer_device weight of {d}",
                                                                          0, MAX_WEIGHT))
                         for d, w in value.items()}
        device = self._device("prefer_device", target)
        return device, {device: float(_number(value, f"prefer_device weight of {device}", 0, MAX_WEIGHT))}

    def _check_degrade(self, target, value):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_DEGRADE:
            raise ValueError(f"degrade hint value: expected an integer level 0..{MAX_DEGRADE}, got {value!r}")
        return self._modality("degrade", target, allow_all=True), value

    def _check_cpu_contention(self, target, value):
        if not isinstance(target, str) or not target or len(target) > 256:
            raise ValueError(f"cpu_contention hint: expected target a non-empty string "
                             f"(at most 256 characters), got {target!r}")
        if value is not None:
            value = _number(value, "cpu_contention hint value", 0, math.inf)
        return target, value

