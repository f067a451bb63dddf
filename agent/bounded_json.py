"""JSON from outside input, parsed with its size and nesting bounded first:
json.loads recurses once per level, so a few kilobytes of brackets would
otherwise raise RecursionError instead of a clear error."""

import json
import re

import numpy as np

MAX_DEPTH = 32
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.frombuffer(b"[{", np.uint8)
_CLOSE = np.frombuffer(b"]}", np.uint8)


def nesting_depth(data: bytes) -> int:
    """The deepest bracket nesting of a JSON text, strings left out."""
    bare = np.frombuffer(_STRING.sub(b'""', data), np.uint8)
    step = np.isin(bare, _OPEN).astype(np.int64) - np.isin(bare, _CLOSE)
    return int(np.cumsum(step).max(initial=0))


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


def loads_bounded(data: bytes, max_bytes: int, max_depth: int = MAX_DEPTH):
    """Parse `data`; ValueError when it is larger than `max_bytes`, nested
    deeper than `max_depth`, not UTF-8, not JSON, or holds NaN/Infinity."""
    if len(data) > max_bytes:
        raise ValueError(f"{len(data)} bytes of JSON, expected at most {max_bytes}")
    depth = nesting_depth(data)
    if depth > max_depth:
        raise ValueError(f"JSON nested {depth} levels deep, expected at most {max_depth}")
    try:
        return json.loads(data, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ValueError("JSON text is not UTF-8") from None
    except RecursionError:      # a bound above this interpreter's stack
        raise ValueError("JSON nested too deeply") from None
