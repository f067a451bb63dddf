"""OpenTelemetry traces over OTLP/HTTP.

Every anomaly becomes a span whose attributes are its evidence; a sample of
the aligned GPU/NPU submissions become spans from the call to the sync that
retired it. Times are CLOCK_MONOTONIC in the daemon and wall clock in the
spans, converted with an offset taken at each hand-over.

The SDK's BatchSpanProcessor sends from a thread of its own. Its queue is
bounded, and this module keeps count of what is in it, so a dead or slow
collector costs dropped spans, counted, and never a stalled daemon loop.
Where the collector is configured comes from the standard OTEL_* variables
(OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, ..._HEADERS, ..._TIMEOUT,
OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER[_ARG],
OTEL_BSP_SCHEDULE_DELAY, OTEL_BSP_MAX_QUEUE_SIZE, OTEL_SDK_DISABLED) and from the daemon's `[otlp]` config section.
"""

import json
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

from mmtrace.exporters.live.otlp_options import OtlpOptions, options_from, parse_headers  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)

MAX_ATTRIBUTE_TEXT = 4096
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass
class OtlpStats:
    """Counters for the metrics: spans handed to the SDK and their fate."""
    anomaly_spans: int = 0
    submission_spans: int = 0
    exported: int = 0          # spans the collector took
    failed: int = 0            # spans in batches the collector refused or never got
    failed_batches: int = 0
    dropped: int = 0           # spans not queued: the queue was full (collector behind)
    capped: int = 0            # sampled submissions over the per-second cap

    @property
    def queued(self) -> int:
        return self.anomaly_spans + self.submission_spans - self.exported - self.failed


