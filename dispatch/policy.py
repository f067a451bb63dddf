"""The hint policy: from what the agent sees (anomalies firing, who serves
which modality, CPU utilisation, device weights) to the hints it sends the
dispatchers. It lives beside the dispatcher whose hints it speaks (see
hints.py for what each kind does there) and imports nothing of the agent's.

Each thing a hint can turn is a lever with a default and a few levels:
- `modality_batch` on vision: 8 -> 4 -> 2 while the text stream's P99
  drifts with vision work in flight, or the threads serving vision wait on
  the run queue;
- `priority` on vision: "high" -> "low" while threads serving text wait on
  the run queue (vision yields to text);
  (waiting on the run queue: their run-queue P99 drifts, or the starvation
  detector finds them runnable too much of their time; not when the
  anomaly's verdict names another bound, bus_bound say: there more CPU
  would not help, and the hints would take work from the wrong place);
- `degrade` per modality: 0 -> 1 (shed non-core work) while that
  modality's end-to-end P99 drifts with CPU utilisation under 45 % (the
  bottleneck is not the CPU, so more CPU work would not help), or its
  attention entropy drifts;
- `cpu_contention` per process whose device threads wait on the run queue
  (as above);
- `prefer_device`: the device weights, when they move.

A lever steps away from its default fast (the first step when the alarm
fires, each further one after escalate_dwell_s of steady pressure) and
back slowly (relax_dwell_s without pressure per step); no lever changes twice within cooldown_s; at most
max_hints_per_window hints leave in any window_s; every hint carries a
TTL and is sent again at half of it while it holds, so a dispatcher whose
agent died is back on its defaults within one TTL. Every decision, sent,
held back by the cap or dry-run, is in the audit log with its reason and
evidence.
"""

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from mmtrace.dispatch.durations import MIN_DURATION_S, check_duration
from mmtrace.dispatch.hints import MAX_TTL_S, MIN_TTL_S

VISION, TEXT = "vision", "text"
BATCH_STEPS = (8, 4, 2)
PRIORITY_STEPS = ("high", "low")
DEGRADE_STEPS = (0, 1)
# An anomaly's `key` says what its series is about (agent/ingest/series_keys.py);
# its `series` is a name for people, never parsed.
RUNQ, REQUEST = "runq_delay", "request_latency"
RUNQ_SHARE = "runq_share"           # the starvation detector's (detectors/starvation.py)
CPU_STARVED = "cpu_starved"         # the verdict that says more CPU would help
MAX_AUDIT = 1024


DAY_S = 86400.0
# Each duration setting's range: (low, high, whether 0 is allowed: "none").
DURATIONS = {
    "ttl_s": (MIN_TTL_S, MAX_TTL_S, False),
    "escalate_dwell_s": (MIN_DURATION_S, 3600.0, True),
    "relax_dwell_s": (MIN_DURATION_S, DAY_S, True),
    "cooldown_s": (MIN_DURATION_S, 3600.0, True),
    "window_s": (MIN_DURATION_S, DAY_S, False),
}


@dataclass
class PolicySettings:
    """ValueError at construction for a duration outside DURATIONS."""
    ttl_s: float = 30.0
    escalate_dwell_s: float = 2.0
    relax_dwell_s: float = 20.0
    cooldown_s: float = 3.0
    max_hints_per_window: int = 30
    window_s: float = 60.0
    degrade_cpu_below: float = 0.45
    weight_change: float = 0.1        # send weights again when one moves by more
    dry_run: bool = False

    def __post_init__(self):
        for name, (low, high, zero) in DURATIONS.items():
            check_duration(getattr(self, name), f"policy {name}", low, high, zero=zero)


@dataclass
class Observations:
    """What the agent knows at one moment."""
    now_ns: int
    firing: list = field(default_factory=list)       # anomaly records whose latest state is firing
    served: dict = field(default_factory=dict)       # pid -> set of modalities it reported
    active_modalities: set = field(default_factory=set)   # modalities with requests just now
    cpu_utilisation: float | None = None             # 0..1, host-wide
    device_weights: dict | None = None               # device (ordinal string) -> weight


