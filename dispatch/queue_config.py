"""Per-modality queue settings: batch size, maximum wait, priority.

The defaults are the design's: vision batches of up to 8 that wait at most
200 ms, at priority high; text-stream requests one at a time within 30 ms,
at priority urgent. `parse_queues` merges a user's overrides onto them and
rejects anything else with a message naming what was expected.
"""

from dataclasses import dataclass

from mmtrace.dispatch.durations import check_duration

# Lower rank is served first.
PRIORITIES = {"urgent": 0, "high": 1, "normal": 2, "low": 3}

DEFAULT_QUEUES = {
    "vision": {"batch_max": 8, "wait_ms": 200, "priority": "high"},
    "text": {"batch_max": 1, "wait_ms": 30, "priority": "urgent"},
}
# What a modality the defaults do not name starts from.
NEW_MODALITY = {"batch_max": 1, "wait_ms": 0, "priority": "high"}

MAX_BATCH = 4096
MIN_WAIT_MS = 0.001        # a microsecond; 0 means no wait
MAX_WAIT_MS = 60_000


@dataclass(frozen=True)
class QueueConfig:
    batch_max: int
    wait_ms: float
    priority: str

    @property
    def rank(self) -> int:
        return PRIORITIES[self.priority]

    @property
    def wait_ns(self) -> int:
        return int(self.wait_ms * 1e6)

    def as_dict(self) -> dict:
        return {"batch_max": self.batch_max, "wait_ms": self.wait_ms, "priority": self.priority}


def check_batch_max(value, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_BATCH:
        raise ValueError(f"{where}: expected batch_max as an integer in 1..{MAX_BATCH}, got {value!r}")
    return value


def check_priority(value, where: str) -> str:
    if not isinstance(value, str) or value not in PRIORITIES:
        raise ValueError(f"{where}: expected priority one of {list(PRIORITIES)}, got {value!r}")
    return value


def check_wait_ms(value, where: str) -> float:
    return check_duration(value, f"{where}: wait_ms", MIN_WAIT_MS, MAX_WAIT_MS, unit="ms", zero=True)


def parse_queues(overrides: dict | None) -> dict[str, QueueConfig]:
    """The defaults with `overrides` ({modality: {key: value}}) applied."""
    merged = {m: dict(c) for m, c in DEFAULT_QUEUES.items()}
    if overrides is not None:
        if not isinstance(overrides, dict):
            raise ValueError(f"queues: expected a dict of modality -> settings, got {type(overrides).__name__}")
        for modality, settings in overrides.items():
            if not isinstance(modality, str) or not modality:
                raise ValueError(f"queues: expected modality names as non-empty strings, got {modality!r}")
            if not isinstance(settings, dict):
                raise ValueError(f"queues[{modality!r}]: expected a dict, got {type(settings).__name__}")
            unknown = set(settings) - set(NEW_MODALITY)
            if unknown:
                raise ValueError(f"queues[{modality!r}]: expected keys among {sorted(NEW_MODALITY)}, "
                                 f"got {sorted(unknown)}")
            merged.setdefault(modality, dict(NEW_MODALITY)).update(settings)
    out = {}
    for modality, c in merged.items():
        where = f"queues[{modality!r}]"
        out[modality] = QueueConfig(check_batch_max(c["batch_max"], where),
                                    check_wait_ms(c["wait_ms"], where),
                                    check_priority(c["priority"], where))
    return out
