"""The recording writer when the disk refuses a write, on a real 2 MiB
tmpfs (root only; no eBPF): the file is cut back to its last complete
chunk, still takes its footer where that fits, and reads back whole up to
there. `mmtrace record` on a full disk: test_faults_bpf.py."""

import errno
import os

import pytest

from mmtrace.agent.recording import file_format as recording
from mmtrace.bpf.sched import RUNQ_EVENT
from test_faults_bpf import small_tmpfs  # noqa: F401  (fixture)
from test_recording import runq_records


@pytest.mark.parametrize("per_chunk", [100, 1000, 20_000])
def test_a_refused_write_leaves_a_file_that_reads_back(small_tmpfs, per_chunk):  # noqa: F811
    path = small_tmpfs / "w.mmtr"
    writer = recording.RecordingWriter(path, {"cpu.runq": RUNQ_EVENT})
    with pytest.raises(OSError) as refused:
        for _ in range(10_000):
            writer.write_events("cpu.runq", runq_records(per_chunk))
    assert refused.value.errno == errno.ENOSPC and writer.failed is refused.value
    assert os.path.getsize(path) == writer.bytes_written      # cut back to a chunk's end
    try:
        writer.close({"stopped_by": "write_error"})
        footer_fits = True
    except OSError:
        footer_fits = False
    assert writer.closed
    rec = recording.read_recording(path)
    assert len(rec.events["cpu.runq"]) == writer.events_written > 0
    assert rec.complete == footer_fits
    assert (rec.warnings == []) if footer_fits else rec.warnings   # else: cut short
    if footer_fits:
        assert rec.footer["stopped_by"] == "write_error"
