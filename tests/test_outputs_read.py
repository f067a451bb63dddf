"""What users read, field by field, against the events that made it: one
known recording (a launcher whose calls partly fail with
cudaErrorInsufficientDriver, as the PyPI libcudart's do without a driver)
through report (text and JSON), jsonl, Chrome, Perfetto (the official
schema), and the same events through the daemon to the metrics and top.
Failed calls are in every output, apart from the work."""

import json
import time

import numpy as np
import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest

from mmtrace.agent.cli import cli
from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon import views
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.recording import file_format
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT
from mmtrace.exporters.live import prometheus
from mmtrace.exporters.terminal import top as top_view

PID, MAIN, LAUNCHER = 42, 42, 43
INSUFFICIENT = "cudaErrorInsufficientDriver (35)"
INFOS = device_stream.default_infos()
API = {info.symbol: i for i, info in INFOS.items()}
MS = 10**6


def calls(t0: int) -> np.ndarray:
    """The launcher's calls: (api, offset ns, op_id, ret or None when not
    probed, duration, bytes)."""
    table = [("cudaLaunchKernel", 0, 1, 0, 5_000, 0),
             ("cudaLaunchKernel", 1 * MS, 2, 35, 3_000, 0),
             ("cudaLaunchKernel", 2 * MS, 3, None, 0, 0),
             ("cudaMemcpyAsync", 3 * MS, 4, 0, 7_000, 4096),
             ("cudaMemcpyAsync", 4 * MS, 5, 35, 2_000, 8192),
             ("cudaStreamSynchronize", 5 * MS, 0, 0, 2_000_000, 0),
             ("cudaStreamSynchronize", 8 * MS, 0, 35, 1_000, 0)]
    ev = np.zeros(len(table), device_stream.DEV_EVENT)
    for i, (api, at, op, ret, duration, nbytes) in enumerate(table):
        info = INFOS[API[api]]
        e = ev[i]
        e["ts_ns"], e["api"], e["kind"] = t0 + at, API[api], device_stream.KIND_IDS[info.kind]
        e["op_id"], e["bytes"], e["stream_handle"] = op, nbytes, 0x10
        e["pid"], e["tid"], e["comm"], e["device"] = PID, LAUNCHER, b"launcher", -1
        e["sched_delay_ns"] = 1500 + i
        e["direction"] = 1 if info.kind == "memcpy" else device_stream.NO_DIRECTION
        if info.kind == "launch":
            e["grid_x"], e["grid_y"], e["grid_z"] = 8, 1, 1
            e["block_x"], e["block_y"], e["block_z"] = 256, 1, 1
            e["handle"] = 0x1000
        if ret is not None:
            e["flags"], e["ret"], e["duration_ns"] = device_stream.FLAG_RETURNED, ret, duration
    return ev


def waits(t0: int) -> np.ndarray:
    rq = np.zeros(3, RUNQ_EVENT)
    rq["ts_ns"] = t0 + np.array([500_000, 1_500_000, 6_000_000])
    rq["delay_ns"] = [20_000, 40_000, 300_000]
    rq["pid"], rq["tid"] = PID, [MAIN, LAUNCHER, LAUNCHER]
    rq["comm"] = [b"vlm-server", b"launcher", b"launcher"]
    return rq


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("outputs") / "known.mmtr"
    writer = file_format.RecordingWriter(path, {"cpu.runq": RUNQ_EVENT,
                                                "dev.event": device_stream.DEV_EVENT})
    t0 = time.monotonic_ns()
    writer.write_meta({"apis": device_stream.default_table().to_json()})
    writer.write_events("cpu.runq", waits(t0))
    writer.write_events("dev.event", calls(t0))
    writer.close({"duration_s": 0.01})
    with file_format.RecordingReader(path) as rec:
        header = dict(rec.header)
    return path, t0, header


def run(*args) -> str:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    return result.output


