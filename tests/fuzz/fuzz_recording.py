"""Fuzz target: any bytes as a recording file, through everything a command
does with one (open, report, every export). RecordingError is the one
documented failure; any other exception is a crash."""

import atexit
import io
import os
import shutil
import sys
import tempfile
from functools import partial

import atheris
import numpy  # noqa: F401  (imported before instrumentation: not ours to fuzz)

with atheris.instrument_imports():
    from mmtrace.agent.recording.file_format import RecordingError, RecordingReader
    from mmtrace.agent.recording.replay import replay
    from mmtrace.agent.recording.report import format_text, summarize
    from mmtrace.exporters.files.chrome import write_chrome
    from mmtrace.exporters.files.jsonl import write_jsonl
    from mmtrace.agent.recording.offline_detectors import Detectors
    from mmtrace.exporters.files.perfetto import write_recording


def _input_path() -> str:
    where = tempfile.mkdtemp(prefix="fuzz-recording-")
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return os.path.join(where, "input.mmtr")


def test_one_input(data: bytes):
    with open(PATH, "wb") as f:
        f.write(data)
    try:
        with RecordingReader(PATH) as rec:
            format_text(summarize(rec))
            # The Perfetto export as `export` runs it: with the file's anomalies.
            for write in (write_jsonl, write_chrome, partial(write_recording, source=rec,
                                                                 detectors=Detectors(rec))):
                write(replay(rec), io.BytesIO())
    except RecordingError:
        pass


if __name__ == "__main__":
    PATH = _input_path()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