@dataclass
class Lever:
    kind: str
    target: str
    steps: tuple
    level: int = 0                 # index into steps; 0 is the default
    changed_ns: int = -(1 << 62)
    pressure_since_ns: int | None = None
    calm_since_ns: int | None = None
    sent_ns: int | None = None
    why: tuple = ("", {})

    @property
    def value(self):
        return self.steps[self.level]


class HintPolicy:
    def __init__(self, settings: PolicySettings | None = None, *, hint_id=None):
        self.settings = settings or PolicySettings()
        self.levers: dict[tuple[str, str], Lever] = {}
        self.contention: dict[int, dict] = {}        # pid -> latest cpu_contention sent
        self.weights_sent: dict | None = None
        self.weights_sent_ns: int | None = None
        self.audit: deque[dict] = deque(maxlen=MAX_AUDIT)
        self.counts: Counter = Counter()              # (kind, outcome) -> n
        self._sent_times: deque[int] = deque()
        self._seq = 0
        self._hint_id = hint_id or (lambda seq: f"policy-{seq}")

    # ------------------------------------------------------------ decide

    def decide(self, obs: Observations) -> list[dict]:
        """The hints to send now (none in dry-run; see the audit log)."""
        wanted = self._pressures(obs)
        out = []
        for key, (pressed, reason, evidence) in wanted.items():
            lever = self.levers.get(key)
            if lever is None:
                lever = self.levers[key] = Lever(key[0], key[1], _steps(key[0]))
            out += self._move(lever, pressed, reason, evidence, obs.now_ns)
        for lever in self.levers.values():
            if (lever.kind, lever.target) not in wanted:
                out += self._move(lever, False, "", {}, obs.now_ns)
        out += self._contention(obs)
        out += self._weights(obs)
        return out

    def _pressures(self, obs: Observations) -> dict:
        """(kind, target) -> (pressed, reason, evidence) for every lever
        something pushes on now."""
        s = self.settings
        wanted: dict = {}

        def press(kind, target, reason, evidence):
            # The first reason holds, unless a client's word came first and
            # the kernel's evidence presses too: then the hint is everyone's.
            held = wanted.get((kind, target))
            if held is None or (client_scoped(held[2]) and not client_scoped(evidence)):
                wanted[(kind, target)] = (True, reason, evidence)

        for anomaly in obs.firing:
            series = anomaly.get("series") or ""
            evidence = anomaly.get("evidence") or {}
            key = _key(anomaly)
            pid = _cpu_pid(anomaly)
            if pid is not None:
                served = obs.served.get(pid, set())
                if VISION in served:
                    press("modality_batch", VISION, f"{_waits(anomaly, pid, VISION)}: "
                          "smaller vision batches", evidence)
                if TEXT in served:
                    press("priority", VISION, f"{_waits(anomaly, pid, TEXT)}: "
                          "vision yields to text", evidence)
            elif key.get("kind") == REQUEST and isinstance(key.get("modality"), str):
                # the series rides in the evidence: the agent sends what a
                # client's own samples raised only to that client
                evidence = {**evidence, "series": series, "key": key}
                modality = key["modality"]
                if modality == TEXT and VISION in obs.active_modalities:
                    press("modality_batch", VISION, "text-stream P99 drifted up while vision "
                          "work is in flight: smaller vision batches", evidence)
                cpu = obs.cpu_utilisation
                if cpu is not None and cpu < s.degrade_cpu_below:
                    press("degrade", modality, f"{modality} end-to-end P99 drifted up with CPU "
                          f"at {cpu:.0%} (under {s.degrade_cpu_below:.0%}): the bottleneck is "
                          "not the CPU; shed non-core work", {**evidence, "cpu_utilisation": cpu})
            elif anomaly.get("detector") == "attention_entropy" and anomaly.get("modality"):
                modality = str(anomaly["modality"])
                press("degrade", modality, f"attention entropy of {modality} drifted "
                      f"({anomaly.get('kind')}): inputs changed; shed non-core work",
                      {**evidence, "entropy_modality": modality})
        return wanted

    # ------------------------------------------------------------- levers

    def _move(self, lever: Lever, pressed: bool, reason: str, evidence: dict, now: int) -> list:
        s = self.settings
        if pressed:
            if client_scoped(lever.why[1]) and not client_scoped(evidence):
                lever.why = (reason, evidence)      # refreshes go to everyone from now on
            lever.calm_since_ns = None
            if lever.pressure_since_ns is None:
                lever.pressure_since_ns = now
            # The first step is at once (the detector already waited for
            # its windows); each further one after escalate_dwell_s more.
            held = now - max(lever.pressure_since_ns, lever.changed_ns)
            if lever.level + 1 < len(lever.steps) and \
                    (lever.level == 0 or held >= _ns(s.escalate_dwell_s)) and \
                    now - lever.changed_ns >= _ns(s.cooldown_s):
                return self._step(lever, +1, reason, evidence, now)
        else:
            lever.pressure_since_ns = None
            if lever.calm_since_ns is None:
                lever.calm_since_ns = now
            calm = now - max(lever.calm_since_ns, lever.changed_ns)
            if lever.level > 0 and calm >= _ns(s.relax_dwell_s):
                # with the evidence it moved on: a step back goes where the steps went
                return self._step(lever, -1, f"{lever.kind} {lever.target}: calm for "
                                  f"{s.relax_dwell_s:g} s, one step back", lever.why[1], now)
        if lever.level > 0 and lever.sent_ns is not None and \
                now - lever.sent_ns >= _ns(s.ttl_s / 2):
            return self._emit(lever.kind, lever.target, lever.value, *lever.why, now,
                              outcome="refresh", on_sent=lambda: setattr(lever, "sent_ns", now))
        return []

    def _step(self, lever: Lever, direction: int, reason: str, evidence: dict, now: int) -> list:
        level = lever.level + direction

        def moved():
            lever.level, lever.changed_ns, lever.sent_ns = level, now, now
            if direction > 0:
                lever.why = (reason, evidence)
        return self._emit(lever.kind, lever.target, lever.steps[level], reason, evidence, now,
                          outcome="escalate" if direction > 0 else "relax", on_sent=moved)

    def _contention(self, obs: Observations) -> list:
        out = []
        now = obs.now_ns
        for anomaly in obs.firing:
            pid = _cpu_pid(anomaly)
            if pid is None:
                continue
            last = self.contention.get(pid)
            if last is not None and now - last["sent_ns"] < _ns(self.settings.ttl_s / 2):
                continue
            ev = _evidence(anomaly)
            if _key(anomaly).get("kind") == RUNQ_SHARE:
                # the runnable share over the detector's threshold
                ratio = _ratio(ev.get("share"), ev.get("threshold"))
                reason = "the submitting threads wait on the run queue too much of their time"
            else:
                ratio = _ratio(ev.get("p99"), ev.get("baseline"))
                reason = "run-queue delay p99 of the submitting threads drifted up"
            out += self._emit("cpu_contention", f"pid={pid}", ratio, reason, ev, now,
                              outcome="escalate" if last is None else "refresh",
                              on_sent=lambda pid=pid: self.contention.__setitem__(
                                  pid, {"sent_ns": now}))
        firing = {pid for a in obs.firing if (pid := _cpu_pid(a)) is not None}
        for pid in [p for p in self.contention if p not in firing]:
            del self.contention[pid]          # its hint runs out by its TTL
        return out

    def _weights(self, obs: Observations) -> list:
        weights = obs.device_weights
        if not weights:
            return []
        last, now = self.weights_sent, obs.now_ns
        moved = last is None or set(last) != set(weights) or any(
            abs(weights[d] - last[d]) > self.settings.weight_change for d in weights)
        stale = self.weights_sent_ns is not None and \
            now - self.weights_sent_ns >= _ns(self.settings.ttl_s / 2)
        if not (moved or stale):
            return []

        def sent():
            self.weights_sent, self.weights_sent_ns = dict(weights), now
        return self._emit("prefer_device", "*", {str(d): float(w) for d, w in weights.items()},
                          "device weights from (1 - SM util) x (1 - memory-bandwidth util) "
                          "x topology", {"weights": dict(weights)}, now,
                          outcome="escalate" if moved else "refresh", on_sent=sent)

    # --------------------------------------------------------------- send

    def _emit(self, kind, target, value, reason, evidence, now, *, outcome, on_sent) -> list:
        s = self.settings
        while self._sent_times and now - self._sent_times[0] >= _ns(s.window_s):
            self._sent_times.popleft()
        entry = {"ts_ns": now, "kind": kind, "target": target, "value": value,
                 "reason": reason, "evidence": evidence, "step": outcome}
        if len(self._sent_times) >= s.max_hints_per_window:
            entry["outcome"] = "capped"
            self._log(entry)
            return []
        self._sent_times.append(now)
        on_sent()
        self._seq += 1
        hint = {"v": 1, "type": "hint", "id": self._hint_id(self._seq), "kind": kind,
                "target": target, "value": value, "ttl_s": s.ttl_s, "reason": reason,
                "evidence": evidence, "issued_ns": now}
        entry["id"] = hint["id"]
        entry["outcome"] = "dry_run" if s.dry_run else "sent"
        self._log(entry)
        return [] if s.dry_run else [hint]

    def _log(self, entry: dict):
        self.audit.append(entry)
        self.counts[(entry["kind"], entry["outcome"])] += 1


