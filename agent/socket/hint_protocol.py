"""The hint socket's client messages: bounded parsing and the schema.

One place holds the contract of the interface spec's "Hint socket" section
as the agent enforces it, so that a client can follow it line by line:

- a line is at most MAX_MESSAGE bytes of UTF-8 JSON, nested at most
  MAX_DEPTH deep (checked by a linear scan before the JSON parser runs, so
  no input can make the parser recurse); NaN and Infinity are not JSON;
- every message is an object with `"v": 1` (the integer) and a `"type"`;
- `hello`: optional `client` (name), optional `pid` (int 1..PID_MAX);
- `sample`: `series`, `modality` (names), `value_ms` (a finite number in
  0..MAX_VALUE_MS; a bool is not a number), optional `ts_ns`;
- `entropy`: `modality` and either `layer`, `head`, `value` or `values`, a
  list of 1..MAX_VALUES objects with `layer`, `head`, `value` and an
  optional `modality` of their own; optional `ts_ns`;
- `subscribe`, `status`, `dump`: nothing more (`dump` writes the flight
  recorder's ring now and is answered with the file's path);
- `explain`: `pids`, a list of 1..MAX_EXPLAIN_PIDS pids; optional
  `window`, [start_ns, end_ns] with end after start and at most
  MAX_EXPLAIN_NS apart, or `last_s`, a number in 1..3600 (the seconds
  before now); answered with the diagnosis (`mmtrace explain --pid`);
- `series`: `name`, a latency series' name (`runq_delay{pid=1234}`), and
  optional `window_s`, a number in 1..MAX_SERIES_S (default 10); answered
  with its percentiles over the last window_s seconds (`mmtrace mcp`).
Names are non-empty strings of at most MAX_NAME printable characters (no
control or format character, no lone surrogate: every output can encode
them); `head` is an int in 0..MAX_HEAD; entropy values are finite
numbers in 0..1 (within VALUE_NOISE, then clipped); `ts_ns` is an int in
0..2**63-1 (CLOCK_MONOTONIC). Keys not named here are ignored, so that
clients may send more than this version reads.

parse_line() returns a new, normalised dict (a single entropy sample comes
back as a one-item `values`) holding only checked values, or raises
ProtocolError naming what was expected and what arrived.

Standard library only: the dispatcher may copy these rules without
importing the agent.
"""

import json
import math
import re
from itertools import accumulate

MAX_MESSAGE = 64 * 1024
MAX_DEPTH = 8               # a batch of entropy samples needs 3
MAX_NAME = 256
MAX_VALUES = 2048           # entropy samples in one message: more than 64 KiB can hold
MAX_HEAD = 65535
MAX_VALUE_MS = 3_600_000.0  # one hour: the P99 detector's largest value
PID_MAX = 4_194_304         # the kernel's PID_MAX_LIMIT
TS_LIMIT = 2 ** 63
VALUE_NOISE = 1e-6          # an entropy this far outside 0..1 is float noise
CLIENT_TYPES = ("hello", "sample", "entropy", "subscribe", "status", "dump", "explain",
                "series")
MAX_EXPLAIN_PIDS = 16
MAX_EXPLAIN_NS = 3600 * 10**9
MAX_SERIES_S = 3600.0


class ProtocolError(ValueError):
    """A line that is not a valid client message; the text says why."""


# A JSON string, or an unterminated one running to the end: removed before
# the brackets are counted. Unrolled, so it never backtracks.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")   # +1 / -1 as signed bytes


def nesting_depth(line: bytes) -> int:
    """The deepest bracket nesting outside strings, in linear time and
    without recursion (an upper bound where the JSON is malformed)."""
    steps = _STRING.sub(b"", line).translate(_BRACKET_STEP, _NOT_BRACKET)
    return max(accumulate(memoryview(steps).cast("b")), default=0)


def _no_constant(name):
    raise ProtocolError(f"expected a finite number, got {name}")


def _finite_float(text):
    value = float(text)
    if not math.isfinite(value):
        raise ProtocolError(f"expected a finite number, got {text}")
    return value


# One decoder for every line: json.loads with these hooks builds a new one
# for each call.
_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)


def decode(line: bytes):
    """The JSON value of one line, within the size and depth bounds."""
    if len(line) > MAX_MESSAGE:
        raise ProtocolError(f"expected a message of at most {MAX_MESSAGE} bytes, "
                            f"got {len(line)}")
    # No more opening brackets than the bound: no deeper either (most
    # messages, which need no scan of their brackets).
    opened = line.count(b"{") + line.count(b"[")
    depth = nesting_depth(line) if opened > MAX_DEPTH else opened
    if depth > MAX_DEPTH:
        raise ProtocolError(f"expected JSON nested at most {MAX_DEPTH} deep, got {depth}")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"expected UTF-8, got byte {line[exc.start]:#04x} "
                            f"at offset {exc.start}") from None
    try:
        return _JSON.decode(text)
    except ProtocolError:
        raise
    except ValueError as exc:       # JSONDecodeError, or an integer of too many digits
        raise ProtocolError(f"not JSON: {exc}") from None


def parse_line(line: bytes) -> dict:
    """One checked, normalised client message from one line (no newline)."""
    return validate(decode(line))


