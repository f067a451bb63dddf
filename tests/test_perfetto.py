"""The native Perfetto export, decoded back field by field."""

import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mmtrace.exporters.files import perfetto, perfetto_device, perfetto_events, perfetto_tracks  # noqa: E402
from mmtrace.exporters.files import perfetto_fields as proto  # noqa: E402
from mmtrace.exporters.files.protowire import read_fields, varint  # noqa: E402
from mmtrace.agent.recording.offline_detectors import Detectors  # noqa: E402
from perfetto_slices import recording_slices  # noqa: E402
from test_recording import runq_records  # noqa: E402


def packets(blob: bytes):
    """Each TracePacket of a Trace, as {field: [values]}."""
    out = []
    for number, wire, value in read_fields(blob):
        assert (number, wire) == (proto.TRACE_PACKET, 2)
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
    n = perfetto_events.write_perfetto(recording_slices({"cpu.runq": runq}), buf)
    assert n == 5
    pkts = packets(buf.getvalue())
    descriptors = [p for p in pkts if proto.TP_TRACK_DESCRIPTOR in p]
    events = [p for p in pkts if proto.TP_TRACK_EVENT in p]
    assert len(descriptors) == 3                      # one process, two threads
    assert len(events) == 10                          # a begin and an end per slice
    assert all(p[proto.TP_SEQUENCE_ID] == [proto.SEQUENCE_ID] for p in pkts)
    assert pkts[0][proto.TP_SEQUENCE_FLAGS] == [proto.SEQ_INCREMENTAL_STATE_CLEARED]
    threads = {}
    for p in descriptors:
        desc = dict((n, v) for n, _, v in read_fields(p[proto.TP_TRACK_DESCRIPTOR][0]))
        if proto.TD_THREAD in desc:
            t = dict((n, v) for n, _, v in read_fields(desc[proto.TD_THREAD]))
            threads[desc[proto.TD_UUID]] = (t[proto.THD_PID], t[proto.THD_TID],
                                               t[proto.THD_NAME])
            assert desc[proto.TD_PARENT_UUID] == perfetto_tracks.process_uuid(42)
    assert sorted(threads.values()) == [(42, 100, b"worker"), (42, 101, b"worker")]
    # First slice: the first record, waiting delay_ns up to its switch-in at ts_ns.
    begin, end = events[0], events[1]
    ev_begin = dict((n, v) for n, _, v in read_fields(begin[proto.TP_TRACK_EVENT][0]))
    assert ev_begin[proto.TE_TYPE] == proto.SLICE_BEGIN
    assert ev_begin[proto.TE_NAME] == b"runq"
    assert threads[ev_begin[proto.TE_TRACK_UUID]][1] == 100
    first = runq[0]
    assert begin[proto.TP_TIMESTAMP] == [int(first["ts_ns"] - first["delay_ns"])]
    ends = sorted(p[proto.TP_TIMESTAMP][0] for p in events
                  if dict((n, v) for n, _, v in read_fields(p[proto.TP_TRACK_EVENT][0]))
                  [proto.TE_TYPE] == proto.SLICE_END)
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
    events = [p for p in packets(out.read_bytes()) if proto.TP_TRACK_EVENT in p]
    assert len(events) == 80


# ------------------------------------------------ GPU/NPU streams, flows, counters

def fields(message: bytes) -> dict:
    """{field: [values]} of one message."""
    out = {}
    for n, _, v in read_fields(message):
        out.setdefault(n, []).append(v)
    return out


def decoded(blob: bytes):
    """(track descriptors by uuid, [(ts, track event fields)]) of a trace."""
    tracks, events = {}, []
    for p in packets(blob):
        if proto.TP_TRACK_DESCRIPTOR in p:
            desc = fields(p[proto.TP_TRACK_DESCRIPTOR][0])
            tracks[desc[proto.TD_UUID][0]] = desc
        if proto.TP_TRACK_EVENT in p:
            events.append((p[proto.TP_TIMESTAMP][0], fields(p[proto.TP_TRACK_EVENT][0])))
    return tracks, events


