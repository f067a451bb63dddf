"""Properties of the hint socket's parser and schema (hint_protocol): the
depth scan agrees with the JSON structure, any bytes end in a message or a
ProtocolError, what is accepted is exactly what the schema allows."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrace.agent.socket.hint_protocol import (MAX_DEPTH, MAX_HEAD, MAX_MESSAGE, MAX_NAME,
                                         MAX_VALUE_MS, MAX_VALUES, PID_MAX, ProtocolError,
                                         nesting_depth, parse_line, validate)

# Strings full of what could fool a scan: brackets, quotes, backslashes.
tricky_text = st.text(alphabet=st.sampled_from('ab[]{}"\\,:\n é\u2028'), max_size=12)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), tricky_text,
                         st.floats(allow_nan=False, allow_infinity=False))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(tricky_text, inner, max_size=4)),
    max_leaves=40)


def depth_of(value) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, value.values()), default=0)
    return 0


@settings(max_examples=500)
@given(value=json_values, ascii_only=st.booleans())
def test_the_depth_scan_agrees_with_the_json_structure(value, ascii_only):
    line = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert nesting_depth(line) == depth_of(value)


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 2000, MAX_MESSAGE // 2])
def test_deep_nesting_is_refused_before_parsing(depth):
    with pytest.raises(ProtocolError) as caught:
        parse_line(b"[" * depth + b"]" * depth)
    if depth > MAX_DEPTH:
        assert str(caught.value) == f"expected JSON nested at most {MAX_DEPTH} deep, got {depth}"
    else:
        assert str(caught.value) == "expected a JSON object, got a list"


def assert_accepted_is_a_fixed_point(msg):
    assert validate(msg) == msg
    assert parse_line(json.dumps(msg).encode()) == msg


@settings(max_examples=1000)
@given(data=st.binary(max_size=512))
def test_any_bytes_are_a_message_or_a_protocol_error(data):
    try:
        msg = parse_line(data)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert_accepted_is_a_fixed_point(msg)


@settings(max_examples=500)
@given(value=json_values, v=st.sampled_from([1, 1.0, True, "1", None]),
       kind=st.sampled_from(["hello", "sample", "entropy", "subscribe", "hint", 3]))
def test_any_json_is_a_message_or_a_protocol_error(value, v, kind):
    for candidate in (value, {"v": v, "type": kind, "x": value},
                      {"v": v, "type": kind, "values": value, "modality": "m"}):
        try:
            msg = parse_line(json.dumps(candidate).encode())
        except ProtocolError:
            continue
        assert type(candidate["v"]) is int and candidate["type"] in (
            "hello", "sample", "entropy", "subscribe")
        assert_accepted_is_a_fixed_point(msg)


# ------------------------------------------------- the schema, exactly

# printable: neither "Other" nor "Separator", but the space (str.isprintable)
names = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"),
                              whitelist_characters=" "), min_size=1, max_size=MAX_NAME)
ts = st.integers(0, 2**63 - 1)
entropy_samples = st.fixed_dictionaries(
    {"layer": names, "head": st.integers(0, MAX_HEAD), "value": st.floats(0, 1)},
    optional={"modality": names})
good_messages = st.one_of(
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("subscribe")}),
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("hello")},
                          optional={"client": names, "pid": st.integers(1, PID_MAX)}),
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("sample"), "series": names,
                           "modality": names,
                           "value_ms": st.one_of(st.integers(0, int(MAX_VALUE_MS)),
                                                 st.floats(0, MAX_VALUE_MS))},
                          optional={"ts_ns": ts}),
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("entropy"), "modality": names,
                           "values": st.lists(entropy_samples, min_size=1, max_size=8)},
                          optional={"ts_ns": ts}),
    st.fixed_dictionaries({"v": st.just(1), "type": st.just("entropy"), "modality": names,
                           "layer": names, "head": st.integers(0, MAX_HEAD),
                           "value": st.floats(0, 1)}, optional={"ts_ns": ts}))


def normalised(msg: dict) -> dict:
    """What the schema promises to hand on for a valid message."""
    out = dict(msg)
    if "value_ms" in out:
        out["value_ms"] = float(out["value_ms"])
    if out["type"] == "entropy":
        samples = out.pop("values", None) or [
            {k: out.pop(k) for k in ("layer", "head", "value")}]
        out["values"] = [{"layer": s["layer"], "head": s["head"], "value": float(s["value"]),
                          "modality": s.get("modality", msg["modality"])} for s in samples]
    return out


@settings(max_examples=500)
@given(msg=good_messages, extra=st.dictionaries(st.sampled_from(["future", "note"]),
                                                json_values, max_size=2))
def test_every_message_the_schema_allows_is_accepted_as_sent(msg, extra):
    line = json.dumps({**msg, **extra}).encode()
    if len(line) > MAX_MESSAGE or nesting_depth(line) > MAX_DEPTH:
        return
    got = parse_line(line)
    assert got == normalised(msg)           # unknown keys are not handed on
    assert_accepted_is_a_fixed_point(got)


# Per field: values of the wrong type or outside the range.
WRONG = {
    "v": [True, 1.0, 2, "1", None, [1]],
    "pid": [True, 0, -1, PID_MAX + 1, 1.0, "7", None],
    "client": ["", "x" * (MAX_NAME + 1), 5, None, "a\x00b", ["x"]],
    "series": ["", "x" * (MAX_NAME + 1), 1, None, "a\tb", {}],
    "modality": ["", 2, None, "\x7f"],
    "value_ms": [True, -5, -1e-9, MAX_VALUE_MS * 2, "1", None, [1], 2**1100],
    "ts_ns": [True, -1, 2**63, 2**80, 1.0, "abc", [1], None],
    "layer": ["", 3, None],
    "head": [True, -3, MAX_HEAD + 1, 1.0, "0", None],
    "value": [True, -0.1, 1.0001, 2, "0.5", None],
    "values": [[], [1, "x", None], "x", {"layer": "a"}, [{"layer": "a", "head": 0}]],
}


@settings(max_examples=800)
@given(msg=good_messages, data=st.data())
def test_a_wrong_value_in_any_field_is_refused(msg, data):
    fields = [k for k in msg if k in WRONG and k != "type"]
    if msg["type"] == "entropy" and "values" in msg:
        sample_key = data.draw(st.sampled_from(["layer", "head", "value", "modality"]))
        bad = data.draw(st.sampled_from(WRONG[sample_key]))
        index = data.draw(st.integers(0, len(msg["values"]) - 1))
        msg["values"][index] = {**msg["values"][index], sample_key: bad}
    else:
        key = data.draw(st.sampled_from(fields))
        msg[key] = data.draw(st.sampled_from(WRONG[key]))
    with pytest.raises(ProtocolError):
        validate(msg)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e400"])
def test_non_finite_numbers_are_not_json(constant):
    with pytest.raises(ProtocolError, match="expected a finite number"):
        parse_line(b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":'
                   + constant + b"}")


def test_nan_in_a_message_built_in_python_is_refused():
    with pytest.raises(ProtocolError, match="value_ms as a number"):
        validate({"v": 1, "type": "sample", "series": "s", "modality": "m",
                  "value_ms": math.nan})


@pytest.mark.parametrize("sent,kept", [(1.0000001, 1.0), (-1e-7, 0.0), (0, 0.0), (1, 1.0)])
def test_float_noise_at_the_ends_of_an_entropy_is_clipped(sent, kept):
    msg = parse_line(json.dumps({"v": 1, "type": "entropy", "modality": "m", "layer": "l",
                                 "head": 0, "value": sent}).encode())
    assert msg["values"][0]["value"] == kept and type(msg["values"][0]["value"]) is float


def test_a_batch_that_fits_a_line_is_never_too_many_samples():
    """The byte limit binds first: a client that fills lines up to 64 KiB
    with the smallest samples is never refused for their number."""
    one = {"layer": "a", "head": 0, "value": 0}
    fits = (MAX_MESSAGE - 60) // (len(json.dumps(one, separators=(",", ":"))) + 1)
    msg = {"v": 1, "type": "entropy", "modality": "m", "values": [one] * fits}
    line = json.dumps(msg, separators=(",", ":")).encode()
    assert len(line) <= MAX_MESSAGE and len(parse_line(line)["values"]) == fits <= MAX_VALUES
    with pytest.raises(ProtocolError, match=f"got {MAX_VALUES + 1} items"):
        validate({**msg, "values": [one] * (MAX_VALUES + 1)})
