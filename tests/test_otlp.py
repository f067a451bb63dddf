"""OpenTelemetry traces: anomaly spans with their evidence, sampled
submission spans on wall-clock time, and a collector that is dead or slow
never stalling the daemon. The end-to-end tests send OTLP/HTTP to a real
HTTP receiver here, which decodes it with the official opentelemetry-proto
messages."""

import json
import re
import socket
import threading
import time

import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.bpf import device as device_stream
from mmtrace.exporters.live import otlp

from otlp_receiver import Receiver
from test_daemon_parts import connect, send_entropy_rise

P99_ANOMALY = {
    "detector": "p99_drift", "series": "runq_delay{pid=70}", "state": "firing",
    "ts_ns": 5_000_000_000,
    "evidence": {"windows": [{"start_ns": 2_000_000_000, "end_ns": 3_000_000_000,
                              "p99": 0.004, "count": 900}],
                 "p99": 0.004, "baseline": 0.001, "samples": 2700,
                 "top_contributors": [[77, 40]], "fire_ratio": 1.2},
    "flight_recording": "/var/lib/mmtrace/flight-1.mmtr",
}


def feed_device(daemon, events):
    """A GPU/NPU batch through the daemon's sink, named as ingest names it."""
    names = DeviceNames(device_stream.default_infos())
    daemon.streams.batch("dev", events, names.process(events))


def traces(exporter=None, clock=time.monotonic, **kw):
    options = otlp.OtlpOptions(endpoint="http://unused", **kw)
    return otlp.OtlpTraces(options, exporter=exporter or InMemorySpanExporter(),
                           clock_offset_ns=lambda: 1_700_000_000 * 10**9, wall_clock=clock)


def api_id(symbol):
    return next(i for i, info in device_stream.default_infos().items() if info.symbol == symbol)


def launches(n, pid=70, start_ns=10**9):
    rows = np.zeros(n, [*device_stream.DEV_EVENT.descr, ("retired_ns", "<i8")])
    rows["ts_ns"] = start_ns + np.arange(n) * 1000
    rows["retired_ns"] = rows["ts_ns"] + 50_000
    rows["pid"], rows["tid"], rows["comm"] = pid, pid + 1, b"launcher"
    rows["op_id"] = np.arange(1, n + 1)
    rows["api"] = api_id("cudaLaunchKernel")
    rows["grid_x"], rows["block_x"], rows["device"] = 4, 128, 0
    rows["handle"] = 0x1000
    return rows


# ------------------------------------------------------------------ spans

def test_an_anomaly_is_a_span_with_its_evidence():
    exporter = InMemorySpanExporter()
    t = traces(exporter)
    t.anomalies([P99_ANOMALY])
    t.shutdown()
    [span] = exporter.get_finished_spans()
    a = span.attributes
    assert span.name == "anomaly p99_drift runq_delay{pid=70}"
    assert a["mmtrace.detector"] == "p99_drift" and a["mmtrace.state"] == "firing"
    assert a["mmtrace.evidence.p99"] == 0.004 and a["mmtrace.evidence.baseline"] == 0.001
    assert json.loads(a["mmtrace.evidence.top_contributors"]) == [[77, 40]]
    assert json.loads(a["mmtrace.evidence.windows"])[0]["count"] == 900
    assert a["mmtrace.flight_recording"] == "/var/lib/mmtrace/flight-1.mmtr"
    # from the first window's start to the alarm, on the wall clock
    assert span.start_time == 2_000_000_000 + 1_700_000_000 * 10**9
    assert span.end_time == 5_000_000_000 + 1_700_000_000 * 10**9
    assert t.stats.anomaly_spans == 1 and t.stats.exported == 1


def test_submissions_become_spans_from_call_to_retire():
    exporter = InMemorySpanExporter()
    t = traces(exporter, sample_ratio=1.0)
    rows = launches(3)
    t.describe = lambda r: [{"stream": "gpu", "kind": "launch", "api": "cudaLaunchKernel",
                             "op_name": "vision::patch_embed(float*, int)"}] * len(r)
    t.submissions(rows)
    t.shutdown()
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
    assert [s.attributes["mmtrace.op_id"] for s in spans] == [1, 2, 3]
    first = spans[0]
    assert first.name == "vision::patch_embed(float*, int)"
    assert first.start_time == 10**9 + 1_700_000_000 * 10**9
    assert first.end_time - first.start_time == 50_000
    assert first.attributes["mmtrace.grid"] == (4, 0, 0)
    assert first.attributes["mmtrace.submit_to_retire_ns"] == 50_000
    assert first.attributes["mmtrace.comm"] == "launcher"


