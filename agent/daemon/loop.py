"""`mmtrace run`: the per-node daemon.

One loop, one direction: probes -> ingest -> align -> detectors ->
(flight recorder, hints). Every tick it drains the rings, aligns the device
events, keeps the recent past in bounded rings, cuts the latency series for
P99 drift, takes the dispatchers' messages from the hint socket (request
latencies, attention entropy), and acts on what the detectors say.
"""

import logging
import os
import platform
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import asdict
from pathlib import Path

import numpy as np

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream
from mmtrace.detectors.entropy_drift import EntropyDriftDetector
from mmtrace.detectors.p99_drift import P99Drift
from mmtrace.exporters.devices import npu_smi
from mmtrace.exporters.devices import nvml
from mmtrace.exporters.live import prometheus
from mmtrace.exporters.devices.device_state import GPU_STATE, state_records
from mmtrace.exporters.live import status as status_view
from mmtrace.exporters.live.event_counts import EventCounts

from mmtrace.agent.kernel import compiler_memory

from mmtrace.agent import heap
from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.kernel import probes as probe_loader
from mmtrace.agent.ingest.align import ApiRoles, Aligner
from mmtrace.agent.config.settings import DaemonConfig, EntropySettings, P99Settings
from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.recording.device_view import describe
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.ingest.packed_ring import PackedRing
from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.socket.hint_socket import HintServer
from mmtrace.agent.ingest.pipeline import Ingest
from mmtrace.agent.log_limit import RateLimitedLog
from mmtrace.agent.kernel.device_compile import DeviceCompile, device_programs_failed
from mmtrace.agent.kernel.device_sources import DeviceSources, attach_and_release
from mmtrace.agent.kernel.probes import CPU_PROBE_STATE
from mmtrace.agent.ingest.device_names import exited_process_resolver
from mmtrace.agent.recording.meta_budget import fit_meta
from mmtrace.agent.stop_flag import StopFlag
from mmtrace.agent.daemon.reload import ReloadRequest, reload
from mmtrace.agent.daemon.sd_notify import Notifier
from mmtrace.agent.ingest.series_keys import REQUEST, SeriesKey
from mmtrace.agent.daemon.signals import DumpRequest
from mmtrace.agent.socket.telemetry import (ENTROPY_SAMPLE, MAX_CLIENT_SERIES, MAX_MODALITIES,
                               REQUEST_SAMPLE, Samples)
from mmtrace.agent.daemon.steering import Steering
from mmtrace.agent.ingest.threads import ThreadProcesses
from mmtrace.agent.daemon.wakeups import Waiter

log = logging.getLogger("mmtrace.daemon")

SCHEMAS = {"cpu.runq": sched_stream.RUNQ_EVENT, "dev.event": device_stream.DEV_EVENT,
           "model.entropy": ENTROPY_SAMPLE, "request.latency": REQUEST_SAMPLE,
           "gpu.state": GPU_STATE}
GPU_SAMPLE_INTERVAL_NS = 10**9
MAX_ENTROPY_HEADS = 8192   # (layer, head) pairs per modality
MAX_SENDERS_PER_SERIES = 256   # processes a request series' hints may reach
SWEEP_INTERVAL_S = 10.0        # an idle agent's heap trim
# Exited processes' series go this often: ~23 KiB each, and with 16
# processes of 400 ms at a time, 10 s held some 400 processes' series.
EXITED_SWEEP_INTERVAL_S = 2.0
HEAP_TRIM_INTERVAL_S = 0.5
TRIM_AFTER_RECORDS = 5000      # records drained since the last trim that call for one
STATUS_MIN_INTERVAL_S = 0.5
DUMP_REUSE_S = 5.0          # socket dump requests this close share one file
MAX_IDLE_WAIT_S = 0.25      # the longest sleep without data (see Daemon.idle_wait_s)


def p99_detector(p: P99Settings) -> P99Drift:
    return P99Drift(window_s=p.window_s, baseline_windows=p.baseline_windows,
                    min_baseline_windows=p.min_baseline_windows, factor=p.factor,
                    floor=p.floor_s, consecutive=p.consecutive, min_samples=p.min_samples,
                    clear_factor=p.clear_factor, clear_windows=p.clear_windows)


