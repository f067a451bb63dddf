"""Wherever a person reads a time in a report, the clock on the wall is
there too: in the local zone with its offset and in UTC; JSON keeps the
nanoseconds and adds ISO 8601. The writer's own offset maps the file's
CLOCK_MONOTONIC stamps."""

import json
import time
from datetime import datetime

from click.testing import CliRunner

from mmtrace.agent.cli import cli
from mmtrace.agent.recording import file_format
from mmtrace.agent.recording.report import summarize
from mmtrace.agent.recording.wall_clock import WallClock

from test_daemon_parts import synthetic_recording

MS = 10**6


def test_the_report_says_when_on_the_wall_clock_to_the_millisecond(tmp_path):
    before = time.time_ns()
    path = synthetic_recording(tmp_path / "s.mmtr")
    after = time.time_ns()
    with file_format.RecordingReader(path) as rec:
        summary = summarize(rec)
        offset = rec.header["realtime_minus_monotonic_ns"]
    started = summary["started"]
    # The file was opened between `before` and `after`, as `date` reads them.
    assert before - 10 * MS <= started["unix_ns"] <= after + 10 * MS
    assert started["unix_ns"] == started["monotonic_ns"] + offset
    local = datetime.fromisoformat(started["local"])
    assert abs(local.timestamp() * 1e9 - started["unix_ns"]) < MS
    assert started["utc"].endswith("+00:00")
    assert summary["ended"]["monotonic_ns"] >= started["monotonic_ns"]
    # Each anomaly: where it sits in the recording's time, on the wall.
    firing = [a for a in summary["anomalies"] if a["state"] == "firing"]
    stamp = firing[0]["wall_time"]
    assert stamp["monotonic_ns"] == firing[0]["ts_ns"]
    assert stamp["unix_ns"] == firing[0]["ts_ns"] + offset
    # The text: the start, the end and the anomaly with their wall-clock times.
    text = CliRunner().invoke(cli, ["report", str(path)]).stdout
    clock = WallClock(offset)
    assert f"started     {clock.text(started['monotonic_ns'])}" in text
    assert f"{clock.text(firing[0]['ts_ns'])}  [" in text
    assert "UTC)" in text
    as_json = json.loads(CliRunner().invoke(cli, ["report", str(path), "--json"]).stdout)
    assert as_json["started"] == started


def test_a_recording_without_the_offset_says_it_does_not_know():
    clock = WallClock(None)
    assert not clock.known and clock.text(10**9) == "?"
    assert clock.stamp(10**9) == {"monotonic_ns": 10**9, "unix_ns": None, "local": None,
                                  "utc": None}
    # A stamp no calendar holds (a hostile header) is unknown, not a crash.
    assert WallClock(1 << 80).text(1 << 62) == "?"


def test_explain_says_when_on_the_wall_clock_to_the_millisecond(tmp_path):
    """explain's window and its reference, on the wall as `date` reads it."""
    clocks = time.time_ns() - time.monotonic_ns()       # what `date` and the stamps say
    path = synthetic_recording(tmp_path / "s.mmtr")
    run = CliRunner().invoke(cli, ["explain", str(path), "--json"])
    assert run.exit_code == 0, run.output
    answer = json.loads(run.stdout)
    offset = file_format.RecordingReader(path).header["realtime_minus_monotonic_ns"]
    started = answer["window"]["started"]
    # The stamps are the file's own (synthetic, from 1 s of CLOCK_MONOTONIC):
    # each maps through the offset the writer took, which is the host's.
    assert started["unix_ns"] == started["monotonic_ns"] + offset
    assert abs(offset - clocks) <= 10 * MS
    assert abs(datetime.fromisoformat(started["local"]).timestamp() * 1e9
               - started["unix_ns"]) < MS
    assert answer["reference"]["started"]["utc"].endswith("+00:00")
    text = CliRunner().invoke(cli, ["explain", str(path)]).stdout
    assert started["local"] in text