def test_sampling_is_by_submission_and_near_the_ratio():
    rows = launches(20000)
    picked = otlp.sampled(rows, 0.1)
    assert 0.08 < picked.mean() < 0.12
    # the same submission is in or out whichever batch carries it
    assert np.array_equal(otlp.sampled(rows[5000:6000], 0.1), picked[5000:6000])
    assert not otlp.sampled(rows, 0.0).any() and otlp.sampled(rows, 1.0).all()


def test_submission_spans_are_capped_per_second():
    now = [0.0]
    exporter = InMemorySpanExporter()
    t = traces(exporter, clock=lambda: now[0], sample_ratio=1.0, max_submission_spans_per_s=100)
    t.submissions(launches(500))
    assert t.stats.submission_spans == 100 and t.stats.capped == 400
    now[0] = 0.5                                 # half a second refills half the budget
    t.submissions(launches(500, start_ns=2 * 10**9))
    assert t.stats.submission_spans == 150
    t.shutdown()


class StuckExporter(SpanExporter):
    """A collector that takes a batch and never answers."""

    def __init__(self):
        self.release = threading.Event()

    def export(self, spans):
        self.release.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self):
        self.release.set()


def test_a_stuck_collector_costs_counted_drops_never_a_stall():
    stuck = StuckExporter()
    t = traces(stuck, sample_ratio=1.0, max_submission_spans_per_s=1e9, max_queue=64,
               schedule_delay_ms=10)
    start = time.monotonic()
    for i in range(20):
        t.submissions(launches(100, start_ns=(i + 1) * 10**9))
    t.anomalies([P99_ANOMALY] * 5)
    assert time.monotonic() - start < 1.0
    assert t.stats.dropped >= 2000 - 64 - 512 and t.stats.queued <= 64
    start = time.monotonic()
    t.shutdown(deadline_s=0.5)
    assert time.monotonic() - start < 2.0
    t.shutdown()                                 # idempotent
    stuck.release.set()                          # the stuck batch ends (and is counted) here
    deadline = time.monotonic() + 5
    while t.stats.failed_batches == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert t.stats.failed >= 64


def test_evidence_of_any_shape_becomes_valid_attributes():
    ev = {"big": 1 << 70, "nan": float("nan"), "mixed": [1, "a"], "empty": [],
          "nested": {"a": [{"b": None}]}, "text": "x" * 10000, "flags": [True, False]}
    a = otlp.evidence_attributes(ev)
    assert a["mmtrace.evidence.big"] == str(1 << 70)
    assert a["mmtrace.evidence.flags"] == [True, False]
    assert json.loads(a["mmtrace.evidence.mixed"]) == [1, "a"]
    assert len(a["mmtrace.evidence.text"]) == otlp.MAX_ATTRIBUTE_TEXT
    assert otlp.evidence_attributes("odd") == {"mmtrace.evidence": '"odd"'}


# ---------------------------------------------------------------- options