def device_workload():
    """Two streams of process 1 and a blocking copy, through the real alignment."""
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    from mmtrace.bpf import device
    from test_align import events
    ev = events((100, "cudaLaunchKernel", 1, 5), (110, "cudaLaunchKernel", 2, 6),
                (120, "cudaMemcpyAsync", 3, 5), (130, "cudaStreamSynchronize", 0, 5, 40),
                (140, "cudaLaunchKernel", 4, 5), (300, "cudaStreamSynchronize", 0, 6, 5),
                (400, "cudaMemcpy", 5, 0, 25), (500, "cudaMemcpyAsync", 6, 0, None, 0, 2))
    ev["bytes"] = [0, 0, 4096, 0, 0, 0, 1000, 77]
    ev["tid"] = ev["pid"] + 10
    ev["comm"] = b"python"
    return decode(ev, DeviceContext(device.default_infos()))


def test_submissions_get_stream_tracks_flows_to_their_sync_and_copy_counters():
    from mmtrace.agent.ingest.align import NONE
    from mmtrace.agent.recording.replay import Step
    rows = device_workload()
    buf = io.BytesIO()
    perfetto.write_recording([Step({}, rows)], buf)
    tracks, events = decoded(buf.getvalue())
    ev = rows.events
    retired = {int(e["op_id"]): int(e["retired_ns"]) for e, k in zip(ev, rows.kind)
               if k != "sync"}
    assert retired == {1: 170, 2: 305, 3: 170, 4: NONE, 5: 425, 6: NONE}

    # Stream tracks: one per (pid, stream) with a retired submission, under its process.
    streams = {d[proto.TD_NAME][0]: uuid for uuid, d in tracks.items()
               if proto.TD_NAME in d and proto.TD_COUNTER not in d}
    assert sorted(streams) == [b"gpu stream 0x0", b"gpu stream 0x5", b"gpu stream 0x6"]
    assert all(tracks[u][proto.TD_PARENT_UUID] == [perfetto_tracks.process_uuid(1)]
               for u in streams.values())
    # Their slices: from each submission to its retirement, as the host saw it.
    on_stream = {}
    for ts, e in events:
        for name, uuid in streams.items():
            if e[proto.TE_TRACK_UUID] == [uuid]:
                on_stream.setdefault(name, []).append((ts, e[proto.TE_TYPE][0]))
    B, E = proto.SLICE_BEGIN, proto.SLICE_END
    assert on_stream == {b"gpu stream 0x5": [(100, B), (120, B), (170, E), (170, E)],
                         b"gpu stream 0x6": [(110, B), (305, E)],
                         b"gpu stream 0x0": [(400, B), (425, E)]}

    # Flows: started on the calls of submissions a later sync retired, each
    # ended on exactly that sync (the one whose return is its retired_ns).
    started, ended = {}, {}
    calls = [(ts, e) for ts, e in events if e[proto.TE_TRACK_UUID][0] >> 62 == 1]
    for ts, e in calls:
        for fid in e.get(proto.TE_FLOW_IDS, []):
            started[fid] = ts
        for fid in e.get(proto.TE_TERMINATING_FLOW_IDS, []):
            assert fid not in ended
            ended[fid] = ts
    assert started == {perfetto_tracks.flow_id(1, 1): 100, perfetto_tracks.flow_id(1, 2): 110,
                       perfetto_tracks.flow_id(1, 3): 120}
    assert ended == {perfetto_tracks.flow_id(1, 1): 130, perfetto_tracks.flow_id(1, 3): 130,
                     perfetto_tracks.flow_id(1, 2): 300}
    assert 0 not in started and len(set(started)) == 3

    # Counters: each process's running total of bytes copied, at each copy.
    counters = {uuid: d for uuid, d in tracks.items() if proto.TD_COUNTER in d}
    assert {u: d[proto.TD_NAME][0] for u, d in counters.items()} == {
        perfetto_tracks.copied_uuid(1): b"memcpy bytes", perfetto_tracks.copied_uuid(2): b"memcpy bytes"}
    assert all(fields(d[proto.TD_COUNTER][0]) == {proto.CD_UNIT: [proto.UNIT_SIZE_BYTES]}
               for d in counters.values())
    values = [(e[proto.TE_TRACK_UUID][0], ts, e[proto.TE_COUNTER_VALUE][0])
              for ts, e in events if e[proto.TE_TYPE] == [proto.COUNTER]]
    assert values == [(perfetto_tracks.copied_uuid(1), 120, 4096), (perfetto_tracks.copied_uuid(1), 400, 5096),
                      (perfetto_tracks.copied_uuid(2), 500, 77)]


