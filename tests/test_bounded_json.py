"""JSON parsed with its size and nesting bounded before json.loads."""

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmtrace.agent.bounded_json import loads_bounded, nesting_depth

tricky_text = st.text(alphabet='[]{}"\\\\ab', max_size=8)
values = st.recursive(st.none() | st.integers() | tricky_text,
                      lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(tricky_text, inner, max_size=3), max_leaves=25)


def depth_of(value) -> int:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    return 0


@given(values, st.sampled_from([1, 2, 7, 1 << 18]))
def test_nesting_depth_is_the_containers_depth(value, block):
    assert nesting_depth(json.dumps(value).encode(), block) == depth_of(value)


@pytest.mark.parametrize("text, what", [
    (b"[" * 100_000 + b"]" * 100_000, "nested"),
    (b"[" * 100_000, "nested"),
    (b'{"a": NaN}', "NaN"),
    (b'{"a": -Infinity}', "Infinity"),
    (b"\xff\xfe{}", "Expecting|UTF-8"),
    (b"\x80\x81", "Expecting|UTF-8"),
    (b"[1," * 10, "Expecting"),
    (b" " * 2000, "2000 bytes"),
])
def test_bad_json_is_a_value_error(text, what):
    with pytest.raises(ValueError, match=what):
        loads_bounded(text, max_bytes=1 << 20 if what != "2000 bytes" else 1000)


def test_escaped_quotes_cost_linear_time():
    started = time.monotonic()
    assert nesting_depth(b'"' + b'\\"' * 2_000_000) == 0
    assert time.monotonic() - started < 5
