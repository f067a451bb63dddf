"""Values from outside, as a careless or hostile user gives them: digits
that are not ASCII ('²', '١'), endpoints that are no URL, timeouts that
are no duration, a directory where a file goes. Each is refused by name,
or ignored where it is only a hint of the environment; none ends in a
traceback, and the console script says each in one line, exit 2."""

import subprocess
import sys
from pathlib import Path

import pytest

from mmtrace.agent.daemon.log_format import stream_is_journal
from mmtrace.agent.daemon.sd_notify import Notifier
from mmtrace.dispatch.hints import HintBook
from mmtrace.exporters.devices.npu_smi import npu_ids
from mmtrace.exporters.live.otlp_options import options_from

MMTRACE = Path(sys.executable).parent / "mmtrace"


def one_line(*args, env=None) -> str:
    result = subprocess.run([MMTRACE, *map(str, args)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmtrace: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("ordinal", ["\u0661", "²", "١٢"])
def test_a_device_ordinal_in_other_digits_is_refused(ordinal):
    book = HintBook(["gpu0", "gpu1"], ["vision"])
    with pytest.raises(ValueError, match="expected a device among"):
        book.apply({"v": 1, "type": "hint", "kind": "route_affinity", "target": "vision",
                    "value": ordinal, "ttl_s": 1}, 0)
    assert book.apply({"v": 1, "type": "hint", "kind": "route_affinity", "target": "vision",
                       "value": "1", "ttl_s": 1}, 0).value == ["gpu1"]


def test_environment_hints_in_other_digits_are_ignored(tmp_path):
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "n.sock"), "WATCHDOG_USEC": "²"})
    assert notifier.watchdog_s is None
    with open(tmp_path / "f", "w") as stream:
        assert not stream_is_journal(stream, {"JOURNAL_STREAM": "²:1"})
    assert npu_ids("NPU ID : ²\nNPU ID : 3\n") == [3]


@pytest.mark.parametrize("env, words", [
    ({"OTEL_BSP_MAX_QUEUE_SIZE": "²"}, "OTEL_BSP_MAX_QUEUE_SIZE: expected a positive integer"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "nan"}, "OTEL_EXPORTER_OTLP_TIMEOUT: expected a number of "
                                            "milliseconds in 1..600000, got 'nan'"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "-5"}, "got '-5'"),
    ({"OTEL_EXPORTER_OTLP_TIMEOUT": "1e400"}, "got '1e400'"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "not a url"},
     "OTEL_EXPORTER_OTLP_*ENDPOINT: expected an http(s) URL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:99999"}, "expected an http(s) URL"),
])
def test_bad_otlp_variables_are_refused_by_name(env, words):
    with pytest.raises(ValueError) as err:
        options_from(endpoint="" if "ENDPOINT" in str(env) else "http://collector:4318/x",
                     env=env)
    assert words in str(err.value)


def test_an_otlp_endpoint_that_is_not_used_is_not_checked():
    """A host-wide OTEL_* meant for other programs, with OTLP off here."""
    assert not options_from(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317",
                                 "OTEL_SDK_DISABLED": "true"}).enabled
    assert options_from(endpoint="http://c:4318/v1/traces",
                        env={"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317"}).enabled


@pytest.mark.parametrize("endpoint", ["not a url", "ftp://host/x", "http://", "collector:4318"])
def test_an_otlp_endpoint_that_is_no_url_is_refused(endpoint):
    with pytest.raises(ValueError, match=r"\[otlp\] endpoint: expected an http\(s\) URL"):
        options_from(endpoint=endpoint, env={})


def test_the_daemon_refuses_them_at_start_in_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "MMTRACE_OTLP_ENDPOINT": "not a url"}
    line = one_line("run", "--state-dir", tmp_path / "state", "--socket", tmp_path / "s.sock",
                    "--metrics-address", "off", env=env)
    assert "OTLP: [otlp] endpoint: expected an http(s) URL" in line
    line = one_line("run", "--state-dir", tmp_path / "state", "--socket", tmp_path / "s.sock",
                    "--metrics-address", ":²")
    assert "metrics address: expected HOST:PORT or :PORT" in line


@pytest.mark.parametrize("args", [["report", "{dir}"], ["export", "{dir}", "--format", "jsonl",
                                                        "-o", "-"], ["report"],
                                  ["top", "--interval", "nan"], ["nosuch"]])
def test_a_usage_error_is_one_line_that_points_at_help(tmp_path, args):
    line = one_line(*[a.format(dir=tmp_path) for a in args])
    assert line.endswith("--help')")
