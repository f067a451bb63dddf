"""`mmtrace run`: the per-node daemon.

One loop, one direction: probes -> ingest -> align -> detectors ->
(flight recorder, hints). Every tick it drains the rings, aligns the device
events, keeps the recent past in bounded rings, cuts the latency series for
P99 drift, takes the dispatchers' messages from the hint socket (request
latencies, attention entropy), and acts on what the detectors say.
"""

import logging
import os
from collections import deque
import platform
import re
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream
from mmtrace.detectors.entropy_drift import EntropyDriftDetector
from mmtrace.detectors.p99_drift import P99Drift
from mmtrace.exporters import status as status_view

from . import latency_series as ls
from . import probes as probe_loader
from .align import ApiRoles, Aligner
from .config import DaemonConfig
from .dev_names import DeviceNames
from .errors import MmtraceError
from .device_view import describe
from .event_ring import EventRing
from .flight import FlightRecorder
from .hint_socket import HintServer
from .record import CPU_PROBE_STATE, DeviceSources, StopFlag
from .steering import Steering
from .threads import ThreadProcesses

log = logging.getLogger("mmtrace.daemon")

ENTROPY_SAMPLE = np.dtype([("ts_ns", "<u8"), ("value", "<f8"), ("head", "<u4"),
                           ("layer", "<u4"), ("modality", "<u4"), ("reserved", "<u4")])
REQUEST_SAMPLE = np.dtype([("ts_ns", "<u8"), ("value_s", "<f8"), ("series", "<u4"),
                           ("reserved", "<u4")])
SCHEMAS = {"cpu.runq": sched_stream.RUNQ_EVENT, "dev.event": device_stream.DEV_EVENT,
           "model.entropy": ENTROPY_SAMPLE, "request.latency": REQUEST_SAMPLE}
MAX_CLIENT_SERIES = 256
SWEEP_INTERVAL_S = 10.0
PID_IN_SERIES = re.compile(r"\bpid=(\d+)")