def client_scoped(evidence) -> bool:
    """Whether a hint rests on a client's own word (its request latencies or
    its entropy samples): the agent sends such a hint to that client only."""
    return isinstance(evidence, dict) and (
        _key(evidence).get("kind") == REQUEST or "entropy_modality" in evidence)


def _key(record: dict) -> dict:
    key = record.get("key")
    return key if isinstance(key, dict) else {}


def _evidence(record: dict) -> dict:
    evidence = record.get("evidence")
    return evidence if isinstance(evidence, dict) else {}


def _cpu_kind(key: dict) -> bool:
    """An alarm about a process's launching threads waiting for a CPU: its
    run-queue P99 drifted, or the starvation detector found them runnable
    too much of their time."""
    pid = key.get("pid")
    return key.get("kind") in (RUNQ, RUNQ_SHARE) and isinstance(pid, int) \
        and not isinstance(pid, bool)


def _cpu_pid(anomaly: dict) -> int | None:
    """The process a CPU alarm is about, unless the daemon's diagnosis of
    that process (in its evidence) finds no CPU starvation among the causes:
    a launcher that waits for its copies (bus_bound) or its device gets
    nothing from CPU hints, while one that is both device-bound and starved
    does. Without a verdict (none could be made), the alarm speaks for itself."""
    key = _key(anomaly)
    if not _cpu_kind(key):
        return None
    evidence = _evidence(anomaly)
    verdict = evidence.get("verdict")
    causes = evidence.get("causes")
    starved = verdict == CPU_STARVED or isinstance(causes, list) and CPU_STARVED in causes
    return key["pid"] if verdict is None or starved else None


def _waits(anomaly: dict, pid: int, modality: str) -> str:
    """What a CPU alarm says of a process serving `modality`, for a reason."""
    if _key(anomaly).get("kind") == RUNQ_SHARE:
        share = _evidence(anomaly).get("share")
        spent = f" {share:.0%} of their time" if _number(share) else ""
        return (f"the launching threads of pid {pid}, which serves {modality}, "
                f"waited for a CPU{spent}")
    return f"run-queue delay of pid {pid}, which serves {modality}, drifted up"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _ratio(value, reference) -> float | None:
    if _number(value) and _number(reference) and reference > 0:
        return value / reference
    return None


def _steps(kind: str) -> tuple:
    return {"modality_batch": BATCH_STEPS, "priority": PRIORITY_STEPS,
            "degrade": DEGRADE_STEPS}[kind]


def _ns(seconds: float) -> int:
    return int(seconds * 1e9) if math.isfinite(seconds) else 1 << 62