def test_options_come_from_config_then_the_standard_variables():
    o = otlp.options_from(env={})
    assert not o.enabled
    o = otlp.options_from(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"})
    assert o.enabled and o.endpoint == "http://c:4318/v1/traces"
    o = otlp.options_from(env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/v1/traces"})
    assert o.endpoint == "http://t/v1/traces"
    o = otlp.options_from("http://cfg/v1/traces", "api-key=a%20b,x=1", 0.5,
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env",
                               "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                               "OTEL_TRACES_SAMPLER_ARG": "0.25",
                               "OTEL_EXPORTER_OTLP_TIMEOUT": "2500"})
    assert o.endpoint == "http://cfg/v1/traces" and o.headers == {"api-key": "a b", "x": "1"}
    assert o.sample_ratio == 0.25 and o.timeout_s == 2.5
    assert not otlp.options_from("http://x", env={"OTEL_SDK_DISABLED": "true"}).enabled
    assert otlp.options_from("http://x", env={"OTEL_TRACES_SAMPLER": "always_off"}).sample_ratio == 0


@pytest.mark.parametrize("kw,env,message", [
    ({"headers": "novalue"}, {}, "expected key=value"),
    ({"sample_ratio": 2.0}, {}, "expected a number in 0..1"),
    ({}, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "lots"}, "ratio"),
    ({}, {"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}, "milliseconds"),
    ({}, {"OTEL_BSP_MAX_QUEUE_SIZE": "-3"}, "positive integer"),
])
def test_bad_options_name_what_was_expected(kw, env, message):
    with pytest.raises(ValueError, match=message):
        otlp.options_from("http://x", **kw, env=env)


# ------------------------------------------------- the daemon, over HTTP

def attrs(span):
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def daemon_with(tmp_path, endpoint, monkeypatch):
    monkeypatch.setenv("OTEL_SERVICE_NAME", "mmtrace-test")
    cfg = config_mod.DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock",
                                  flight_min_interval_s=0.0)
    cfg.otlp.endpoint = endpoint
    cfg.otlp.sample_ratio = 1.0
    daemon = Daemon(cfg)
    daemon.server = HintServer(cfg.socket)
    return daemon, connect(cfg.socket)


def test_the_daemon_exports_anomalies_and_submissions_over_otlp_http(tmp_path, monkeypatch):
    receiver = Receiver()
    daemon, client = daemon_with(tmp_path, receiver.url, monkeypatch)
    try:
        send_entropy_rise(daemon, client, time.monotonic_ns() - 7 * 10**9)
        aligned = launches(4)
        batch = np.zeros(5, device_stream.DEV_EVENT)
        for name in device_stream.DEV_EVENT.names:
            batch[name][:4] = aligned[name]
        sync = batch[4:]
        sync["ts_ns"], sync["duration_ns"], sync["pid"], sync["tid"] = 10**9 + 10**6, 1000, 70, 71
        sync["api"] = api_id("cudaDeviceSynchronize")
        sync["flags"] = device_stream.FLAG_RETURNED
        feed_device(daemon, batch)
    finally:
        daemon.close()
        receiver.close()
    by_name = {span.name: (service, span) for service, span in receiver.spans}
    service, span = by_name["anomaly attention_entropy entropy_rise"]
    a = attrs(span)
    assert service["service.name"] == "mmtrace-test"
    assert a["mmtrace.modality"] == "vision" and a["mmtrace.state"] == "firing"
    assert "enc.0.attn" in a["mmtrace.evidence.heads"]
    assert a["mmtrace.flight_recording"].endswith(".mmtr")
    # wall clock: within a minute of now
    assert abs(span.end_time_unix_nano - time.time_ns()) < 60 * 10**9
    launches_seen = sorted(attrs(s)["mmtrace.op_id"] for _, s in receiver.spans
                           if attrs(s).get("mmtrace.kind") == "launch")
    assert launches_seen == [1, 2, 3, 4]
    assert daemon.otlp.stats.exported == len(receiver.spans)


def test_a_dead_collector_leaves_the_daemon_running_and_counts_failures(tmp_path, monkeypatch):
    with socket.socket() as s:          # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "500")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    daemon, client = daemon_with(tmp_path, f"http://127.0.0.1:{port}/v1/traces", monkeypatch)
    try:
        slowest = 0.0
        send_entropy_rise(daemon, client, time.monotonic_ns() - 7 * 10**9)
        deadline = time.monotonic() + 10
        while daemon.otlp.stats.failed == 0 and time.monotonic() < deadline:
            t0 = time.monotonic()
            daemon.tick()
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.02)
    finally:
        daemon.close()
    assert any(a.get("state") == "firing" for a in daemon.alarms.anomalies)
    assert daemon.otlp.stats.failed >= 1 and daemon.otlp.stats.failed_batches >= 1
    assert slowest < 0.25, f"a tick took {slowest:.3f} s while the collector was down"
    # ... and the failures are in the metrics
    from prometheus_client import generate_latest
    from mmtrace.exporters.live import prometheus
    text = generate_latest(prometheus.registry_for(daemon.metrics_snapshot, prometheus.Labels())).decode()
    failed = re.search(r'^mmtrace_otlp_spans_total\{outcome="failed"\} (\S+)$', text, re.M)
    assert failed and float(failed.group(1)) == daemon.otlp.stats.failed
    assert re.search(r"^mmtrace_otlp_export_failures_total [1-9]", text, re.M)