def validate(msg) -> dict:
    """The normalised message if `msg` follows the schema, else ProtocolError."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"expected a JSON object, got {_kind(msg)}")
    version = msg.get("v")
    if type(version) is not int or version != 1:
        raise ProtocolError(f'expected "v": 1, got {_show(version)}')
    kind = msg.get("type")
    if kind not in CLIENT_TYPES:
        raise ProtocolError(f"expected type one of {', '.join(CLIENT_TYPES)}, "
                            f"got {_show(kind)}")
    out = {"v": 1, "type": kind}
    if kind == "hello":
        if "client" in msg:
            out["client"] = _name(msg, "client", kind)
        if "pid" in msg:
            out["pid"] = _int(msg, "pid", kind, 1, PID_MAX)
    elif kind == "sample":
        out["series"] = _name(msg, "series", kind)
        out["modality"] = _name(msg, "modality", kind)
        out["value_ms"] = _number(msg, "value_ms", kind, 0.0, MAX_VALUE_MS)
        if "ts_ns" in msg:
            out["ts_ns"] = _int(msg, "ts_ns", kind, 0, TS_LIMIT - 1)
    elif kind == "entropy":
        modality = out["modality"] = _name(msg, "modality", kind)
        if "values" in msg:
            if "value" in msg:
                raise ProtocolError("entropy: expected either value or values, got both")
            out["values"] = _entropy_values(msg["values"], modality)
        else:
            out["values"] = [_entropy_sample(msg, modality, "entropy")]
        if "ts_ns" in msg:
            out["ts_ns"] = _int(msg, "ts_ns", kind, 0, TS_LIMIT - 1)
    elif kind == "explain":
        pids = msg.get("pids")
        if not isinstance(pids, list) or not 1 <= len(pids) <= MAX_EXPLAIN_PIDS:
            raise ProtocolError(f"explain: expected pids as a list of 1..{MAX_EXPLAIN_PIDS} "
                                f"pids, got {_show(pids)}")
        out["pids"] = [_int({"pid": p}, "pid", "explain pids", 1, PID_MAX) for p in pids]
        if "window" in msg:
            window = msg["window"]
            if not isinstance(window, list) or len(window) != 2:
                raise ProtocolError(f"explain: expected window as [start_ns, end_ns], got "
                                    f"{_show(window)}")
            start = _int({"start": window[0]}, "start", "explain window", 0, TS_LIMIT - 1)
            end = _int({"end": window[1]}, "end", "explain window", start + 1,
                       min(TS_LIMIT - 1, start + MAX_EXPLAIN_NS))
            out["window"] = [start, end]
        if "last_s" in msg:
            out["last_s"] = _number(msg, "last_s", kind, 1.0, 3600.0)
    elif kind == "series":
        out["name"] = _name(msg, "name", kind)
        out["window_s"] = _number(msg, "window_s", kind, 1.0, MAX_SERIES_S) \
            if "window_s" in msg else 10.0
    return out


def _entropy_values(values, modality: str) -> list[dict]:
    if not isinstance(values, list) or not 1 <= len(values) <= MAX_VALUES:
        got = f"{len(values)} items" if isinstance(values, list) else _kind(values)
        raise ProtocolError(f"entropy: expected values as a list of 1..{MAX_VALUES} "
                            f"samples, got {got}")
    out = []
    for i, sample in enumerate(values):
        where = f"entropy values[{i}]"
        if not isinstance(sample, dict):
            raise ProtocolError(f"{where}: expected an object, got {_kind(sample)}")
        own = _name(sample, "modality", where) if "modality" in sample else modality
        out.append(_entropy_sample(sample, own, where))
    return out


def _entropy_sample(sample: dict, modality: str, where: str) -> dict:
    return {"layer": _name(sample, "layer", where),
            "head": _int(sample, "head", where, 0, MAX_HEAD),
            "value": _entropy_value(sample, where),
            "modality": modality}


def _entropy_value(sample: dict, where: str) -> float:
    """In 0..1; float noise at the ends is taken, as the detector takes it, and clipped."""
    value = sample.get("value")
    if type(value) not in (int, float) or not -VALUE_NOISE <= value <= 1.0 + VALUE_NOISE:
        raise ProtocolError(f"{where}: expected value as a number in 0..1, got {_show(value)}")
    return min(max(float(value), 0.0), 1.0)


def _name(msg: dict, key: str, where: str) -> str:
    # isprintable(): no control, format (bidi overrides), surrogate (a lone
    # "\ud800" cannot be encoded, and broke every scrape), private-use or
    # unassigned code point, nor a separator but the space
    value = msg.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_NAME \
            or not value.isprintable():
        raise ProtocolError(f"{where}: expected {key} as a string of 1..{MAX_NAME} printable "
                            f"characters, without control characters or lone surrogates, "
                            f"got {_show(value)}")
    return value


def _int(msg: dict, key: str, where: str, low: int, high: int) -> int:
    value = msg.get(key)
    if type(value) is not int or not low <= value <= high:
        raise ProtocolError(f"{where}: expected {key} as an integer in {low}..{high}, "
                            f"got {_show(value)}")
    return value


def _number(msg: dict, key: str, where: str, low: float, high: float) -> float:
    value = msg.get(key)
    # JSON has no NaN or Infinity (decode refuses them); a dict built in
    # Python may, and NaN fails every comparison.
    if type(value) not in (int, float) or not low <= value <= high:
        raise ProtocolError(f"{where}: expected {key} as a number in {low:g}..{high:g}, "
                            f"got {_show(value)}")
    return float(value)


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a bool",
            type(None): "null", int: "an integer", float: "a number"}.get(type(value),
                                                                         type(value).__name__)


def _show(value) -> str:
    """A value for an error message, never longer than a short line."""
    if value is None:
        return "nothing (missing or null)"
    if isinstance(value, (dict, list)):
        return _kind(value)
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