def test_flow_ids_are_nonzero_and_tell_processes_apart():
    ids = {perfetto_tracks.flow_id(pid, op) for pid in range(1, 50) for op in range(200)}
    assert len(ids) == 49 * 200 and 0 not in ids
    assert perfetto_tracks.stream_uuid(1, 5) >> 63 == 1 and perfetto_tracks.stream_uuid(1, 5) != \
        perfetto_tracks.stream_uuid(2, 5)


def test_array_hashes_are_the_per_value_ones():
    rng = np.random.default_rng(3)
    pid = rng.integers(0, 1 << 32, 500, dtype=np.uint64)
    value = rng.integers(0, 1 << 63, 500, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    assert perfetto_tracks.flow_ids(pid, value).tolist() == [
        perfetto_tracks.flow_id(p, v) for p, v in zip(pid.tolist(), value.tolist())]
    assert perfetto_tracks.stream_uuids(pid, value).tolist() == [
        perfetto_tracks.stream_uuid(p, v) for p, v in zip(pid.tolist(), value.tolist())]


def test_pending_flows_are_bounded_and_end_on_a_later_batch():
    flows = perfetto_device.Flows(limit=4)
    n = 10
    ts = np.arange(n, dtype=np.uint64) + 100
    retired = np.arange(n, dtype=np.int64) + 1000
    pid = np.ones(n, np.uint32)
    fid, (rows, ended) = flows.step(pid, np.arange(n, dtype=np.uint64), ts, ts, retired,
                                    np.ones(n, bool), np.zeros(n, bool))
    assert len(rows) == 0 and len(flows) == 4        # the newest four wait
    # A later batch: a sync of process 1 returning at 1009, one of process 2 at 1008.
    fid2, (rows, ended) = flows.step(np.array([1, 2], np.uint32), np.zeros(2, np.uint64),
                                     np.array([900, 901], np.uint64),
                                     np.array([1009, 1008], np.uint64),
                                     np.full(2, -1, np.int64), np.zeros(2, bool),
                                     np.ones(2, bool))
    assert rows.tolist() == [0] and ended.tolist() == [perfetto_tracks.flow_id(1, 9)]
    assert fid2.tolist() == [0, 0] and len(flows) == 3


# ------------------------------------------------------------ anomalies

def annotations(event: dict) -> dict:
    """The debug annotations of a track event, by name, decoded by type."""
    import struct
    from mmtrace.exporters.files.perfetto_anomalies import TE_DEBUG_ANNOTATIONS
    out = {}
    for raw in event.get(TE_DEBUG_ANNOTATIONS, []):
        da = fields(raw)
        name = da[10][0].decode()
        assert name not in out
        if 2 in da:
            out[name] = bool(da[2][0])
        elif 4 in da:
            value = da[4][0]
            out[name] = value - (1 << 64) if value >> 63 else value
        elif 5 in da:
            out[name] = struct.unpack("<d", da[5][0].to_bytes(8, "little"))[0]
        else:
            out[name] = da[6][0].decode()
    return out


def anomaly_instants(blob: bytes):
    from mmtrace.exporters.files.perfetto_anomalies import ANOMALY_TRACK
    tracks, events = decoded(blob)
    assert tracks[ANOMALY_TRACK][proto.TD_NAME] == [b"mmtrace anomalies"]
    assert proto.TD_PARENT_UUID not in tracks[ANOMALY_TRACK]
    found = [(ts, e) for ts, e in events if e[proto.TE_TRACK_UUID] == [ANOMALY_TRACK]]
    assert all(e[proto.TE_TYPE] == [proto.INSTANT] for _, e in found)
    return [(ts, e[proto.TE_NAME][0].decode(), annotations(e)) for ts, e in found]


def test_anomalies_the_detectors_find_are_instants_with_their_evidence(tmp_path):
    import json
    from click.testing import CliRunner
    from mmtrace.agent.recording import offline_detectors as offline
    from mmtrace.agent.recording import file_format as recording
    from mmtrace.agent.cli import cli
    from test_daemon_parts import synthetic_recording
    path = synthetic_recording(tmp_path / "s.mmtr")
    expected = offline.detect(recording.read_recording(path))
    assert [a["state"] for a in expected][:1] == ["firing"]
    out = tmp_path / "s.pftrace"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "perfetto", "-o", str(out)])
    assert result.exit_code == 0, result.output
    instants = anomaly_instants(out.read_bytes())
    assert len(instants) == len(expected)
    for (ts, name, notes), a in zip(instants, expected):
        ev = a["evidence"]
        assert ts == a["ts_ns"]
        assert name == f"p99_drift {a['series']} {a['state']}"
        assert (notes["detector"], notes["series"], notes["state"], notes["source"]) == (
            "p99_drift", a["series"], a["state"], "replay")
        assert notes["evidence.p99"] == ev["p99"] and notes["evidence.baseline"] == ev["baseline"]
        assert notes["evidence.samples"] == ev["samples"]
        assert json.loads(notes["evidence.top_contributors"]) == ev["top_contributors"]
        assert json.loads(notes["evidence.windows"]) == ev["windows"]
    assert instants[0][2]["evidence.p99"] > 3 * instants[0][2]["evidence.baseline"]


