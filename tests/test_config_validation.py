"""`mmtrace run --config`: every bad value is named at load time, with its
value and what was expected, in one line and exit status 2; what loads
builds the detectors and rings without error."""

import math
from dataclasses import fields
import os
import re
import threading

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.cli import cli
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.daemon.loop import entropy_detector, p99_detector

# Each case the loader once accepted, and the words of its error.
BAD = [
    ("[p99]\nwindow_s = 0", "[p99] window_s = 0 (expected a number of seconds in 0.001..3600)"),
    ("[p99]\nwindow_s = -1", "[p99] window_s = -1 (expected a number of seconds in 0.001..3600)"),
    ("[p99]\nfactor = -2", "[p99] factor = -2 (expected a number in more than 1..100)"),
    ("[p99]\nconsecutive = 0", "[p99] consecutive = 0 (expected an integer in 1..1000)"),
    ("[p99]\nfloor_s = nan", "[p99] floor_s = nan (expected 0 or a number of seconds in 0.000001..3600)"),
    ("[p99]\nbaseline_windows = 1e10",
     "[p99] baseline_windows = 10000000000.0 (expected an integer in 1..3600)"),
    ("[p99]\nbaseline_windows = 10000000000",
     "[p99] baseline_windows = 10000000000 (expected an integer in 1..3600)"),
    ("[p99]\nbaseline_windows = 10",
     "[p99] min_baseline_windows = 20 (expected at most baseline_windows = 10)"),
    ("[p99]\nclear_factor = 1.5", "[p99] clear_factor = 1.5 (expected at most factor = 1.2)"),
    ("[entropy]\ntau = -5", "[entropy] tau = -5 (expected a number in 0..1)"),
    ("[entropy]\ntau = nan", "[entropy] tau = nan (expected a number in 0..1)"),
    ("[entropy]\nconsecutive = -3", "[entropy] consecutive = -3 (expected an integer in 1..1000)"),
    ("ring_seconds = nan", "ring_seconds = nan (expected a number of seconds in 0.000001..3600)"),
    ("ring_capacity = 1099511627776",
     "ring_capacity = 1099511627776 (expected an integer in 1..16777216)"),
    ("ring_capacity = 2e20", "ring_capacity = 2e+20 (expected an integer in 1..16777216)"),
    ("tick_s = nan", "tick_s = nan (expected a number of seconds in 0.000001..10)"),
    ("tick_s = inf", "tick_s = inf (expected a number of seconds in 0.000001..10)"),
    ("discover_interval_s = 0", "discover_interval_s = 0 (expected a number of seconds in 0.1..3600)"),
    ("discover_interval_s = nan", "discover_interval_s = nan (expected a number of seconds in 0.1..3600)"),
    ("flight_min_interval_s = -1", "flight_min_interval_s = -1 (expected 0 or a number of seconds in 0.000001..86400)"),
    ("launch_burst_s = -1", "launch_burst_s = -1 (expected a number of seconds in 0.000001..86400)"),
    ("device_ringbuf_mib = 3", "device_ringbuf_mib = 3 (expected a power of two: 1, 2, 4, ... "
                               "1024)"),
    ("device_ringbuf_mib = 2048", "device_ringbuf_mib = 2048 (expected an integer in 1..1024)"),
    ('pids = ["abc", 1.5]', "pids = ['abc', 1.5] (expected a list of at most 4096 items, "
                            "each an integer in 1..4194304)"),
    ("pids = [-1, 0]", "pids = [-1, 0] (expected a list of at most 4096 items"),
    ("pids = [true]", "pids = [True] (expected a list of at most 4096 items"),
    ("libs = [1, 2]", "libs = [1, 2] (expected a list of at most 1024 items, "
                      "each a path of 1..4096 bytes without NUL)"),
    ('libs = ["a\\u0000b"]', "libs = ['a\\x00b'] (expected a list"),
    ("adaptive_launches = 1", "adaptive_launches = 1 (expected true or false)"),
    (f'socket = "/{"s" * 120}"', "(expected a path of 1..107 bytes without NUL)"),
    ("state_dir = 5", "state_dir = 5 (expected a path of 1..4096 bytes without NUL)"),
    ("nice = -40", "nice = -40 (expected an integer in -20..19)"),
    ("socket_idle_timeout_s = 0", "socket_idle_timeout_s = 0 (expected a number of seconds in "
                                  "0.000001..86400)"),
    ("bogus = 1", "unknown key 'bogus' (expected one of adaptive_launches, "),
    ("[p99]\nbogus = 1", "[p99] unknown key 'bogus' (expected one of baseline_windows, "),
    ("[nope]\nx = 1", "unknown section [nope] (expected [p99], [entropy], [failures], [memory], [hangs], "
     "[diagnosis], [otlp], [policy])"),
    ("p99 = 3", "p99 = 3: p99 is a section; write it as [p99]"),
    ("ring_capacity = " + "9" * 5000, "not valid TOML"),
    ("a = " + "[" * 5000 + "]" * 5000, "not valid TOML: nested too deeply"),
    ("= broken", "not valid TOML"),
]