def test_report_json_counts_work_and_failed_calls_apart(recorded):
    path, t0, header = recorded
    summary = json.loads(run("report", path, "--json"))
    assert summary["events"] == {"cpu.runq": 3, "gpu.launch": 2, "gpu.memcpy": 1,
                                 "gpu.sync": 1}
    assert summary["failed_calls"] == [
        {"stream": "gpu", "kind": "launch", "api": "cudaLaunchKernel", "error": INSUFFICIENT,
         "count": 1},
        {"stream": "gpu", "kind": "memcpy", "api": "cudaMemcpyAsync", "error": INSUFFICIENT,
         "count": 1},
        {"stream": "gpu", "kind": "sync", "api": "cudaStreamSynchronize", "error": INSUFFICIENT,
         "count": 1}]
    assert summary["bytes_by_direction"] == [{"stream": "gpu", "direction": "h2d", "count": 1,
                                              "bytes": 4096}]
    assert summary["sync_waits"] == [{"stream": "gpu", "api": "cudaStreamSynchronize",
                                      "count": 1, "total_ms": 2.0, "p50_us": 2000.0,
                                      "p99_us": 2000.0, "max_us": 2000.0}]
    assert summary["launch_return_codes"] == {"launches": 3, "probed": 2, "failed": 1}
    assert summary["ops"] == [{"stream": "gpu", "kind": "launch", "api": "cudaLaunchKernel",
                               "op_name": None, "count": 2}]
    assert summary["runq"]["count"] == 3 and summary["runq"]["max_us"] == 300.0
    offset = header["realtime_minus_monotonic_ns"]
    assert summary["started"]["unix_ns"] == header["start_monotonic_ns"] + offset


def test_report_text_says_the_same(recorded):
    path, _, _ = recorded
    lines = run("report", path).splitlines()
    assert "failed calls: 3 (no work done: not in the counts, copies and waits above)" in lines
    rows = [line.split() for line in lines if INSUFFICIENT in line]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("gpu", "cudaLaunchKernel", "1"),
                                                   ("gpu", "cudaMemcpyAsync", "1"),
                                                   ("gpu", "cudaStreamSynchronize", "1")]
    assert any(line.split() == ["gpu", "h2d", "1", "4,096"] for line in lines)
    assert ("launch return codes: 2 of 3 launches probed, 1 failed (the rest were not "
            "sampled: their outcome is unknown)") in lines
    assert any(line.startswith("started ") and "UTC)" in line for line in lines)


def test_jsonl_each_call_as_recorded(recorded):
    path, t0, _ = recorded
    lines = [json.loads(line) for line in run("export", path, "--format", "jsonl",
                                              "-o", "-").splitlines()]
    gpu = [o for o in lines if o["stream"] == "gpu"]
    made = calls(t0)
    assert [(o["ts_ns"], o["api"]) for o in gpu] == [
        (int(e["ts_ns"]), INFOS[int(e["api"])].api) for e in made]
    # The sync that returned covers the submissions before it that did not
    # fail (the last is op 4); the failed ones were never queued, and the
    # failed sync waited for nothing.
    assert [o["op_id"] for o in gpu] == [1, 2, 3, 4, 5, 4, None]
    retired = t0 + 5 * MS + 2_000_000
    assert [o["retired_ns"] for o in gpu] == [retired, None, retired, retired, None, None, None]
    assert [o["ret"] for o in gpu] == [0, 35, None, 0, 35, 0, 35]
    assert [o["duration_ns"] for o in gpu] == [5_000, 3_000, None, 7_000, 2_000, 2_000_000,
                                               1_000]
    assert [o["bytes"] for o in gpu if o["kind"] == "memcpy"] == [4096, 8192]
    assert [o["sched_delay_ns"] for o in gpu] == [1500 + i for i in range(7)]
    launch = gpu[0]
    assert (launch["grid"], launch["block"], launch["stream_handle"], launch["handle"]) == (
        [8, 1, 1], [256, 1, 1], 0x10, 0x1000)
    cpu = [o for o in lines if o["stream"] == "cpu"]
    assert [(o["tid"], o["duration_ns"], o["ret"]) for o in cpu] == [
        (MAIN, 20_000, None), (LAUNCHER, 40_000, None), (LAUNCHER, 300_000, None)]


def test_chrome_args_carry_return_codes_and_errors(recorded, tmp_path):
    path, _, _ = recorded
    out = tmp_path / "trace.json"
    run("export", path, "--format", "chrome", "-o", out)
    events = [e for e in json.loads(out.read_text())["traceEvents"]
              if e.get("cat", "").startswith("gpu.")]
    assert [e["args"].get("ret") for e in events] == [0, 35, None, 0, 35, 0, 35]
    assert [e["args"].get("error") for e in events] == [None, INSUFFICIENT, None, None,
                                                        INSUFFICIENT, None, INSUFFICIENT]
    assert [e["ph"] for e in events] == ["X", "X", "i", "X", "X", "X", "X"]


