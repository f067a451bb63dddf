"""The messages a dispatcher sends the agent, built to the socket schema:
"v": 1 as an integer, newline-delimited compact JSON of at most 64 KiB,
`value_ms` finite and non-negative, `ts_ns` an integer CLOCK_MONOTONIC time,
entropy values finite numbers in 0..1. Builders raise ValueError rather
than send something the agent would refuse."""

import json
import math

# The agent's limits (agent/socket/hint_protocol.py; a test keeps the two equal:
# the dispatcher imports nothing of the agent's).
MAX_MESSAGE = 64 * 1024
MAX_NAME = 256
MAX_VALUES = 2048
MAX_HEAD = 65535
MAX_VALUE_MS = 3_600_000.0
UNNAMED_MODALITY = "unknown"


def is_name(text) -> bool:
    """A series, modality or layer name the agent takes: printable (no
    control or format character, no lone surrogate)."""
    return isinstance(text, str) and 1 <= len(text) <= MAX_NAME and text.isprintable()


def encode(message: dict) -> bytes:
    line = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_MESSAGE:
        raise ValueError(f"{message.get('type')} message: expected at most {MAX_MESSAGE} bytes, got {len(line)}")
    return line


def hello(client: str, pid: int) -> dict:
    return {"v": 1, "type": "hello", "client": str(client), "pid": int(pid)}


def subscribe() -> dict:
    return {"v": 1, "type": "subscribe"}


def sample(series: str, modality: str, value_ms: float, ts_ns: int) -> dict:
    value_ms = float(value_ms)
    if not math.isfinite(value_ms) or value_ms < 0:
        raise ValueError(f"sample value_ms: expected a finite number >= 0, got {value_ms!r}")
    value_ms = min(value_ms, MAX_VALUE_MS)       # longer than the detector's largest value
    if not is_name(series) or not is_name(modality):
        raise ValueError(f"sample: expected series and modality of 1..{MAX_NAME} printable "
                         f"characters, got {series!r}, {modality!r}")
    return {"v": 1, "type": "sample", "series": str(series), "modality": str(modality),
            "value_ms": value_ms, "ts_ns": int(ts_ns)}


def entropy_value(s) -> dict | None:
    """One watch() sample as the socket carries it, or None when unusable."""
    if not isinstance(s, dict):
        return None
    layer, head, value = s.get("layer"), s.get("head"), s.get("value")
    if not is_name(layer) or type(head) is not int or not 0 <= head <= MAX_HEAD:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    value = float(value)
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        return None
    return {"layer": layer, "head": head, "value": value}


def entropy(samples: list, budget: int = MAX_MESSAGE - 512) -> tuple[list[dict], int]:
    """watch() samples as `entropy` messages, one modality each and each
    under the size limit; also how many samples were unusable."""
    by_modality: dict[str, list[dict]] = {}
    unusable = 0
    for s in samples:
        v = entropy_value(s)
        if v is None:
            unusable += 1
            continue
        modality = s.get("modality")
        modality = modality if is_name(modality) else UNNAMED_MODALITY
        by_modality.setdefault(modality, []).append(v)
    out = []
    for modality, values in by_modality.items():
        chunk, size = [], 0
        for v in values:
            n = len(json.dumps(v, separators=(",", ":"))) + 1
            if n > budget:
                unusable += 1           # a layer name longer than a message
                continue
            if chunk and (size + n > budget or len(chunk) == MAX_VALUES):
                out.append({"v": 1, "type": "entropy", "modality": modality, "values": chunk})
                chunk, size = [], 0
            chunk.append(v)
            size += n
        if chunk:
            out.append({"v": 1, "type": "entropy", "modality": modality, "values": chunk})
    return out, unusable