def entropy_detector(e: EntropySettings) -> EntropyDriftDetector:
    # Heads and modalities come from clients: bounded so that no client can
    # grow the agent by more than ~32 MB (8 x 8192 heads with 256-character
    # layer names), with room for an 80-layer, 64-head model per modality.
    return EntropyDriftDetector(tau=e.tau, consecutive=e.consecutive, delta_sigma=e.delta_sigma,
                                max_heads=MAX_ENTROPY_HEADS, max_modalities=MAX_MODALITIES)


class Daemon:
    def __init__(self, config: DaemonConfig, stop: StopFlag | None = None):
        self.config = config
        self.stop = stop or StopFlag()
        self.p99 = p99_detector(config.p99)
        self.entropy = entropy_detector(config.entropy)
        age = int(config.ring_seconds * 1e9)
        # The highest-rate stream: its reach is held compressed.
        self.runq_ring = PackedRing(sched_stream.RUNQ_EVENT, config.ring_capacity, age)
        self.entropy_ring = EventRing(ENTROPY_SAMPLE, 1 << 16, age)
        self.request_ring = EventRing(REQUEST_SAMPLE, 1 << 16, age)
        self.gpu_state_ring = EventRing(GPU_STATE, 1 << 12, age)   # NVML, once a second
        self._next_gpu_sample = 0
        infos = self.infos = device_stream.default_infos()
        self.aligner = Aligner(ApiRoles.from_infos(infos), capacity=config.device_ring_capacity,
                               max_age_ns=age, compress=True)
        self.names = DeviceNames(infos)
        self.series_keys: dict[str, SeriesKey] = {}   # the P99 series' names -> their keys
        self.ingest: Ingest | None = None           # once the CPU stream is loaded (start)
        self.op_names: list[list] = []
        self.op_name_of: dict[tuple[int, int], str] = {}
        self._names_exited_ns: dict[int, int] = {}   # pid -> when its exit was seen
        self.submitters = ls.Submitters()
        self.threads = ThreadProcesses()
        self.flight = FlightRecorder(config.state_dir, config.ring_seconds,
                                     config.flight_min_interval_s)
        self.samples = Samples(config.ring_seconds)     # dispatchers' samples, as records
        # Who may be steered by each request series: the processes (by the
        # kernel's SO_PEERCRED) whose samples make it. A client's word moves
        # only its own dispatchers; hints from the kernel's streams go to all.
        self.request_senders: dict[str, OrderedDict[int, None]] = {}
        self.entropy_senders: dict[str, OrderedDict[int, None]] = {}   # per entropy modality
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
        self.waiter = Waiter()
        self._devices = None                # DeviceCompile while the GPU/NPU programs compile
        self._began = 0.0
        self._next_sweep = 0.0
        self._next_exited_sweep = 0.0
        self._next_trim = 0.0
        self._since_trim = 0
        self.forgotten_series = 0
        self.otlp = _otlp_traces(config, lambda rows: describe(rows, self.infos, self.op_name_of))
        # Read by the metrics endpoint's thread: tick() runs under the lock.
        self.lock = threading.Lock()
        self.counts = EventCounts(infos)
        self.anomaly_counts: Counter = Counter()
        self.hint_counts: Counter = Counter()
        self.entropy_latest: dict[str, float] = {}
        self.nvml = None                    # DeviceMonitor of the GPUs
        self.npu = None                     # ... of the Ascend NPUs, where npu-smi is
        self.metrics = None
        self.message_failures = 0       # hint socket messages whose handling raised
        self._log_failure = RateLimitedLog(log)
        self._status_cache: tuple[int, dict] | None = None
        self._last_dump: tuple[float, Path] | None = None
        # The hint policy; steering.inputs.device_weights is where device weights go.
        self.steering = Steering(config.policy, hint_id=lambda seq: f"{os.getpid()}-{seq}")

    # ------------------------------------------------------------ lifecycle

    def start(self, devices_in_background: bool = True):
        """The CPU stream live first; the GPU/NPU programs compile after it,
        in a thread while the loop drains (devices_in_background), or here."""
        cfg = self.config
        began = time.monotonic()
        heap.keep_large_blocks_mapped()
        self.flight.prepare()           # UnsafePathError: another user's state directory
        self._start_exporters()
        options = probe_loader.ProbeOptions(pids=tuple(cfg.pids),
                                            trace_launches=not cfg.adaptive_launches)
        self.sources = DeviceSources(cfg.libs, cfg.pids, discover=True, warn=log.warning,
                                     interval_s=cfg.discover_interval_s)
        self.loaded = probe_loader.load_cpu(options)
        # One round a tick: the tick's other work (socket, detectors) waits for it.
        self.ingest = Ingest(self.loaded, self.threads, sinks=[self], max_rounds=1)
        self._counters_at_start = self.loaded.counters()
        log.info("cpu stream live (%.2f s)", time.monotonic() - began)
        try:
            self.server = HintServer(cfg.socket, idle_timeout_s=cfg.socket_idle_timeout_s)
        except OSError as exc:
            log.error("hint socket %s unavailable (%s); running without it", cfg.socket, exc)
        self._devices = DeviceCompile(self.loaded)
        self._began = began
        while not devices_in_background and self._devices is not None:
            self._wire_devices()
            time.sleep(0.01)

    def _wire_devices(self):
        """Once the GPU/NPU programs are compiled: wire and attach them."""
        devices = self._devices
        if devices is None or not devices.done() or not self.sources.ready():
            return
        self._devices = None
        cfg = self.config
        error = devices.finish()
        if error is not None:
            log.error("GPU/NPU probes unavailable (%s); the CPU stream goes on", error)
            self.probe_states.append(device_programs_failed(error))
        else:
            self.names = DeviceNames(device_stream.default_infos(), resolver=exited_process_resolver(
                self.loaded, self.sources.known_files))
            self.ingest.names = self.names
            self._attach_new()
            compiler_memory.release()       # what the first discovery scan left, too
            log.info("gpu/npu probes live (%.2f s)", time.monotonic() - self._began)
        log.info("tracing: pids=%s, per-launch probes %s, flight recordings in %s",
                 list(cfg.pids) or "all", "on alarm" if cfg.adaptive_launches else "on",
                 cfg.state_dir)

    def _start_exporters(self):
        """The metrics endpoint first: a taken port ends the start at once."""
        cfg = self.config
        if cfg.metrics_address not in ("", "off"):
            labels = prometheus.Labels(cfg.metrics_top_k, cfg.metrics_pid_label)
            self.metrics = prometheus.MetricsEndpoint(
                cfg.metrics_address, prometheus.registry_for(self, labels))
            log.info("metrics on %s/metrics", self.metrics.address)
        if cfg.device_poll_interval_s > 0:
            self.nvml = nvml.monitor(cfg.device_poll_interval_s)
            self.nvml.start()
            if npu_smi.available():
                self.npu = npu_smi.monitor(cfg.device_poll_interval_s)
                self.npu.start()

    def device_state(self) -> dict:
        """Device state for the dispatcher: per GPU / NPU its weight, resource
        profile and the figures they come from; for each source, "up" or why not."""
        out = {}
        for kind, monitor in (("gpus", self.nvml), ("npus", self.npu)):
            out[kind] = [d.as_dict() for d in monitor.devices()] if monitor else []
            out[f"{kind}_source"] = (monitor.error or "up") if monitor else "off"
        return out

    def close(self):
        if self.otlp is not None:
            self.otlp.shutdown()
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        for monitor in (self.nvml, self.npu):
            if monitor is not None:
                monitor.close()
        self.nvml = self.npu = None
        if self._devices is not None:
            self._devices.thread.join()     # compiling on the scheduler's maps: let it end
            self._devices = None
        if self.server is not None:
            self.waiter.forget(self.server.fileno())
            self.server.close()
            self.server = None
        if self.loaded is not None:
            for ring in self.loaded.rings:
                self.waiter.forget(ring.reader.fileno())
            self.loaded.close()
            self.loaded = None
            self.ingest = None
        self.waiter.close()

    def run(self, notifier: Notifier | None = None, load_config=None):
        """Trace until stopped; with `load_config`, SIGHUP reloads the
        configuration through it (agent/daemon/reload.py)."""
        systemd = notifier or Notifier()
        hup = ReloadRequest()
        if load_config is not None:
            hup.install()
        usr2 = DumpRequest()
        usr2.install()
        self.start()
        systemd.ready(f"tracing; metrics {self.metrics.address if self.metrics else 'off'}")
        try:
            while not self.stop:
                if hup.take():
                    systemd.status("reloading the configuration")
                    with self.lock:
                        reload(self, load_config)
                    systemd.status("tracing")
                if usr2.take():
                    with self.lock:
                        self.dump_logged("SIGUSR2")
                with self.lock:
                    self.tick()
                systemd.watchdog()          # the loop itself proves it is alive
                self._sleep(systemd.watchdog_s)
        finally:
            systemd.stopping()
            self.close()
        log.info("stopped by %s", self.stop.reason or "request")

    def idle_wait_s(self, watchdog_s: float | None = None) -> float:
        """The longest the loop sleeps without data. Every tick drains the
        rings before it closes P99 windows, so the wait costs no event, only
        time to an alarm: a window closes at most a quarter window after its
        grace (a quarter window past its end). Waking 8 times a second
        instead of 4 was half an idle agent's CPU. The watchdog wants a ping
        every half of its interval."""
        wait = min(MAX_IDLE_WAIT_S, self.config.p99.window_s / 4)
        return min(wait, watchdog_s / 4) if watchdog_s else wait

    def _sleep(self, watchdog_s: float | None):
        """Until a ring signals a batch, a dispatcher writes, or the idle
        wait is up; ticks stay tick_s apart however fast batches come."""
        ticked = time.monotonic()
        self._watch_descriptors()
        if self.waiter.wait(self.idle_wait_s(watchdog_s)):
            rest = self.config.tick_s - (time.monotonic() - ticked)
            if rest > 0:
                time.sleep(rest)

    def _watch_descriptors(self):
        if self.loaded is not None:
            for ring in self.loaded.rings:
                self.waiter.watch(ring.reader.fileno(), edge=True)
        if self.server is not None:
            self.waiter.watch(self.server.fileno())

    # ----------------------------------------------------------------- tick

    def tick(self, now_ns: int | None = None):
        if self._devices is not None:
            self._wire_devices()
        if self.sources is not None and self._device() is not None:
            self._attach_new()
        if self.ingest is not None:
            self._since_trim += self.ingest.drain()
        if self.server is not None:
            try:
                messages = self.server.poll(0)
            except Exception:           # the server guards each client; this is the last line
                messages = []
                self._message_failed("poll")
            self._on_messages(messages)
        now_ns = now_ns or time.monotonic_ns()
        if time.monotonic() >= self._next_exited_sweep:
            self._next_exited_sweep = time.monotonic() + EXITED_SWEEP_INTERVAL_S
            self.forget_exited()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            self._trim_heap()
        elif self._since_trim >= TRIM_AFTER_RECORDS and time.monotonic() >= self._next_trim:
            self._trim_heap()
        self._act(self.p99.advance(now_ns - int(self.config.p99.window_s * 1e9 / 4)))
        self._sample_gpus(now_ns)
        self._steer(now_ns)

    def _trim_heap(self):
        """Hand what batches left free in the heap back. Every sweep, and
        every half second while batches are big: at 20k events a second,
        trims 10 s apart held 5 MB more. A trim walks the whole heap (about
        2 ms here), so an idle agent trims only at its sweeps, and after a
        flight recording (30 s at the rated rate left 5 MB free)."""
        heap.trim()
        self._since_trim = 0
        self._next_trim = time.monotonic() + HEAP_TRIM_INTERVAL_S

    def forget_exited(self):
        """Series of processes that have exited are dropped: a pid's alarm
        must not stay firing for ever, nor greet the next process given that
        pid, and each series holds ~23 KiB of windows (kept, those of 2 000
        short-lived processes that called the runtime took RssAnon from 58 to
        184 MB)."""
        gone, alive = [], {}
        for name, key in self.series_keys.items():
            if not key.per_process:
                continue
            if key.pid not in alive:
                alive[key.pid] = (self.proc_root / str(key.pid)).exists()
            if not alive[key.pid]:
                gone.append(name)
                self.steering.inputs.forget(("series", name))
        for name in gone:
            del self.series_keys[name]
        self.forgotten_series += self.p99.drop(gone)
        self.counts.forget_exited()
        self._forget_names_of_exited(time.monotonic_ns())

    def _forget_names_of_exited(self, now_ns: int):
        """The kernel names of a process outlive it by ring_seconds, while
        the rings hold its events and a flight recording may name them."""
        named = {row[0] for row in self.op_names}
        exited = self._names_exited_ns
        for pid in [p for p in exited if p not in named]:
            del exited[pid]
        for pid in named - exited.keys():
            if not (self.proc_root / str(pid)).exists():
                exited[pid] = now_ns
        expired = {pid for pid, at in exited.items()
                   if now_ns - at >= self.config.ring_seconds * 1e9}
        for pid in [p for p in expired if (self.proc_root / str(p)).exists()]:
            expired.discard(pid)            # the pid given to a new process: its names stay
            del exited[pid]
        if expired:
            self.op_names = [row for row in self.op_names if row[0] not in expired]
            self.op_name_of = {(pid, addr): name for pid, addr, name in self.op_names}
            for pid in expired:
                del exited[pid]

    def _device(self):
        return self.loaded.device if self.loaded is not None else None

    def _attach_new(self):
        # The device's own states are read when needed: kept here, every
        # library ever probed stayed in them.
        attach_and_release(self.loaded.device, self.sources, self.names)

    def probe_footprint(self) -> dict:
        """What the GPU/NPU probes hold now (files, links, descriptors) and
        what discovery counted: files released, over the cap, processes
        gone while being read or before any scan read them."""
        device = self._device()
        out = device.footprint() if device is not None else {}
        # The first scan runs in a thread of its own: its counters once it is over.
        found = self.sources.counters() if self.sources is not None and self.sources.ready() \
            else {}
        for name in ("probed", "waiting", "over_cap", "released", "vanished"):
            out[f"discovery_{name}"] = found.get(name, 0)
        if device is not None and found:
            # Lived less than a scan: whatever only they loaded went unprobed.
            out["discovery_exited_unread"] = self.loaded.counters().get("exited_unread", 0)
        return out

    def _series_id(self, key: SeriesKey) -> int:
        """The P99 detector's id of the series `key`; the key is kept by its
        name, so that what is known of a series is read from it, not parsed."""
        name = str(key)
        self.series_keys.setdefault(name, key)
        return self.p99.series_id(name)

    def _on_runq(self, batch):
        self.runq_ring.push(batch)
        self.counts.on_runq(batch, self.submitters)
        self._observe(ls.runq_series(self._series_id, batch, self.submitters))

    def batch(self, stream, events, op_names):
        """The daemon's sink of the ingest path (agent/ingest/pipeline.py)."""
        if stream == "cpu":
            self._on_runq(events)
        else:
            self._on_device(events, op_names)

    def _on_device(self, batch, rows):
        if rows:
            self.op_names = (self.op_names + rows)[-(1 << 16):]
            self.op_name_of.update(((pid, addr), name) for pid, addr, name in rows)
            if len(self.op_name_of) > 2 * len(self.op_names):      # bounded like the list
                self.op_name_of = {(pid, addr): name for pid, addr, name in self.op_names}
        self.submitters.learn(batch)
        aligned = self.aligner.push(batch)
        self.counts.on_device(aligned, self.aligner.last_retired)
        self._observe(ls.sync_series(self._series_id, aligned))
        self._observe(ls.retire_series(self._series_id, self.aligner.last_retired))
        if self.otlp is not None:
            self.otlp.submissions(self.aligner.last_retired)

    def _observe(self, series: ls.Series):
        if len(series):
            self._act(self.p99.observe(series.ids, series.ts_ns, series.values_s,
                                       series.contributors))

    def _on_messages(self, messages):
        """Act on the checked messages of the hint socket. They are safe to
        use by construction (hint_protocol); should acting on one fail all
        the same, the failure is counted and logged, and the rest go on."""
        requests = []
        now = time.monotonic_ns()
        for client, msg in messages:
            try:
                self.steering.inputs.on_message(getattr(client, "pid", None), msg)
                self._on_message(client, msg, now, requests)
            except Exception:
                self._message_failed(msg.get("type"))
        if requests:
            try:
                self._observe_requests(requests)
            except Exception:
                self._message_failed("sample")

    def _on_message(self, client, msg: dict, now: int, requests: list):
        ts = msg.get("ts_ns", now)
        refused = self.samples.out_of_window(msg, ts, now)
        if refused is not None:
            self.server.error(client, refused)
            return
        if msg["type"] == "status":
            self.server.reply(client, self.status())
        elif msg["type"] == "dump":
            self._dump_reply(client)
        elif msg["type"] == "entropy":
            self.entropy_ring.push(self.samples.entropy(msg["values"], ts))
            modality = msg["modality"]
            for name in {v["modality"] for v in msg["values"]}:
                known = name in self.entropy_senders
                if known or len(self.entropy_senders) < MAX_MODALITIES:
                    _heard(self.entropy_senders.setdefault(name, OrderedDict()), client)
            if modality in self.entropy_latest or len(self.entropy_latest) < MAX_MODALITIES:
                values = [v["value"] for v in msg["values"]]
                self.entropy_latest[modality] = sum(values) / len(values)
            self._act(self.entropy.update(msg["values"], ts_ns=ts))
        elif msg["type"] == "sample":
            key = SeriesKey(REQUEST, series=msg["series"], modality=msg["modality"])
            name = str(key)
            sid = self.samples.request_id(key)
            if sid is None:
                self.server.error(client, f"more than {MAX_CLIENT_SERIES} request series; "
                                  f"{name} ignored")
                return
            _heard(self.request_senders.setdefault(name, OrderedDict()), client)
            requests.append((self._series_id(key), ts, msg["value_ms"] / 1e3, sid))

    def _observe_requests(self, requests: list):
        ids, ts, values, sids = (np.array(c) for c in zip(*requests))
        self._act(self.p99.observe(ids, ts, values))
        rec = np.zeros(len(ids), REQUEST_SAMPLE)
        rec["ts_ns"], rec["value_s"], rec["series"] = ts, values, sids
        self.request_ring.push(rec)

    def _message_failed(self, kind):
        self.message_failures += 1
        self._log_failure.log(logging.ERROR, "hint socket: acting on a %s message failed "
                              "(%d so far); carrying on", kind, self.message_failures,
                              exc_info=True)

    # -------------------------------------------------------------- status

    def status(self, span_s: float = 5.0) -> dict:
        """What `mmtrace top` shows: the last span_s seconds per process,
        the active anomalies, the latest hints, and the losses. Computed at
        most every STATUS_MIN_INTERVAL_S, however many clients ask."""
        now = time.monotonic_ns()
        if self._status_cache and now - self._status_cache[0] < STATUS_MIN_INTERVAL_S * 1e9:
            return self._status_cache[1]
        self._status_cache = (now, self._status(now, span_s))
        return self._status_cache[1]

    def _status(self, now: int, span_s: float) -> dict:
        span_s = min(span_s, max(1e-3, (now - self.started_ns) / 1e9))   # rates over what was seen
        since = now - int(span_s * 1e9)
        processes = status_view.process_table(self.runq_ring.window(since),
                                               self.aligner.window(since),
                                               self.submitters.tids, span_s)
        device = self._device()
        return {"v": 1, "type": "status", "daemon_pid": os.getpid(),
                "uptime_s": (now - self.started_ns) / 1e9, "span_s": round(span_s, 3),
                "launch_probes": ("on" if not self.config.adaptive_launches else
                                  "burst" if device is not None and device.launches_attached
                                  else "on alarm"),
                "processes": processes,
                "anomalies": status_view.active_anomalies(self.anomalies),
                "hints": list(self.recent_hints), "hints_sent": self.hints_sent,
                "policy": self.steering.summary(),
                "probes": self.probe_footprint(),
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
            key = self.series_keys.get(anomaly.get("series"))
            if key is not None:             # what the series is about, for the policy
                anomaly["key"] = key.as_dict()
            self.steering.inputs.on_anomaly(anomaly)
            self.anomalies.append(anomaly)
            del self.anomalies[:-1000]
            firing = anomaly.get("state") == "firing"
            if firing:
                self.anomaly_counts[anomaly.get("detector", "unknown")] += 1
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

    def dump(self, reason: str) -> Path:
        """The flight recorder's ring written now (`mmtrace dump`, SIGUSR2),
        past its interval; OSError when it cannot be written."""
        try:
            path = self.flight.dump_now(*self._flight_contents(), reason=reason,
                                        now_ns=time.monotonic_ns())
        finally:
            self._trim_heap()
        log.warning("flight recording (%s): %s", reason, path)
        return path

    def dump_logged(self, reason: str) -> Path | None:
        try:
            return self.dump(reason)
        except OSError:
            return None                 # the flight recorder has logged why

    def _dump_reply(self, client):
        """Answer a socket's dump request with the file, or why not. Requests
        within DUMP_REUSE_S of the last get its file: a client in a loop
        cannot fill the disk."""
        now = time.monotonic()
        if self._last_dump is None or now - self._last_dump[0] >= DUMP_REUSE_S:
            try:
                self._last_dump = (now, self.dump("dump"))
            except OSError as exc:
                self.server.error(client, f"dump: {exc}")
                return
        self.server.reply(client, {"v": 1, "type": "dump", "path": str(self._last_dump[1]),
                                   "daemon_pid": os.getpid()})

    def _flight_record(self, anomaly):
        windows, schemas, meta = self._flight_contents()
        try:
            return self.flight.dump(windows, schemas, anomaly, meta, time.monotonic_ns())
        finally:
            self._trim_heap()

    def _flight_contents(self) -> tuple[dict, dict, list[dict]]:
        """(the rings' windows, their schemas, the meta) of a flight recording.
        The compressed rings give their windows a block at a time, written as
        they come: taken whole, 30 s of both streams at the rated rate held
        100 MB more while a recording was written."""
        windows = {"cpu.runq": self.runq_ring.pieces(),
                   "dev.event": map(_plain_device, self.aligner.pieces()),
                   "model.entropy": self.entropy_ring.window(),
                   "request.latency": self.request_ring.window(),
                   "gpu.state": self.gpu_state_ring.window()}
        device = self._device()
        meta = [fit_meta({
            "apis": device_stream.default_table().to_json(),
            # What is probed now: released files' states are gone with them.
            "probes": self.probe_states + (device.states() if device is not None else []),
            "symbol_names": {str(k): v for k, v in
                             (device.symbol_names().items() if device is not None else [])},
            "op_names": self.op_names,
            **self.samples.tables(),
            "hint_audit": self.steering.audit(),
            "host": platform.node(), "daemon_pid": os.getpid(),
            "config": _jsonable(asdict(self.config))})]
        return windows, SCHEMAS, meta

    def _sample_gpus(self, now_ns: int):
        """NVML's latest state into the flight recorder's ring, once a second."""
        if self.nvml is None or now_ns < self._next_gpu_sample:
            return
        self._next_gpu_sample = now_ns + GPU_SAMPLE_INTERVAL_NS
        states = self.nvml.devices()
        if states:
            self.gpu_state_ring.push(state_records(states, now_ns))

    def _steer(self, now_ns: int):
        """Send what the hint policy decides now (nothing in dry-run: the
        audit log has every decision)."""
        self.steering.inputs.device_weights = self._device_weights()
        for hint in self.steering.step(now_ns):
            self.recent_hints.append({k: hint[k] for k in ("id", "kind", "target", "value",
                                                           "ttl_s", "reason", "issued_ns")})
            log.warning("hint %s %s -> %s: %s", hint["kind"], hint["target"], hint["value"],
                        hint["reason"])
            if self.server is not None:
                scope = self._hint_scope(hint)
                sent = self.server.broadcast(hint) if scope is None else \
                    self.server.send_to(scope, hint)
                self.hints_sent += sent
                self.hint_counts[hint["kind"]] += sent

    def _hint_scope(self, hint: dict) -> set[int] | None:
        """The processes a hint may reach: those whose own samples raised
        it (a request series' alarm), else every subscriber (None: the
        kernel's run-queue and device streams, entropy, device weights)."""
        evidence = hint.get("evidence")
        if not isinstance(evidence, dict):
            return None
        series, modality = evidence.get("series"), evidence.get("entropy_modality")
        if isinstance(series, str) and series in self.samples.request_series.ids:
            return set(self.request_senders.get(series, ()))
        if isinstance(modality, str):
            return set(self.entropy_senders.get(modality, ()))
        return None

    def _device_weights(self) -> dict | None:
        """The GPUs' weights by ordinal (the gpu label of the metrics), where NVML answers."""
        gpus = self.nvml.devices() if self.nvml is not None else []
        return {str(d.index): d.weight for d in gpus} or None


def _heard(senders: "OrderedDict[int, None]", client):
    """The client's process (SO_PEERCRED) as the latest sender; the longest
    silent go first past MAX_SENDERS_PER_SERIES (recycled workers age out)."""
    pid = getattr(client, "peer_pid", 0)
    senders[pid] = None
    senders.move_to_end(pid)
    while len(senders) > MAX_SENDERS_PER_SERIES:
        senders.popitem(last=False)


def _otlp_traces(config: DaemonConfig, describe_rows):
    """The OTLP sink when an endpoint is configured (config or OTEL_*), else
    None (and the SDK is never imported)."""
    from mmtrace.exporters.live.otlp_options import options_from
    o = config.otlp
    try:
        options = options_from(o.endpoint, o.headers, o.sample_ratio, o.max_spans_per_s)
    except ValueError as exc:
        raise MmtraceError(f"OTLP: {exc}") from None
    if not options.enabled:
        return None
    from mmtrace.exporters.live import otlp
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