def test_perfetto_as_the_official_schema_reads_it(recorded, tmp_path):
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace
    path, t0, header = recorded
    out = tmp_path / "trace.pftrace"
    run("export", path, "--format", "perfetto", "-o", out)
    trace = Trace()
    trace.ParseFromString(out.read_bytes())
    # Timestamps never go backwards within a sequence; each sequence says
    # its clock (CLOCK_MONOTONIC) in its first packet.
    last, first = {}, {}
    for packet in trace.packet:
        seq = packet.trusted_packet_sequence_id
        first.setdefault(seq, packet)
        if packet.HasField("timestamp"):
            assert packet.timestamp >= last.get(seq, 0), (seq, packet.timestamp)
            last[seq] = packet.timestamp
    for seq, packet in first.items():
        assert packet.trace_packet_defaults.timestamp_clock_id == 3, seq
        assert packet.sequence_flags == 1, seq
    # The wall clock beside the trace's: the recording's own offset.
    [snapshot] = [p.clock_snapshot for p in trace.packet if p.HasField("clock_snapshot")]
    clocks = {c.clock_id: c.timestamp for c in snapshot.clocks}
    assert snapshot.primary_trace_clock == 3
    assert clocks[1] - clocks[3] == header["realtime_minus_monotonic_ns"]
    # Every process and thread is named.
    processes = {p.track_descriptor.process.pid: p.track_descriptor.process.process_name
                 for p in trace.packet if p.track_descriptor.HasField("process")}
    threads = {p.track_descriptor.thread.tid: p.track_descriptor.thread.thread_name
               for p in trace.packet if p.track_descriptor.HasField("thread")}
    assert processes == {PID: "vlm-server"}
    assert threads == {MAIN: "vlm-server", LAUNCHER: "launcher"}
    # Every launch carries its grid, block, stream, sched delay and outcome;
    # its return code where it was probed.
    notes = [{a.name: getattr(a, a.WhichOneof("value")) for a in p.track_event.debug_annotations}
             for p in trace.packet if p.track_event.debug_annotations]
    launches = [n for n in notes if n.get("api") == "cudaLaunchKernel"]
    assert len(launches) == 3
    for i, note in enumerate(launches):
        assert (note["grid"], note["block"], note["stream"]) == ("8x1x1", "256x1x1", "0x10")
        assert note["sched_delay_ns"] == 1500 + i
    assert [n.get("return_code") for n in launches] == [0, 35, None]
    assert [n["outcome"] for n in launches] == ["ok", f"failed: {INSUFFICIENT}",
                                                "return not probed"]
    copies = [n for n in notes if n.get("api") == "cudaMemcpyAsync"]
    assert [(n["bytes"], n["outcome"]) for n in copies] == [(4096, "ok"),
                                                            (8192, f"failed: {INSUFFICIENT}")]


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "sock",
                            adaptive_launches=False))
    yield d
    d.close()


def test_metrics_and_top_count_failed_calls_by_code_not_as_work(daemon):
    daemon.started_ns = time.monotonic_ns() - 2 * 10**9     # up long enough for a 1 s span
    t0 = time.monotonic_ns() - 50 * MS
    ev = calls(t0)
    daemon.streams.submitters.learn(ev)
    daemon.streams.batch("dev", ev, DeviceNames(INFOS).process(ev))
    lines = generate_latest(prometheus.registry_for(daemon.metrics_snapshot,
                                                    prometheus.Labels())).decode().splitlines()

    def sample(prefix):
        return sorted(line for line in lines if line.startswith(prefix))

    assert sample("mmtrace_device_call_failures_total{") == [
        f'mmtrace_device_call_failures_total{{api="{api}",code="35",'
        f'error="cudaErrorInsufficientDriver",stream="gpu"}} 1.0'
        for api in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize")]
    assert sample("mmtrace_device_submissions_total{") == [
        'mmtrace_device_submissions_total{api="cudaLaunchKernel",kind="launch",stream="gpu"} 2.0',
        'mmtrace_device_submissions_total{api="cudaMemcpyAsync",kind="memcpy",stream="gpu"} 1.0']
    assert sample("mmtrace_device_memcpy_bytes_total{") == [
        'mmtrace_device_memcpy_bytes_total{direction="h2d",stream="gpu"} 4096.0']
    assert 'mmtrace_device_sync_wait_seconds_count{stream="gpu"} 1.0' in lines
    status = views.status(daemon, time.monotonic_ns(), 1.0)
    [row] = status["processes"]
    assert row["pid"] == PID and row["launches_per_s"] == pytest.approx(2 / status["span_s"])
    assert row["failed_per_s"] == pytest.approx(3 / status["span_s"])
    assert row["failed_calls"] == [{"api": api, "error": INSUFFICIENT, "count": 1} for api in
                                   ("cudaLaunchKernel", "cudaMemcpyAsync",
                                    "cudaStreamSynchronize")]
    assert row["sync_wait_p99_ms"] == 2.0
    screen = top_view.render(status, width=200)
    assert "FAILED CALLS (last 1 s)" in screen