def test_a_flight_recordings_anomaly_is_an_instant_at_its_end(tmp_path):
    from mmtrace.agent.recording.flight import FlightRecorder
    from mmtrace.bpf.sched import RUNQ_EVENT
    runq = np.zeros(3, RUNQ_EVENT)
    runq["ts_ns"] = np.array([3, 4, 5]) * 1_000_000_000
    runq["pid"] = runq["tid"] = 9
    anomaly = {"detector": "p99_drift", "series": "runq_delay{pid=9}", "state": "firing",
               "evidence": {"p99": 0.004, "baseline": 0.001, "samples": 812,
                            "clamped": True, "note": "x"}}
    path = FlightRecorder(tmp_path).dump({"cpu.runq": runq}, {"cpu.runq": RUNQ_EVENT}, anomaly,
                                         [], now_ns=5_000_000_000)
    buf = io.BytesIO()
    from mmtrace.agent.recording.file_format import RecordingReader
    from mmtrace.agent.recording.replay import replay
    with RecordingReader(path) as rec:
        perfetto.write_recording(replay(rec), buf, source=rec, detectors=Detectors(rec))
    [(ts, name, notes)] = anomaly_instants(buf.getvalue())
    assert ts == 5_000_000_000 and name == "p99_drift runq_delay{pid=9} firing"
    assert notes == {"detector": "p99_drift", "series": "runq_delay{pid=9}", "state": "firing",
                     "source": "flight recording", "evidence.p99": 0.004,
                     "evidence.baseline": 0.001, "evidence.samples": 812,
                     "evidence.clamped": True, "evidence.note": "x"}


def test_a_recording_without_anomalies_has_no_anomaly_track(tmp_path):
    from mmtrace.exporters.files.perfetto_anomalies import ANOMALY_TRACK
    from test_recording import write_sample
    from mmtrace.agent.recording.file_format import RecordingReader
    from mmtrace.agent.recording.replay import replay
    buf = io.BytesIO()
    with RecordingReader(write_sample(tmp_path / "a.mmtr")) as rec:
        perfetto.write_recording(replay(rec), buf, source=rec, detectors=Detectors(rec))
    tracks, _ = decoded(buf.getvalue())
    assert tracks and ANOMALY_TRACK not in tracks