class CountingExporter(SpanExporter):
    """Wraps the real exporter: counts what it took and what failed, and
    logs a failure at most once a minute (a dead collector is one line a
    minute, not one a batch)."""

    def __init__(self, inner: SpanExporter, stats: OtlpStats, clock=time.monotonic):
        self.inner = inner
        self.stats = stats
        self.clock = clock
        self._lock = threading.Lock()
        self._next_log = 0.0
        self._failures_since_log = 0

    def export(self, spans) -> SpanExportResult:
        try:
            result = self.inner.export(spans)
        except Exception as exc:  # an exporter must not kill the SDK's worker
            result = SpanExportResult.FAILURE
            self._failed(len(spans), f"{type(exc).__name__}: {exc}")
        else:
            if result is SpanExportResult.SUCCESS:
                with self._lock:
                    self.stats.exported += len(spans)
            else:
                self._failed(len(spans), "the exporter reported failure")
        return result

    def _failed(self, n: int, why: str):
        with self._lock:
            self.stats.failed += n
            self.stats.failed_batches += 1
            self._failures_since_log += 1
            now = self.clock()
            if now < self._next_log:
                return
            self._next_log = now + 60.0
            count, self._failures_since_log = self._failures_since_log, 0
        log.warning("OTLP export failed (%d batch(es) since the last report, %d spans lost "
                    "in all): %s", count, self.stats.failed, why)

    def shutdown(self):
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class OtlpTraces:
    """The daemon's OTLP sink. `exporter` replaces the OTLP/HTTP one (tests
    hand in the SDK's InMemorySpanExporter). `describe(rows)` gives, for
    aligned device rows, per-row dicts of names (api, stream, kind,
    op_name, direction); `clock_offset_ns()` the wall-minus-monotonic
    offset."""

    def __init__(self, options: OtlpOptions, *, describe=None, exporter: SpanExporter | None = None,
                 clock_offset_ns=None, wall_clock=time.monotonic):
        self.options = options
        self.stats = OtlpStats()
        self.describe = describe or (lambda rows: [{} for _ in range(len(rows))])
        self.clock_offset_ns = clock_offset_ns or (lambda: time.time_ns() - time.monotonic_ns())
        self._wall = wall_clock
        self._budget = options.max_submission_spans_per_s
        self._budget_at = wall_clock()
        self._closed = False
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=options.endpoint, headers=options.headers,
                                        timeout=options.timeout_s)
        self._exporter = CountingExporter(exporter, self.stats)
        resource = Resource.create(options.resource)     # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "mmtrace"}))
        self._provider = TracerProvider(resource=resource)
        self._processor = BatchSpanProcessor(self._exporter, max_queue_size=options.max_queue,
                                             schedule_delay_millis=options.schedule_delay_ms,
                                             max_export_batch_size=min(512, options.max_queue))
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("mmtrace")

    # ------------------------------------------------------------ anomalies

    def anomalies(self, anomalies: list[dict]) -> None:
        if self._closed:
            return
        offset = self.clock_offset_ns()
        for anomaly in anomalies:
            if not self._room():
                continue
            ts = _int(anomaly.get("ts_ns")) or time.monotonic_ns()
            evidence = anomaly.get("evidence") or {}
            start = ts
            windows = evidence.get("windows") if isinstance(evidence, dict) else None
            if isinstance(windows, list) and windows and isinstance(windows[0], dict):
                start = _int(windows[0].get("start_ns")) or ts
            what = anomaly.get("series") or anomaly.get("kind") or ""
            attributes = {"mmtrace.detector": str(anomaly.get("detector", "")),
                          "mmtrace.state": str(anomaly.get("state", "")),
                          "mmtrace.series": str(what)}
            if anomaly.get("modality") is not None:
                attributes["mmtrace.modality"] = str(anomaly["modality"])
            if anomaly.get("flight_recording"):
                attributes["mmtrace.flight_recording"] = str(anomaly["flight_recording"])
            attributes.update(evidence_attributes(evidence))
            span = self._tracer.start_span(f"anomaly {anomaly.get('detector', '')} {what}".strip(),
                                           kind=SpanKind.INTERNAL, start_time=min(start, ts) + offset,
                                           attributes=attributes)
            span.end(end_time=ts + offset)
            self.stats.anomaly_spans += 1

    # ---------------------------------------------------------- submissions

    def submissions(self, retired: np.ndarray) -> None:
        """Aligned submissions retired in this batch (align.ALIGNED_EVENT with
        retired_ns set): a deterministic sample of them become spans."""
        if self._closed or not len(retired) or self.options.sample_ratio <= 0:
            return
        chosen = retired[sampled(retired, self.options.sample_ratio)]
        if not len(chosen):
            return
        allowed = self._take_budget(len(chosen))
        if allowed < len(chosen):
            self.stats.capped += len(chosen) - allowed
            chosen = chosen[:allowed]
        offset = self.clock_offset_ns()
        described = self.describe(chosen)
        for i, (row, names) in enumerate(zip(chosen, described)):
            if not self._room():
                self.stats.dropped += len(chosen) - i - 1      # _room counted this one
                break
            attributes = submission_attributes(row, names)
            start, end = int(row["ts_ns"]), int(row["retired_ns"])
            span = self._tracer.start_span(str(names.get("op_name") or names.get("api") or "submission"),
                                           kind=SpanKind.CLIENT, start_time=start + offset,
                                           attributes=attributes)
            span.end(end_time=max(end, start) + offset)
            self.stats.submission_spans += 1

    # ------------------------------------------------------------- shutdown

    def shutdown(self, deadline_s: float = 5.0) -> None:
        """Flush what is queued and stop, within the deadline; idempotent."""
        if self._closed:
            return
        self._closed = True

        def flush_and_stop():
            # Both can block on an export in flight (the SDK holds its lock
            # through it), so they run where the deadline can leave them.
            self._processor.force_flush(int(deadline_s * 1000))
            self._provider.shutdown()

        done = threading.Thread(target=flush_and_stop, name="otlp-shutdown", daemon=True)
        done.start()
        done.join(max(0.0, deadline_s))
        if done.is_alive():
            log.warning("OTLP exporter still busy after %.1f s at shutdown; %d span(s) left "
                        "unsent", deadline_s, self.stats.queued)

    # ------------------------------------------------------------- internals

    def _room(self) -> bool:
        """Room in the SDK's queue: past it the SDK would drop the oldest
        span and log a line per span; here it is one count."""
        if self.stats.queued >= self.options.max_queue:
            self.stats.dropped += 1
            return False
        return True

    def _take_budget(self, wanted: int) -> int:
        now = self._wall()
        rate = self.options.max_submission_spans_per_s
        self._budget = min(rate, self._budget + (now - self._budget_at) * rate)
        self._budget_at = now
        allowed = int(min(wanted, max(0.0, self._budget)))
        self._budget -= allowed
        return allowed


