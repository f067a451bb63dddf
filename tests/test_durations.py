"""Every duration from outside input is refused, by field and range, when
it is not a number the clocks can hold: NaN, infinite, zero or below,
under its floor (a tick of the clock at least), over its top, a 400-digit
integer, a bool. Each surface is tried: a hint (the book and the
dispatcher's API), a queue's wait, the hint policy, each config key, each
MMTRACE_* variable, each command-line flag."""

import math
from dataclasses import fields

import pytest
from click.testing import CliRunner

from mmtrace.agent.cli import cli
from mmtrace.agent.config.settings import SECTIONS, DaemonConfig, Seconds, load_config
from mmtrace.agent.config.environment import load_layers
from mmtrace.agent.errors import MmtraceError
from mmtrace.dispatch import Dispatcher
from mmtrace.dispatch.durations import check_duration, expected_duration, is_duration
from mmtrace.dispatch.hints import MAX_TTL_S, MIN_TTL_S, HintBook
from mmtrace.dispatch.policy import DURATIONS, PolicySettings
from mmtrace.dispatch.queue_config import parse_queues

# What the fuzzer found (5e-63), and its kin. Each is bad for any
# range whose floor is a clock tick or more.
BAD = [math.nan, math.inf, -math.inf, -1, -0.5, 5e-63, 1e-10, 10**400, True, "1", None, [1]]


def duration_settings():
    """(section or None, key, rule) of every setting that is a duration."""
    out = [(None, f.name, f.metadata["rule"]) for f in fields(DaemonConfig)
           if isinstance(f.metadata.get("rule"), Seconds)]
    for section, cls in SECTIONS.items():
        out += [(section, f.name, f.metadata["rule"]) for f in fields(cls)
                if isinstance(f.metadata.get("rule"), Seconds)]
    return out


def test_the_floor_of_every_range_is_a_clock_tick_at_least():
    with pytest.raises(ValueError, match="one clock tick"):
        is_duration(1.0, 1e-10, 10)
    assert is_duration(1e-9, 1e-9, 10)
    for _, _, rule in duration_settings():
        assert rule.low >= 1e-6
    for low, _, _ in DURATIONS.values():
        assert low >= 1e-6


@pytest.mark.parametrize("value", BAD + [0, -0.0, MAX_TTL_S + 0.001, MIN_TTL_S / 2])
def test_a_hint_ttl_outside_its_range_is_refused_and_changes_nothing(value):
    book = HintBook(["gpu0"], ["vision", "text"])
    book.apply(hint("modality_batch", "vision", 4, 5), 0)
    before = (book.effects, dict(book.active))
    with pytest.raises(ValueError) as err:
        book.apply(hint("priority", "vision", "urgent", value), 0)
    assert str(err.value).startswith("priority hint ttl_s: expected a number of seconds in "
                                     "0.001..3600, got ")
    assert (book.effects, dict(book.active)) == before


def test_the_fuzzers_two_lines_keep_the_first_hint_and_refuse_the_second():
    # tests/fuzz/corpus/dispatch_hints/crash-ttl-below-a-clock-tick, as the API takes it
    d = Dispatcher(["gpu0"], lambda device, modality, items: list(items), socket=None)
    try:
        d.apply_hint(hint("modality_batch", "vision", 4, 5, hid="1"))
        with pytest.raises(ValueError, match=r"ttl_s: expected a number of seconds in "
                                             r"0\.001\.\.3600, got 5e-63"):
            d.apply_hint(hint("priority", "vision", "urgent", 5e-63, hid="6"))
        (held,) = d.state()["hints"]
        assert (held["id"], held["kind"], held["value"]) == ("1", "modality_batch", 4)
        assert held["expires_ns"] > held["applied_ns"]
        assert d.state()["queues"]["vision"]["priority"] == "high"
    finally:
        d.close()


@pytest.mark.parametrize("value", BAD + [60_000.5])
def test_a_queue_wait_outside_its_range_is_refused(value):
    with pytest.raises(ValueError) as err:
        parse_queues({"vision": {"wait_ms": value}})
    assert "wait_ms: expected 0 or a number of milliseconds in 0.001..60000, got " \
        in str(err.value)


