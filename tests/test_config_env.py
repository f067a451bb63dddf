"""Every configuration key from the environment: MMTRACE_<KEY> and
MMTRACE_<SECTION>_<KEY>, read by the key's type under the file's rules,
over the file and under the flags; unknown MMTRACE_ variables reported."""

from dataclasses import fields
from pathlib import Path

import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.config.settings import SECTIONS, DaemonConfig
from mmtrace.agent.config.environment import load_layers
from mmtrace.agent.config.environment import environment_document, variables
from mmtrace.agent.errors import MmtraceError


def test_every_key_has_exactly_one_variable():
    names = variables()
    keys = [(None, f.name) for f in fields(DaemonConfig) if f.name not in SECTIONS]
    keys += [(s, f.name) for s, cls in SECTIONS.items() for f in fields(cls)]
    assert sorted((s or "", k) for s, k, _ in names.values()) == sorted((s or "", k)
                                                                         for s, k in keys)
    assert names["MMTRACE_TICK_S"][:2] == (None, "tick_s")
    assert names["MMTRACE_POLICY_DRY_RUN"][:2] == ("policy", "dry_run")
    assert names["MMTRACE_P99_MIN_BASELINE_WINDOWS"][:2] == ("p99", "min_baseline_windows")


def test_values_are_read_by_the_keys_type():
    cfg, warnings = load_layers(None, {
        "MMTRACE_TICK_S": "0.05", "MMTRACE_RING_CAPACITY": "4096", "MMTRACE_NICE": "-5",
        "MMTRACE_ADAPTIVE_LAUNCHES": "no", "MMTRACE_METRICS_PID_LABEL": "ON",
        "MMTRACE_PIDS": "4242, 4243", "MMTRACE_LIBS": "/opt/a.so,/opt/b.so",
        "MMTRACE_STATE_DIR": "/srv/mmtrace", "MMTRACE_METRICS_ADDRESS": "off",
        "MMTRACE_P99_FACTOR": "2", "MMTRACE_POLICY_DRY_RUN": "true",
        "MMTRACE_OTLP_HEADERS": "api-key=x,team=y", "MMTRACE_ENTROPY_TAU": "1e-1",
        "PATH": "/usr/bin"})
    assert warnings == []
    assert cfg.tick_s == 0.05 and type(cfg.ring_capacity) is int and cfg.ring_capacity == 4096
    assert cfg.nice == -5 and cfg.adaptive_launches is False and cfg.metrics_pid_label is True
    assert cfg.pids == (4242, 4243) and cfg.libs == ("/opt/a.so", "/opt/b.so")
    assert cfg.state_dir == Path("/srv/mmtrace") and cfg.metrics_address == "off"
    assert cfg.p99.factor == 2.0 and type(cfg.p99.factor) is float
    assert cfg.policy.dry_run is True and cfg.otlp.headers == "api-key=x,team=y"
    assert cfg.entropy.tau == 0.1


def test_an_empty_list_and_an_empty_string_are_values():
    cfg, _ = load_layers(None, {"MMTRACE_PIDS": "", "MMTRACE_OTLP_ENDPOINT": ""})
    assert cfg.pids == () and cfg.otlp.endpoint == ""


@pytest.mark.parametrize("name, value, expected", [
    ("MMTRACE_TICK_S", "soon", "a number of seconds in 0.000001..10"),
    ("MMTRACE_TICK_S", "nan", "a number of seconds in 0.000001..10"),
    ("MMTRACE_TICK_S", "11", "a number of seconds in 0.000001..10"),
    ("MMTRACE_RING_CAPACITY", "1.5", "an integer in 1..16777216"),
    ("MMTRACE_ADAPTIVE_LAUNCHES", "maybe", "true or false (1/0, yes/no, on/off)"),
    ("MMTRACE_PIDS", "4242,x", "comma-separated items, at most 4096, each an integer"),
    ("MMTRACE_STATE_DIR", "", "a path of 1..4096 bytes without NUL"),
    ("MMTRACE_P99_CONSECUTIVE", "0", "an integer in 1..1000"),
    ("MMTRACE_OTLP_HEADERS", "a=\x01", "a string of at most 8192 characters"),
])
def test_a_bad_value_names_the_variable_what_was_expected_and_what_arrived(name, value,
                                                                          expected):
    with pytest.raises(MmtraceError) as err:
        load_layers(None, {name: value})
    message = err.value.message
    assert message.startswith("environment: 1 bad setting: ")
    assert f"{name}={value!r}" in message and f"(expected {expected}" in message


def test_every_bad_variable_in_one_error():
    with pytest.raises(MmtraceError) as err:
        environment_document({"MMTRACE_TICK_S": "x", "MMTRACE_NICE": "99"})
    assert "2 bad settings" in err.value.message
    assert "MMTRACE_NICE='99'" in err.value.message and "MMTRACE_TICK_S='x'" in err.value.message


def test_unknown_mmtrace_variables_are_reported_with_the_nearest_name():
    _, warnings = load_layers(None, {"MMTRACE_TICKS": "1", "MMTRACE_P99": "x",
                                     "OTHER_TICK_S": "1"})
    assert warnings == ["MMTRACE_P99 names the section [p99]; ignored (set its keys as "
                        "MMTRACE_P99_<KEY>, e.g. MMTRACE_P99_WINDOW_S)",
                        "MMTRACE_TICKS names no setting; ignored (did you mean "
                        "MMTRACE_TICK_S?)"]


def test_the_environment_goes_over_the_file_key_by_key(tmp_path):
    path = tmp_path / "mmtrace.toml"
    path.write_text("tick_s = 0.1\nnice = 5\n[p99]\nfactor = 3.0\nconsecutive = 7\n")
    cfg, _ = load_layers(path, {"MMTRACE_TICK_S": "0.2", "MMTRACE_P99_FACTOR": "4"})
    assert cfg.tick_s == 0.2 and cfg.nice == 5               # the file's other keys stay
    assert cfg.p99.factor == 4.0 and cfg.p99.consecutive == 7
    assert load_layers(path, {})[0] == config_mod.load_config(path)


def test_errors_name_their_layer(tmp_path):
    path = tmp_path / "mmtrace.toml"
    path.write_text("tick_s = 'soon'\n")
    with pytest.raises(MmtraceError, match=rf"^config {path}: 1 bad setting: tick_s"):
        load_layers(path, {"MMTRACE_TICK_S": "0.2"})
    path.write_text("[p99]\nbaseline_windows = 30\n")
    with pytest.raises(MmtraceError) as err:
        load_layers(path, {"MMTRACE_P99_MIN_BASELINE_WINDOWS": "40"})
    assert err.value.message == (
        f"config {path} with MMTRACE_* variables: 1 bad setting: [p99] min_baseline_windows "
        "= 40 (expected at most baseline_windows = 30)")


def test_run_ends_on_a_bad_variable_with_one_line(mmtrace_cli, tmp_path):
    result = mmtrace_cli("run", "--check", "--socket", tmp_path / "s.sock",
                         env={"PATH": "/usr/bin:/bin", "MMTRACE_RING_CAPACITY": "many"})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "mmtrace: error: environment: 1 bad setting: MMTRACE_RING_CAPACITY='many' "
        "(expected an integer in 1..16777216)"]