def sampled(rows: np.ndarray, ratio: float) -> np.ndarray:
    """Which rows are in the sample: a hash of (pid, op_id), so one
    submission is in or out whatever batch carries it."""
    if ratio >= 1.0:
        return np.ones(len(rows), bool)
    key = rows["pid"].astype(np.uint64) << np.uint64(40) ^ rows["op_id"].astype(np.uint64)
    with np.errstate(over="ignore"):
        mixed = key * _GOLDEN
        mixed ^= mixed >> np.uint64(29)
    return mixed < np.uint64(min(int(ratio * 2.0 ** 64), (1 << 64) - 1))

def submission_attributes(row, names: dict) -> dict:
    attributes = {"mmtrace.pid": int(row["pid"]), "mmtrace.tid": int(row["tid"]),
                  "mmtrace.comm": bytes(row["comm"]).rstrip(b"\0").decode("utf-8", "replace"),
                  "mmtrace.op_id": int(row["op_id"]),
                  "mmtrace.handle": int(row["handle"]),
                  "mmtrace.stream_handle": int(row["stream_handle"]),
                  "mmtrace.sched_delay_ns": int(row["sched_delay_ns"]),
                  "mmtrace.submit_to_retire_ns": max(0, int(row["retired_ns"]) - int(row["ts_ns"]))}
    for key in ("stream", "kind", "api", "op_name", "direction"):
        if names.get(key) is not None:
            attributes[f"mmtrace.{key}"] = str(names[key])
    if names.get("kind") == "launch":
        attributes["mmtrace.grid"] = [int(row["grid_x"]), int(row["grid_y"]), int(row["grid_z"])]
        attributes["mmtrace.block"] = [int(row["block_x"]), int(row["block_y"]), int(row["block_z"])]
        attributes["mmtrace.shared_mem_bytes"] = int(row["shared_mem_bytes"])
    if names.get("kind") == "memcpy":
        attributes["mmtrace.bytes"] = int(row["bytes"])
    if int(row["device"]) >= 0:
        attributes["mmtrace.device"] = int(row["device"])
    return attributes


def evidence_attributes(evidence, prefix: str = "mmtrace.evidence") -> dict:
    """An anomaly's evidence as span attributes: scalars and lists of one
    scalar type as they are, anything else as bounded JSON text."""
    out = {}
    if not isinstance(evidence, dict):
        return {prefix: _text(evidence)}
    for key, value in evidence.items():
        name = f"{prefix}.{key}"
        if isinstance(value, (bool, int, float, str)):
            out[name] = _scalar(value)
        elif isinstance(value, (list, tuple)) and value and \
                len({type(v) for v in value}) == 1 and isinstance(value[0], (bool, int, float, str)):
            out[name] = [_scalar(v) for v in value]
        else:
            out[name] = _text(value)
    return out


def _scalar(value):
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 63):
        return str(value)
    if isinstance(value, str):
        return value[:MAX_ATTRIBUTE_TEXT]
    return value


def _text(value) -> str:
    return json.dumps(value, default=str, allow_nan=True)[:MAX_ATTRIBUTE_TEXT]


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