def test_syncs_that_end_many_flows_are_encoded_on_their_own_the_same(monkeypatch):
    rows = device_workload()
    whole = perfetto_device.device_packets(rows)
    monkeypatch.setattr(perfetto_device, "WIDE_FLOWS", 0)      # every sync that ends a flow
    assert perfetto_device.device_packets(rows) == whole


@pytest.mark.parametrize("spread", [3, 30, 5000, 1 << 62])
def test_few_valued_annotations_encode_per_combination_as_call_by_call(spread):
    """Neighbouring few-valued fields go as tables of the combinations that
    occur: the same bytes as each call's annotations on their own, whether
    the values span a lookup table or call for a sort, are few enough to be
    a table or not, and their combinations fit one table or several."""
    from mmtrace.exporters.files import perfetto_call_annotations as ann
    rng = np.random.default_rng(spread % 1000)
    n = 6000
    ret = rng.integers(-spread, spread, n)
    device = rng.integers(0, min(spread, 60), n)
    apis = [f"api{k}" for k in range(10)]     # codes of a small dtype, 9 x 31 past it
    fields = [("api", (apis, rng.choice([0, 9], n).astype(np.uint8)), None, ann.TEXT),
              ("shared_mem_bytes", rng.integers(0, spread, n), rng.random(n) < 0.5, ann.FEW),
              ("sched_delay_ns", rng.integers(0, 1 << 40, n), None, ann.INT),
              ("return_code", ret, rng.random(n) < 0.7, ann.FEW),
              ("outcome", (["ok", "failed"], (ret != 0).astype(np.int64)), None, ann.TEXT),
              ("device", device, device > 0, ann.FEW)]
    rows = ann.call_rows(fields, n)
    assert rows.bytes() == b"".join(ann.call_bytes(fields, i) for i in range(n))
    assert rows.lengths().tolist() == [len(ann.call_bytes(fields, i)) for i in range(n)]
    assert ann.call_rows(ann.fields_at(fields, np.arange(0)), 0).bytes() == b""


# ------------------------------------- what dispatchers reported, and the hints

