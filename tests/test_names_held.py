"""Names from outside are checked once, at the socket: a lone surrogate, a
control or format character is refused there. A recording that already
holds such names (written before the check) breaks no output: report,
its JSON and every export exit 0, with U+FFFD where the name could not
be encoded."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.socket.hint_protocol import ProtocolError, parse_line
from mmtrace.agent.socket.telemetry import SCHEMAS

MMTRACE = Path(sys.executable).parent / "mmtrace"
HOSTILE = ["\ud800", "vis\udfffion", "a\u202eb", "tab\there", "zero\u200bwidth", "\x7f"]


def sample_line(modality: str) -> bytes:
    return json.dumps({"v": 1, "type": "sample", "series": "e2e", "modality": modality,
                       "value_ms": 5}).encode()


@pytest.mark.parametrize("name", HOSTILE)
def test_the_socket_refuses_a_name_no_output_could_carry(name):
    with pytest.raises(ProtocolError, match="modality as a string of 1..256 printable"):
        parse_line(sample_line(name))


@pytest.mark.parametrize("name", ["vision", "视觉", "x,modality=vision", "pid=42 {a}", "😀"])
def test_names_any_output_can_carry_are_kept_as_given(name):
    assert parse_line(sample_line(name))["modality"] == name


def held_names_recording(path: Path) -> Path:
    """A recording as an earlier version wrote it, with a client's lone
    surrogates in its name tables."""
    w = recording.RecordingWriter(path, SCHEMAS)
    w.write_meta({"entropy_layers": ["enc.\ud800"], "modalities": ["\ud800", "text"],
                  "request_series": ["request_latency{series=e2e,modality=\udfff}"]})
    latency = np.zeros(3, SCHEMAS["request.latency"])
    latency["ts_ns"] = [10**9, 2 * 10**9, 3 * 10**9]
    latency["value_s"] = 0.005
    w.write_events("request.latency", latency)
    entropy = np.zeros(2, SCHEMAS["model.entropy"])
    entropy["ts_ns"] = [10**9, 2 * 10**9]
    entropy["value"] = 0.5
    w.write_events("model.entropy", entropy)
    w.close({"duration_s": 3.0})
    return path


def test_a_recording_holding_bad_names_breaks_no_output(tmp_path):
    rec = held_names_recording(tmp_path / "held.mmtr")
    runs = [["report", rec], ["report", rec, "--json"]] + [
        ["export", rec, "--format", fmt, "-o", tmp_path / f"out.{fmt}"]
        for fmt in ("jsonl", "chrome", "perfetto")]
    for args in runs:
        result = subprocess.run([MMTRACE, *map(str, args)], capture_output=True, timeout=120)
        assert result.returncode == 0, (args, result.stderr.decode(errors="replace")[-2000:])
        assert b"Traceback" not in result.stderr
    summary = json.loads(subprocess.run([MMTRACE, "report", rec, "--json"], capture_output=True,
                                        timeout=120, check=True).stdout)
    assert "request_latency{series=e2e,modality=\ufffd}" in json.dumps(summary,
                                                                       ensure_ascii=False)