def write(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def run_cli(*args):
    return CliRunner().invoke(cli, ["run", *map(str, args)])


def assert_one_error_line(result, *wanted):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmtrace: error: "), result.stderr
    for text in wanted:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("text,wanted", BAD, ids=[t for t, _ in BAD])
def test_each_bad_setting_is_one_line_and_exit_2(tmp_path, text, wanted):
    path = write(tmp_path, text)
    with pytest.raises(MmtraceError) as caught:
        config_mod.load_config(path)
    assert wanted in str(caught.value.message)
    assert_one_error_line(run_cli("--config", path), f"config {path}: ", wanted)


def test_every_bad_key_is_named_in_the_one_error(tmp_path):
    path = write(tmp_path, "tick_s = nan\npids = [0]\nlibs = [1]\nbogus = 2\n"
                           "[p99]\nwindow_s = 0\nfactor = nan\n[entropy]\ntau = 2\n")
    line = assert_one_error_line(run_cli("--config", path), "7 bad settings: ")
    for key in ("tick_s = nan", "pids = [0]", "libs = [1]", "unknown key 'bogus'",
                "[p99] window_s = 0", "[p99] factor = nan", "[entropy] tau = 2"):
        assert key in line


def test_a_fifo_is_refused_without_blocking(tmp_path, mmtrace_cli):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    result = mmtrace_cli("run", "--config", fifo, timeout=30)     # hangs if it blocks
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"mmtrace: error: config {fifo}: expected a regular file, got not a regular file"]


@pytest.mark.parametrize("path,kind", [("/dev/zero", "not a regular file"),
                                       ("/tmp", "a directory")])
def test_devices_and_directories_are_refused(path, kind):
    outcome = []

    def load():
        try:
            config_mod.load_config(path)
        except Exception as exc:        # judged below, in the test's own thread
            outcome.append(exc)
    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the loader blocked"
    assert isinstance(outcome[0], MmtraceError)
    assert outcome[0].message == f"config {path}: expected a regular file, got {kind}"


def test_a_huge_file_is_refused_by_its_size(tmp_path):
    path = tmp_path / "c.toml"
    with open(path, "wb") as f:
        f.truncate(config_mod.MAX_CONFIG_BYTES + 1)     # sparse: nothing read to refuse it
    assert_one_error_line(run_cli("--config", path),
                          f"expected at most {config_mod.MAX_CONFIG_BYTES} bytes, "
                          f"got {config_mod.MAX_CONFIG_BYTES + 1}")


def test_flags_are_checked_as_the_file_is(tmp_path):
    assert_one_error_line(run_cli("--socket", "/" + "s" * 200, "--state-dir", tmp_path),
                          "1 bad setting: socket = '/sss",
                          "(expected a path of 1..107 bytes without NUL)")


def test_a_good_file_keeps_its_values(tmp_path):
    path = write(tmp_path, 'pids = [1, 4194304]\nlibs = ["/x.so"]\nring_capacity = 16777216\n'
                           "socket_idle_timeout_s = 5\n[p99]\nfactor = 2\nclear_factor = 2\n")
    cfg = config_mod.load_config(path)
    assert cfg.pids == (1, 4194304) and cfg.libs == ("/x.so",)
    assert cfg.ring_capacity == 1 << 24 and cfg.socket_idle_timeout_s == 5.0
    assert cfg.p99.factor == 2.0 and type(cfg.p99.factor) is float
    assert config_mod.check(cfg) == cfg


# ------------------------------------------------------------ properties

KEYS = {"": [f.name for f in fields(config_mod.DaemonConfig)
             if f.name not in config_mod.SECTIONS],
        **{name: [f.name for f in fields(cls)]
           for name, cls in config_mod.SECTIONS.items()}}
toml_scalars = st.one_of(
    st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(), st.text(max_size=30))
toml_values = st.one_of(toml_scalars, st.lists(toml_scalars, max_size=4))


def toml_literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") \
            if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if c.isalnum() or c in " ./_-" else f"\\u{ord(c):04x}"
                             for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_literal, value)) + "]"
    return str(value)


@st.composite
def config_texts(draw):
    lines = []
    for section, keys in KEYS.items():
        chosen = draw(st.dictionaries(st.sampled_from(keys), toml_values, max_size=5))
        if section:
            lines.append(f"[{section}]")
        lines += [f"{key} = {toml_literal(value)}" for key, value in chosen.items()]
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=config_texts())
def test_what_loads_builds_the_detectors_and_what_does_not_is_one_error(tmp_path, text):
    path = write(tmp_path, text)
    try:
        cfg = config_mod.load_config(path)
    except MmtraceError as exc:
        assert "\n" not in exc.message
        assert re.match(rf"config {re.escape(str(path))}: (\d+ bad settings?: |not valid TOML)",
                        exc.message), exc.message
        return
    p99_detector(cfg.p99)               # the detectors check their settings too
    entropy_detector(cfg.entropy)
    assert cfg.ring_capacity * 48 + cfg.device_ring_capacity * 224 <= 1.3 * 2**30
    assert all(type(pid) is int and pid > 0 for pid in cfg.pids)
    assert all(type(lib) is str for lib in cfg.libs)
    assert config_mod.check(cfg) == cfg
