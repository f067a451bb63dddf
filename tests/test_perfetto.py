"""The native Perfetto export, decoded back field by field."""

import io
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mmtrace.exporters import perfetto  # noqa: E402
from mmtrace.exporters.protowire import read_fields, varint  # noqa: E402
from test_recording import runq_records  # noqa: E402


def packets(blob: bytes):
    """Each TracePacket of a Trace, as {field: [values]}."""
    out = []
    for number, wire, value in read_fields(blob):
        assert (number, wire) == (perfetto.TRACE_PACKET, 2)
        fields = {}
        for n, _, v in read_fields(value):
            fields.setdefault(n, []).append(v)
        out.append(fields)
    return out


def test_varint_matches_the_protobuf_encoding():
    assert varint(1) == b"\x01"
    assert varint(300) == b"\xac\x02"
    assert varint(-1) == b"\xff" * 9 + b"\x01"


def test_runq_waits_become_slices_on_thread_tracks():
    runq = np.concatenate([runq_records(3, tid=100), runq_records(2, start=10, tid=101)])
    buf = io.BytesIO()
    n = perfetto.write_perfetto(perfetto.recording_slices({"cpu.runq": runq}), buf)
    assert n == 5
    pkts = packets(buf.getvalue())
    descriptors = [p for p in pkts if perfetto.TP_TRACK_DESCRIPTOR in p]
    events = [p for p in pkts if perfetto.TP_TRACK_EVENT in p]
    assert len(descriptors) == 3                      # one process, two threads
    assert len(events) == 10                          # a begin and an end per slice
    assert all(p[perfetto.TP_SEQUENCE_ID] == [perfetto.SEQUENCE_ID] for p in pkts)
    assert pkts[0][perfetto.TP_SEQUENCE_FLAGS] == [perfetto.SEQ_INCREMENTAL_STATE_CLEARED]
    threads = {}
    for p in descriptors:
        desc = dict((n, v) for n, _, v in read_fields(p[perfetto.TP_TRACK_DESCRIPTOR][0]))
        if perfetto.TD_THREAD in desc:
            t = dict((n, v) for n, _, v in read_fields(desc[perfetto.TD_THREAD]))
            threads[desc[perfetto.TD_UUID]] = (t[perfetto.THD_PID], t[perfetto.THD_TID],
                                               t[perfetto.THD_NAME])
            assert desc[perfetto.TD_PARENT_UUID] == perfetto.process_uuid(42)
    assert sorted(threads.values()) == [(42, 100, b"worker"), (42, 101, b"worker")]
    # First slice: the first record, waiting delay_ns up to its switch-in at ts_ns.
    begin, end = events[0], events[1]
    ev_begin = dict((n, v) for n, _, v in read_fields(begin[perfetto.TP_TRACK_EVENT][0]))
    assert ev_begin[perfetto.TE_TYPE] == perfetto.SLICE_BEGIN
    assert ev_begin[perfetto.TE_NAME] == b"runq"
    assert threads[ev_begin[perfetto.TE_TRACK_UUID]][1] == 100
    first = runq[0]
    assert begin[perfetto.TP_TIMESTAMP] == [int(first["ts_ns"] - first["delay_ns"])]
    ends = sorted(p[perfetto.TP_TIMESTAMP][0] for p in events
                  if dict((n, v) for n, _, v in read_fields(p[perfetto.TP_TRACK_EVENT][0]))
                  [perfetto.TE_TYPE] == perfetto.SLICE_END)
    assert ends == sorted(runq["ts_ns"].tolist())


def test_cli_exports_perfetto(tmp_path):
    from click.testing import CliRunner
    from mmtrace.agent.cli import cli
    from test_recording import write_sample
    path = write_sample(tmp_path / "a.mmtr")
    out = tmp_path / "a.pftrace"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "perfetto", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "40 slices" in result.stderr
    events = [p for p in packets(out.read_bytes()) if perfetto.TP_TRACK_EVENT in p]
    assert len(events) == 80