class Names:
    """String tables for the sample schemas (bounded)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.ids: dict[str, int] = {}

    def id(self, name: str) -> int | None:
        got = self.ids.get(name)
        if got is None and len(self.ids) < self.limit:
            got = self.ids[name] = len(self.ids)
        return got

    def table(self) -> list[str]:
        return list(self.ids)


class Daemon:
    def __init__(self, config: DaemonConfig, stop: StopFlag | None = None):
        self.config = config
        self.stop = stop or StopFlag()
        p = config.p99
        self.p99 = P99Drift(window_s=p.window_s, baseline_windows=p.baseline_windows,
                            min_baseline_windows=p.min_baseline_windows, factor=p.factor,
                            floor=p.floor_s, consecutive=p.consecutive,
                            min_samples=p.min_samples, clear_factor=p.clear_factor,
                            clear_windows=p.clear_windows)
        e = config.entropy
        self.entropy = EntropyDriftDetector(tau=e.tau, consecutive=e.consecutive,
                                            delta_sigma=e.delta_sigma)
        age = int(config.ring_seconds * 1e9)
        self.runq_ring = EventRing(sched_stream.RUNQ_EVENT, config.ring_capacity, age)
        self.entropy_ring = EventRing(ENTROPY_SAMPLE, 1 << 16, age)
        self.request_ring = EventRing(REQUEST_SAMPLE, 1 << 16, age)
        infos = self.infos = device_stream.default_infos()
        self.aligner = Aligner(ApiRoles.from_infos(infos),
                               capacity=config.device_ring_capacity, max_age_ns=age)
        self.names = DeviceNames(infos)
        self.op_names: list[list] = []
        self.op_name_of: dict[tuple[int, int], str] = {}
        self.submitters = ls.Submitters()
        self.threads = ThreadProcesses()
        self.flight = FlightRecorder(config.state_dir, config.ring_seconds,
                                     config.flight_min_interval_s)
        self.layers = Names(4096)
        self.modalities = Names(64)
        self.request_series = Names(MAX_CLIENT_SERIES)
        self.anomalies: list[dict] = []
        self.hints_sent = 0
        self.recent_hints: deque[dict] = deque(maxlen=status_view.MAX_HINTS)
        self.started_ns = time.monotonic_ns()
        self._counters_at_start: dict[str, int] = {}
        self.loaded = None
        self.sources = None
        self.server = None
        self.probe_states: list[dict] = [CPU_PROBE_STATE]
        self.proc_root = Path("/proc")
        self._next_sweep = 0.0
        self.forgotten_series = 0
        self.otlp = _otlp_traces(config, lambda rows: describe(rows, self.infos, self.op_name_of))
        # The hint policy; steering.inputs.device_weights is where device weights go.
        self.steering = Steering(config.policy, hint_id=lambda seq: f"{os.getpid()}-{seq}")

    # ------------------------------------------------------------ lifecycle

    def start(self):
        cfg = self.config
        options = probe_loader.ProbeOptions(pids=tuple(cfg.pids),
                                            trace_launches=not cfg.adaptive_launches)
        self.sources = DeviceSources(cfg.libs, cfg.pids, discover=True)
        self.loaded = probe_loader.load(options)
        self._counters_at_start = self.loaded.counters()
        try:
            self.server = HintServer(cfg.socket)
        except OSError as exc:
            log.error("hint socket %s unavailable (%s); running without it", cfg.socket, exc)
        self._attach_new()
        log.info("tracing: pids=%s, per-launch probes %s, flight recordings in %s",
                 list(cfg.pids) or "all", "on alarm" if cfg.adaptive_launches else "on",
                 cfg.state_dir)

    def close(self):
        if self.otlp is not None:
            self.otlp.shutdown()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.loaded is not None:
            self.loaded.close()
            self.loaded = None

    def run(self):
        self.start()
        try:
            while not self.stop:
                self.tick()
                time.sleep(self.config.tick_s)
        finally:
            self.close()
        log.info("stopped by %s", self.stop.reason or "request")

    # ----------------------------------------------------------------- tick

    def tick(self, now_ns: int | None = None):
        if self.sources is not None and self._device() is not None:
            self._attach_new()
        batches = self.loaded.read() if self.loaded is not None else {}
        for stream, batch in batches.items():
            learnt = self.threads.fill(batch)
            if learnt:
                self.loaded.learn_threads(learnt)
            if stream == "cpu":
                self._on_runq(batch)
            else:
                self._on_device(batch)
        if self.server is not None:
            self._on_messages(self.server.poll(0))
        now_ns = now_ns or time.monotonic_ns()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            self.forget_exited()
        self._act(self.p99.advance(now_ns - int(self.config.p99.window_s * 1e9 / 4)))
        self._steer(now_ns)

    def forget_exited(self):
        """Series of processes that have exited are reset: a pid's alarm must
        not stay firing for ever, nor greet the next process given that pid."""
        for name in self.p99.names:
            match = PID_IN_SERIES.search(name)
            if match and self.p99.state(name) != "normal" and \
                    not (self.proc_root / match.group(1)).exists():
                self.p99.reset(name)
                self.steering.inputs.forget(("series", name))
                self.forgotten_series += 1

    def _device(self):
        return self.loaded.device if self.loaded is not None else None

    def _attach_new(self):
        for target in self.sources.targets():
            states = self.loaded.device.add(target)
            self.probe_states += [s.as_dict() for s in states]

    def _on_runq(self, batch):
        self.runq_ring.push(batch)
        self._observe(ls.runq_series(self.p99.series_id, batch, self.submitters))

    def _on_device(self, batch):
        rows = self.names.process(batch)
        if rows:
            self.op_names = (self.op_names + rows)[-(1 << 16):]
            self.op_name_of.update(((pid, addr), name) for pid, addr, name in rows)
            if len(self.op_name_of) > 2 * len(self.op_names):      # bounded like the list
                self.op_name_of = {(pid, addr): name for pid, addr, name in self.op_names}
        self.submitters.learn(batch)
        aligned = self.aligner.push(batch)
        self._observe(ls.sync_series(self.p99.series_id, aligned))
        self._observe(ls.retire_series(self.p99.series_id, self.aligner.last_retired))
        if self.otlp is not None:
            self.otlp.submissions(self.aligner.last_retired)

    def _observe(self, series: ls.Series):
        if len(series):
            self._act(self.p99.observe(series.ids, series.ts_ns, series.values_s,
                                       series.contributors))

    def _on_messages(self, messages):
        requests = []
        for client, msg in messages:
            self.steering.inputs.on_message(client.pid, msg)
            ts = int(msg.get("ts_ns") or time.monotonic_ns())
            if msg["type"] == "entropy":
                samples = [{**s, "modality": s.get("modality", msg["modality"])}
                           for s in (msg.get("values") or [msg]) if isinstance(s, dict)]
                self._keep_entropy(samples, msg["modality"], ts)
                try:
                    self._act(self.entropy.update(samples, ts_ns=ts))
                except ValueError as exc:
                    self.server.reply(client, {"v": 1, "type": "error",
                                               "message": f"entropy: {exc}"})
            elif msg["type"] == "status":
                self.server.reply(client, self.status())
            elif msg["type"] == "sample":
                name = f"request_latency{{series={msg['series']},modality={msg['modality']}}}"
                sid = self.request_series.id(name)
                if sid is None:
                    self.server.reply(client, {"v": 1, "type": "error", "message":
                                               f"more than {MAX_CLIENT_SERIES} request series; "
                                               f"{name} ignored"})
                    continue
                requests.append((self.p99.series_id(name), ts, msg["value_ms"] / 1e3, sid))
        if requests:
            ids, ts, values, sids = (np.array(c) for c in zip(*requests))
            self._act(self.p99.observe(ids, ts, values))
            rec = np.zeros(len(ids), REQUEST_SAMPLE)
            rec["ts_ns"], rec["value_s"], rec["series"] = ts, values, sids
            self.request_ring.push(rec)

    def _keep_entropy(self, samples, modality, ts):
        rows = [(s.get("layer"), s.get("head"), s.get("value"), s.get("modality", modality))
                for s in samples if isinstance(s, dict)]
        rec = np.zeros(len(rows), ENTROPY_SAMPLE)
        kept = 0
        for layer, head, value, mod in rows:
            lid, mid = self.layers.id(str(layer)), self.modalities.id(str(mod))
            if lid is None or mid is None or not isinstance(head, int):
                continue
            if not isinstance(value, (int, float)):
                continue
            rec[kept] = (ts, float(value), head, lid, mid, 0)
            kept += 1
        self.entropy_ring.push(rec[:kept])

    # -------------------------------------------------------------- status

    def status(self, span_s: float = 5.0) -> dict:
        """What `mmtrace top` shows: the last span_s seconds per process,
        the active anomalies, the latest hints, and the losses."""
        now = time.monotonic_ns()
        span_s = min(span_s, max(1e-3, (now - self.started_ns) / 1e9))   # rates over what was seen
        since = now - int(span_s * 1e9)
        processes = status_view.process_table(self.runq_ring.window(since),
                                               self.aligner.window(since),
                                               self.submitters.tids, span_s)
        device = self._device()
        return {"v": 1, "type": "status", "daemon_pid": os.getpid(),
                "uptime_s": (now - self.started_ns) / 1e9, "span_s": round(span_s, 3),
                "launch_probes": ("on" if not self.config.adaptive_launches else
                                  "burst" if device is not None and device.launches_attached()
                                  else "on alarm"),
                "processes": processes,
                "anomalies": status_view.active_anomalies(self.anomalies),
                "hints": list(self.recent_hints), "hints_sent": self.hints_sent,
                "policy": self.steering.summary(),
                "losses": self.losses()}

    def losses(self) -> dict[str, int]:
        """Everything lost since the daemon started, by counter, non-zero only."""
        out = {}
        if self.loaded is not None:
            now = self.loaded.counters()
            out = {f"kernel.{name}": now.get(name, 0) - self._counters_at_start.get(name, 0)
                   for name in bpf_counters.LOSS_COUNTERS}
        if self.otlp is not None:
            out["otlp.spans_failed"] = self.otlp.stats.failed
            out["otlp.spans_dropped"] = self.otlp.stats.dropped
        return {k: v for k, v in out.items() if v}

    # ------------------------------------------------------------- actions

    def _act(self, anomalies: list[dict]):
        for anomaly in anomalies:
            self.steering.inputs.on_anomaly(anomaly)
            self.anomalies.append(anomaly)
            del self.anomalies[:-1000]
            firing = anomaly.get("state") == "firing"
            log.warning("anomaly %s %s %s", anomaly.get("detector"),
                        anomaly.get("series") or anomaly.get("kind"), anomaly.get("state"))
            if not firing:
                continue
            path = self._flight_record(anomaly)
            if path is not None:
                anomaly["flight_recording"] = str(path)
                log.warning("flight recording: %s", path)
            if self.config.adaptive_launches and self._device() is not None:
                # The next minutes complete: per-launch probes on for a while.
                self._device().attach_launches(self.config.launch_burst_s)
        if anomalies and self.otlp is not None:
            self.otlp.anomalies(anomalies)

    def _flight_record(self, anomaly):
        windows = {"cpu.runq": self.runq_ring.window(),
                   "dev.event": _plain_device(self.aligner.window()),
                   "model.entropy": self.entropy_ring.window(),
                   "request.latency": self.request_ring.window()}
        meta = [{"apis": device_stream.default_table().to_json(),
                 "probes": self.probe_states,
                 "symbol_names": {str(k): v for k, v in
                                  (self._device().symbol_names().items()
                                   if self._device() is not None else [])},
                 "op_names": self.op_names,
                 "entropy_layers": self.layers.table(),
                 "modalities": self.modalities.table(),
                 "request_series": self.request_series.table(),
                 "hint_audit": self.steering.audit(),
                 "host": platform.node(), "daemon_pid": os.getpid(),
                 "config": _jsonable(asdict(self.config))}]
        return self.flight.dump(windows, SCHEMAS, anomaly, meta, time.monotonic_ns())

    def _steer(self, now_ns: int):
        """Send what the hint policy decides now (nothing in dry-run: the
        audit log has every decision)."""
        for hint in self.steering.step(now_ns):
            self.recent_hints.append({k: hint[k] for k in ("id", "kind", "target", "value",
                                                           "ttl_s", "reason", "issued_ns")})
            log.warning("hint %s %s -> %s: %s", hint["kind"], hint["target"], hint["value"],
                        hint["reason"])
            if self.server is not None:
                self.hints_sent += self.server.broadcast(hint)


def _otlp_traces(config: DaemonConfig, describe_rows):
    """The OTLP sink when an endpoint is configured (config or OTEL_*), else None."""
    from mmtrace.exporters import otlp
    o = config.otlp
    try:
        options = otlp.options_from(o.endpoint, o.headers, o.sample_ratio, o.max_spans_per_s)
    except ValueError as exc:
        raise MmtraceError(f"OTLP: {exc}") from None
    if not options.enabled:
        return None
    log.info("OTLP traces to %s (submissions sampled at %g)",
             options.endpoint or "the OTEL_* endpoint", options.sample_ratio)
    return otlp.OtlpTraces(options, describe=describe_rows)


def _plain_device(aligned: np.ndarray) -> np.ndarray:
    out = np.zeros(len(aligned), device_stream.DEV_EVENT)
    for name in device_stream.DEV_EVENT.names:
        out[name] = aligned[name]
    return out


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