def test_request_latency_entropy_and_hints_are_in_the_trace(tmp_path):
    import struct
    from click.testing import CliRunner
    from mmtrace.agent.recording import file_format as recording
    from mmtrace.agent.cli import cli
    from mmtrace.agent.socket.telemetry import ENTROPY_SAMPLE, REQUEST_SAMPLE
    requests = np.zeros(4, REQUEST_SAMPLE)
    requests["ts_ns"] = [10**9, 2 * 10**9, 3 * 10**9, 4 * 10**9]
    requests["value_s"] = [0.010, 0.020, 0.250, 0.030]
    requests["series"] = [0, 1, 0, 1]
    entropy = np.zeros(4, ENTROPY_SAMPLE)
    entropy["ts_ns"] = [10**9, 10**9, 2 * 10**9, 2 * 10**9]
    entropy["value"] = [0.2, 0.4, 0.9, 0.7]
    entropy["head"] = [0, 1, 0, 1]
    audit = [{"ts_ns": 3 * 10**9, "kind": "modality_batch", "target": "vision", "value": 4,
              "reason": "text p99 drifted", "evidence": {"p99": 0.25}, "step": "escalate",
              "outcome": "sent", "id": "7-1"}]
    path = tmp_path / "t.mmtr"
    w = recording.RecordingWriter(path, {"model.entropy": ENTROPY_SAMPLE,
                                         "request.latency": REQUEST_SAMPLE})
    w.write_meta({"request_series": ["request_latency{series=e2e,modality=text}",
                                     "request_latency{series=e2e,modality=vision}"],
                  "modalities": ["vision"], "hint_audit": audit})
    w.write_events("request.latency", requests)
    w.write_events("model.entropy", entropy)
    w.close({})
    out = tmp_path / "t.pftrace"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "perfetto", "-o", str(out)])
    assert result.exit_code == 0, result.output
    tracks, events = decoded(out.read_bytes())
    names = {uuid: d[proto.TD_NAME][0].decode() for uuid, d in tracks.items()}

    def counter(track_name):
        uuid = next(u for u, n in names.items() if n == track_name)
        assert proto.TD_COUNTER in tracks[uuid]
        return [(ts, struct.unpack("<d", struct.pack("<Q", e[proto.TE_DOUBLE_COUNTER_VALUE][0]))[0])
                for ts, e in events if e.get(proto.TE_TRACK_UUID) == [uuid]]

    text = counter("request latency ms request_latency{series=e2e,modality=text}")
    assert [(ts, round(v, 6)) for ts, v in text] == [(10**9, 10.0), (3 * 10**9, 250.0)]
    vision = counter("request latency ms request_latency{series=e2e,modality=vision}")
    assert [ts for ts, _ in vision] == [2 * 10**9, 4 * 10**9]
    means = counter("attention entropy vision")
    assert [(ts, round(v, 6)) for ts, v in means] == [(10**9, 0.3), (2 * 10**9, 0.8)]
    [(ts, hint)] = [(ts, e) for ts, e in events
                    if e.get(proto.TE_TRACK_UUID) and names.get(e[proto.TE_TRACK_UUID][0])
                    == "mmtrace hints"]
    assert ts == 3 * 10**9 and hint[proto.TE_NAME] == [b"modality_batch vision -> 4"]
    notes = annotations(hint)
    assert (notes["kind"], notes["target"], notes["value"], notes["outcome"]) == (
        "modality_batch", "vision", 4, "sent")


def test_every_process_and_thread_is_named_as_the_official_schema_reads_it(tmp_path):
    """Parsed with Perfetto's own perfetto_trace_pb2: each process carries
    a name (its main thread's, once that shows; before, its first thread's)
    and each thread its own."""
    from click.testing import CliRunner
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace
    from mmtrace.agent.cli import cli
    from mmtrace.agent.recording import file_format
    from mmtrace.bpf.sched import RUNQ_EVENT
    workers = runq_records(5, tid=100)              # pid 42's worker shows first
    main = runq_records(5, start=5, tid=42)
    main["comm"] = b"vlm-server"
    other = runq_records(5, start=10, tid=7)
    other["pid"], other["comm"] = 7, b"tokenizer"
    path = tmp_path / "named.mmtr"
    w = file_format.RecordingWriter(path, {"cpu.runq": RUNQ_EVENT})
    w.write_events("cpu.runq", np.concatenate([workers, main, other]))
    w.close({})
    out = tmp_path / "named.pftrace"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "perfetto", "-o",
                                      str(out)])
    assert result.exit_code == 0, result.output
    trace = Trace()
    trace.ParseFromString(out.read_bytes())
    processes, threads = {}, {}
    for packet in trace.packet:
        desc = packet.track_descriptor
        if desc.HasField("process"):
            processes[desc.process.pid] = desc.process.process_name    # the last one counts
        if desc.HasField("thread"):
            threads[desc.thread.tid] = desc.thread.thread_name
    assert processes == {42: "vlm-server", 7: "tokenizer"}
    assert threads == {100: "worker", 42: "vlm-server", 7: "tokenizer"}