def test_a_queue_wait_of_zero_means_none():
    assert parse_queues({"vision": {"wait_ms": 0}})["vision"].wait_ns == 0


@pytest.mark.parametrize("name", sorted(DURATIONS))
@pytest.mark.parametrize("value", BAD)
def test_a_policy_duration_outside_its_range_is_refused(name, value):
    low, high, zero = DURATIONS[name]
    with pytest.raises(ValueError) as err:
        PolicySettings(**{name: value})
    assert str(err.value).startswith(
        f"policy {name}: expected {expected_duration(low, high, zero=zero)}, got ")


def toml_value(value) -> str | None:
    """`value` as TOML writes it; None where TOML has no such value."""
    if isinstance(value, bool):
        return "true"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return f'"{value}"'
    return None


def over_the_top(rule) -> list:
    return [rule.high * 1.5, rule.high + 1] + ([] if rule.zero else [0, -0.0])


@pytest.mark.parametrize("section, key, rule", duration_settings(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_a_config_duration_outside_its_range_is_refused_by_key_and_range(tmp_path, section,
                                                                        key, rule):
    where = f"[{section}] " if section else ""
    for value in BAD + over_the_top(rule) + [rule.low / 2]:
        text = toml_value(value)
        if text is None:
            continue
        path = tmp_path / "mmtrace.toml"
        path.write_text(f"[{section}]\n{key} = {text}\n" if section else f"{key} = {text}\n")
        with pytest.raises(MmtraceError) as err:
            load_config(path)
        assert f"{where}{key} = " in err.value.message, (key, value)
        assert f"(expected {rule.expected})" in err.value.message, (key, value)


@pytest.mark.parametrize("section, key, rule", duration_settings(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_an_environment_duration_outside_its_range_is_refused_by_name_and_range(section, key,
                                                                               rule):
    name = f"MMTRACE_{section.upper()}_{key.upper()}" if section else f"MMTRACE_{key.upper()}"
    texts = ["nan", "inf", "-inf", "-1", "5e-63", "1e-10", "1e400", "9" * 5000, "soon", "",
             repr(rule.high * 1.5), repr(rule.low / 2)] + ([] if rule.zero else ["0", "-0.0"])
    for text in texts:
        with pytest.raises(MmtraceError) as err:
            load_layers(None, {name: text})
        assert f"{name}=" in err.value.message and f"(expected {rule.expected})" \
            in err.value.message, (name, text[:20])


@pytest.mark.parametrize("section, key, rule", [s for s in duration_settings() if s[2].zero],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_zero_where_a_setting_gives_it_a_meaning_is_taken(section, key, rule):
    name = f"MMTRACE_{section.upper()}_{key.upper()}" if section else f"MMTRACE_{key.upper()}"
    cfg, _ = load_layers(None, {name: "0"})
    assert getattr(getattr(cfg, section) if section else cfg, key) == 0.0


@pytest.mark.parametrize("args, option, expected", [
    (["top", "--once", "--interval"], "--interval", "0.1..3600"),
    (["dump", "--timeout"], "--timeout", "1..600"),
    (["record", "-o", "r.mmtr", "--duration"], "--duration", "0.001..604800"),
])
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "5e-63", "1e400", "soon", "1e9"])
def test_a_duration_flag_outside_its_range_is_a_usage_error(tmp_path, args, option, expected,
                                                            value):
    result = CliRunner().invoke(cli, args + [value], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}': expected a number of seconds in {expected}, " \
           f"got '{value}'" in result.output
    assert "Traceback" not in result.output


def test_check_duration_names_the_field_and_shows_a_long_value_cut():
    with pytest.raises(ValueError) as err:
        check_duration(10**400, "x", 1, 2)
    message = str(err.value)
    assert message.startswith("x: expected a number of seconds in 1..2, got 1000")
    assert message.endswith("...") and len(message) < 120


def hint(kind, target, value, ttl_s, hid="h"):
    return {"v": 1, "type": "hint", "id": hid, "kind": kind, "target": target, "value": value,
            "ttl_s": ttl_s}
