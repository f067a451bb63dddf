"""JSON from outside input, parsed with its size and nesting bounded first:
json.loads recurses once per level, so a few kilobytes of brackets would
otherwise raise RecursionError instead of a clear error."""

import json
import re

import numpy as np

MAX_DEPTH = 32


def nesting_depth(data: bytes, block: int = 1 << 18) -> int:
    """The deepest bracket nesting of a JSON text, brackets inside strings
    left out; linear in the text whatever it holds, a block at a time so
    that memory stays small. A quote starts or ends a string unless an odd
    run of backslashes comes right before it."""
    top = depth = run = 0
    inside = 0
    for lo in range(0, len(data), block):
        text = np.frombuffer(data, np.uint8, count=min(block, len(data) - lo), offset=lo)
        at = np.arange(len(text), dtype=np.int64)
        backslash = text == ord("\\")
        last_other = np.maximum.accumulate(np.where(backslash, -1, at))
        before = np.concatenate([[-1], last_other[:-1]])
        run_before = np.where(before >= 0, at - 1 - before, at + run)
        quote = (text == ord('"')) & (run_before % 2 == 0)
        parity = (np.cumsum(quote) + inside) % 2
        step = (((text == ord("[")) | (text == ord("{"))).astype(np.int64)
                - ((text == ord("]")) | (text == ord("}"))))
        levels = depth + np.cumsum(np.where(parity == 0, step, 0))
        top = max(top, int(levels.max()))
        depth, inside = int(levels[-1]), int(parity[-1])
        run = len(text) - 1 - int(last_other[-1]) if last_other[-1] >= 0 else len(text) + run
    return top


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


# An escaped UTF-16 surrogate: the only way JSON can carry a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _encodable(value):
    """`value` with every string's lone surrogates as U+FFFD (a pair
    escaped as two halves joined), so that any output can encode it."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    return value


def loads_bounded(data: bytes, max_bytes: int, max_depth: int = MAX_DEPTH):
    """Parse `data`; ValueError when it is larger than `max_bytes`, nested
    deeper than `max_depth`, not UTF-8, not JSON, or holds NaN/Infinity.
    Strings come back encodable: an escaped lone surrogate (a recording
    that holds a name a client sent) becomes U+FFFD."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes of JSON, expected at most {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep, expected at most {max_depth}")
    try:
        value = json.loads(data, parse_constant=_no_constant)
        return _encodable(value) if _SURROGATE_ESCAPE.search(data) else value
    except UnicodeDecodeError:
        raise ValueError("JSON text is not UTF-8") from None
    except RecursionError:      # a bound above this interpreter's stack
        raise ValueError("JSON nested too deeply") from None