def test_every_call_carries_its_fields_as_debug_annotations_the_schema_reads():
    """What the Chrome export's args hold, and a launch's grid and block,
    a measured call's return code: as the UI lists them (official schema)."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace
    from mmtrace.exporters.files import perfetto_device
    rows = device_workload()
    trace = Trace()
    trace.ParseFromString(b"".join(perfetto_device.device_packets(rows)))
    calls = {}
    for packet in trace.packet:
        event = packet.track_event
        if event.debug_annotations:
            calls.setdefault(event.name, []).append(
                {a.name: getattr(a, a.WhichOneof("value")) for a in event.debug_annotations})
    launch = calls["cudaLaunchKernel"][0]
    assert launch["api"] == "cudaLaunchKernel" and launch["stream"] == "0x5"
    assert {"grid", "block", "shared_mem_bytes", "sched_delay_ns", "op_id"} <= set(launch)
    copy = calls["cudaMemcpyAsync"][0]
    assert copy["bytes"] == 4096 and "direction" in copy and "grid" not in copy
    sync = calls["cudaStreamSynchronize"][0]
    assert "return_code" in sync and "retired_ns" not in sync
    assert sum(len(v) for v in calls.values()) == len(rows)     # every call, once


def test_a_negative_return_code_reads_back_as_written():
    """int64 varints: a negative code is its 64-bit two's complement in both
    the batch encoding and the one-call-at-a-time one."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace
    from mmtrace.exporters.files import perfetto_device, perfetto_events
    from mmtrace.bpf import device
    rows = device_workload()
    rows.events["ret"] = -7
    rows.events["flags"] |= device.FLAG_RETURNED
    batch = perfetto_device.device_packets(rows)
    one_by_one = [b"".join(perfetto_events.item_packets(item) for item in items)
                  for items in perfetto_events.device_items(rows, {})]
    assert batch == one_by_one
    trace = Trace()
    trace.ParseFromString(b"".join(batch))
    codes = {a.int_value for p in trace.packet for a in p.track_event.debug_annotations
             if a.name == "return_code"}
    assert codes == {-7}


def _stamped_packet(ts: int) -> bytes:
    from mmtrace.exporters.files.protowire import field_bytes, field_varint
    body = field_varint(proto.TP_SEQUENCE_ID, proto.SEQUENCE_ID) + field_varint(
        proto.TP_TIMESTAMP, ts)
    return field_bytes(proto.TRACE_PACKET, body)


@pytest.mark.parametrize("window_ns", [20_000, 10**9])
def test_packet_order_sorts_each_packet_once_and_holds_a_bounded_amount(monkeypatch, window_ns):
    # Adds as a step's encoders make them: each roughly later than the one
    # before, out of order within (a slice's end before the next one's
    # begin), overlapping the next. A window of 1 s would hold them all:
    # past max_bytes the oldest are written early (what comes after them
    # goes on the late sequence, in order too).
    from mmtrace.exporters.files.perfetto_order import PacketOrder
    rng = np.random.default_rng(5)
    out = io.BytesIO()
    order = PacketOrder(out, window_ns=window_ns, max_bytes=60_000)
    sorted_items, held = [], []
    argsort = np.argsort
    # Sorts of stamps (uint64) are counted; a write also groups its packets
    # by length (perfetto_order._copied), which sorts no stamp.
    monkeypatch.setattr(np, "argsort", lambda a, *x, **k: (
        np.asarray(a).dtype == np.uint64 and sorted_items.append(len(a))) or argsort(a, *x, **k))
    total = 0
    for add in range(300):
        ts = 1_000_000 + add * 10_000 + rng.integers(0, 15_000, 200)
        blobs = [_stamped_packet(int(t)) for t in ts]
        order.add_packets(ts, blobs)
        order.passed(int(ts.max()))
        held.append(sum(len(b.data) for b in order._batches))
        total += len(ts)
    order.finish()
    monkeypatch.undo()
    written = packets(out.getvalue())
    stamps = {seq: [p[proto.TP_TIMESTAMP][0] for p in written
                    if p[proto.TP_SEQUENCE_ID][0] == seq and proto.TP_TIMESTAMP in p]
              for seq in (proto.SEQUENCE_ID, proto.LATE_SEQUENCE)}
    main, late = stamps[proto.SEQUENCE_ID], stamps[proto.LATE_SEQUENCE]
    assert len(main) + len(late) == total
    assert main == sorted(main) and late == sorted(late)
    assert len(main) > 0.9 * total
    assert total <= sum(sorted_items) <= 2 * total, sum(sorted_items)
    assert max(held) <= 60_000 + 200 * len(blobs[0]), max(held)


def test_packets_drawn_from_several_adds_come_out_whole_and_in_the_order_asked():
    # _copied moves the packets of one add and one length together, as
    # items of that many bytes: every packet must land whole, where asked,
    # whatever the mix of adds, lengths (one byte to a long sync's) and
    # places (the first and the last byte of an add).
    from mmtrace.exporters.files.perfetto_order import _copied
    rng = np.random.default_rng(11)
    for trial in range(40):
        sources = [np.frombuffer(rng.bytes(int(rng.integers(1, 3000))), np.uint8)[1:]
                   for _ in range(int(rng.integers(1, 6)))]
        n = int(rng.integers(0, 20_000 if trial % 4 == 3 else 400))
        source = rng.integers(0, len(sources), n)
        # Half the trials take a few lengths (moved as items), half many
        # (too many groups: moved as pieces and tails).
        few = rng.integers(0, 300, 4) if trial % 2 else None
        lengths = np.array([min(int(rng.choice(few)) if few is not None else
                                int(rng.integers(0, 300)), len(sources[h]))
                            for h in source.tolist()], np.int64)
        starts = np.array([int(rng.integers(0, len(sources[h]) - ln + 1))
                           for h, ln in zip(source.tolist(), lengths.tolist())], np.int64)
        expected = b"".join(sources[h][a:a + ln].tobytes() for h, a, ln in
                            zip(source.tolist(), starts.tolist(), lengths.tolist()))
        assert _copied(sources, source, starts, lengths).tobytes() == expected, trial
    # A packet said to reach past its add is refused, not read from beyond it.
    with pytest.raises(IndexError):
        _copied([np.zeros(10, np.uint8)], np.zeros(1, np.int64), np.array([8]), np.array([4]))


def test_late_packets_come_back_sorted_and_whole_from_their_file():
    # One packet written far ahead; everything after it is earlier: late,
    # kept in a temporary file, written sorted on the late sequence.
    from mmtrace.exporters.files.perfetto_order import PacketOrder
    out = io.BytesIO()
    order = PacketOrder(out, max_bytes=1 << 12)
    order.add_packets([10**15], [_stamped_packet(10**15)])
    order.passed(10**15 + 10**10)
    late = [10**12 + (20 - add) * 100 + k for add in range(20) for k in range(100)]
    for add in range(20):
        chunk = late[add * 100:(add + 1) * 100]
        order.add_packets(chunk, [_stamped_packet(t) for t in chunk])
    assert len(order.late) == 2000
    order.finish()
    written = packets(out.getvalue())
    on_late = [p[proto.TP_TIMESTAMP][0] for p in written
               if p[proto.TP_SEQUENCE_ID][0] == proto.LATE_SEQUENCE and proto.TP_TIMESTAMP in p]
    assert on_late == sorted(late)


def test_a_stream_track_is_named_by_the_last_call_on_its_handle():
    """A process's GPU and NPU calls on one handle (0: the default stream,
    and the calls that name no stream) share one track, named by the stream
    of the last call on it, of any kind."""
    from mmtrace.bpf import device as ds
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    from mmtrace.agent.recording.replay import Step
    for apis, named in (([1, 13, 113], b"npu stream 0x0"),      # launch, two syncs
                        ([101, 113, 13], b"gpu stream 0x0")):   # NPU launch, NPU then GPU sync
        e = np.zeros(3, ds.DEV_EVENT)
        e["pid"] = e["tid"] = 7
        e["flags"] = ds.FLAG_RETURNED
        e["ts_ns"] = [100, 200, 300]
        e["api"] = apis
        e["op_id"] = [1, 0, 0]
        e["duration_ns"] = 10
        out = io.BytesIO()
        writer = perfetto.PerfettoWriter(out)
        writer.step(Step({}, decode(e, DeviceContext(ds.default_infos()))))
        writer.finish()
        assert set(re.findall(rb"[a-z]+ stream 0x[0-9a-f]+", out.getvalue())) == {named}
