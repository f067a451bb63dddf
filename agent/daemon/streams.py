"""The daemon's sink of the one ingest path (agent/ingest/pipeline.py):
each enriched batch goes into the bounded rings of the recent past, the
metrics' counts and the latency series the P99-drift detector watches;
what the detector says goes to `act`. The dispatchers' samples arrive
here too, by way of the socket's messages (agent/daemon/client_messages.py).
"""

import time
from pathlib import Path
from typing import Callable

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream
from mmtrace.detectors.call_failures import CallFailures
from mmtrace.detectors.p99_drift import P99Drift
from mmtrace.exporters.devices.device_state import GPU_STATE, state_records
from mmtrace.exporters.live.event_counts import EventCounts

from mmtrace.agent.config.settings import DaemonConfig, FailureSettings
from mmtrace.agent.daemon.launcher_time import LauncherTime
from mmtrace.agent.daemon.memory_watch import MemoryWatch
from mmtrace.agent.ingest import block_codec
from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.ingest.align import Aligner, ApiRoles
from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.ingest.packed_ring import PackedRing
from mmtrace.agent.ingest.record_arrays import rows_of
from mmtrace.agent.ingest.series_keys import SeriesKey
from mmtrace.agent.ingest.series_window import SeriesWindow
from mmtrace.agent.recording import recorder
from mmtrace.agent.socket import telemetry
from mmtrace.agent.socket.telemetry import ENTROPY_SAMPLE, REQUEST_SAMPLE

# A flight recording's: what `record` writes, with what dispatchers report
# (as `record --socket` writes it) and NVML's device state.
SCHEMAS = {**recorder.SCHEMAS, **telemetry.SCHEMAS, "gpu.state": GPU_STATE}
MAX_OP_NAMES = 1 << 16
RUNQ_BLOCK_NS = 1_000_000_000


def failures_detector(f: FailureSettings) -> CallFailures:
    return CallFailures(window_s=f.window_s, min_failures=f.min_failures, min_share=f.min_share,
                        consecutive=f.consecutive, clear_windows=f.clear_windows)


class Streams:
    """What the daemon keeps of its streams, fed batch by batch."""

    def __init__(self, config: DaemonConfig, p99: P99Drift, act: Callable[[list], None],
                 infos=None, otlp=None, failures: CallFailures | None = None):
        self.config = config
        self.p99 = p99
        self.failures = failures or failures_detector(config.failures)
        self.act = act
        age = int(config.ring_seconds * 1e9)
        infos = self.infos = infos or device_stream.default_infos()
        # The highest-rate stream: its reach is held compressed, in blocks of
        # a second (56-byte records: ~1.1 MB raw in the hot block at the rated
        # rate; a block's fixed cost over four times the records of the
        # default quarter second).
        self.runq_ring = PackedRing(sched_stream.RUNQ_EVENT, config.ring_capacity, age,
                                    block_ns=RUNQ_BLOCK_NS, raw_bits=block_codec.runq_raw_bits())
        self.entropy_ring = EventRing(ENTROPY_SAMPLE, 1 << 16, age)
        self.request_ring = EventRing(REQUEST_SAMPLE, 1 << 16, age)
        self.gpu_state_ring = EventRing(GPU_STATE, 1 << 12, age)   # NVML, once a second
        self.aligner = Aligner(ApiRoles.from_infos(infos), capacity=config.device_ring_capacity,
                               max_age_ns=age, compress=True)
        self.series_keys: dict[str, SeriesKey] = {}   # the P99 series' names -> their keys
        self.op_names: list[list] = []
        self.op_name_of: dict[tuple[int, int], str] = {}
        self.names_exited_ns: dict[int, int] = {}   # pid -> when its exit was seen
        self.submitters = ls.Submitters()
        self.counts = EventCounts(infos)
        self.forgotten_series = 0
        self.otlp = otlp                # live.otlp.OtlpTraces, when configured
        self.launchers = LauncherTime(config.diagnosis, infos, config.ring_seconds)
        self.memory = MemoryWatch(config, infos, unretired=self.aligner.unretired)
        # When a batch last carried GPU/NPU calls or the run-queue records of
        # threads that make them: the detectors' inputs (the daemon's loop
        # waits longer while there have been none for a while).
        self.last_work_ns: int | None = None

    # ---------------------------------------------------------- the sink

    def batch(self, stream, events, op_names):
        """One enriched batch of the ingest path."""
        if stream == "cpu":
            self.runq_ring.push(events)
            self.counts.on_runq(events, self.submitters)
            self.observe(ls.runq_series(self.series_id, events, self.submitters))
            mine = self.submitters.select(events)
            self.launchers.on_runq(mine)
            if len(mine):
                self.last_work_ns = time.monotonic_ns()
        else:
            if len(events):
                self.last_work_ns = time.monotonic_ns()
            self._on_device(events, op_names)

    def _on_device(self, batch, rows):
        if rows:
            self.op_names = (self.op_names + rows)[-MAX_OP_NAMES:]
            self.op_name_of.update(((pid, addr), name) for pid, addr, name in rows)
            if len(self.op_name_of) > 2 * len(self.op_names):      # bounded like the list
                self.op_name_of = {(pid, addr): name for pid, addr, name in self.op_names}
        self.submitters.learn(batch)
        aligned = self.aligner.push(batch)
        self.counts.on_device(aligned, self.aligner.last_retired)
        self.launchers.on_device(aligned)
        self.memory.on_device(aligned)
        self.act(self.failures.feed(*ls.failure_calls(aligned, self.infos)))
        self.observe(ls.sync_series(self.series_id, aligned))
        self.observe(ls.retire_series(self.series_id, self.aligner.last_retired))
        if self.otlp is not None:
            self.otlp.submissions(self.aligner.last_retired)

    def series_id(self, key: SeriesKey) -> int:
        """The P99 detector's id of the series `key`; the key is kept by its
        name, so that what is known of a series is read from it, not parsed."""
        name = str(key)
        self.series_keys.setdefault(name, key)
        return self.p99.series_id(name)

    def observe(self, series: ls.Series):
        if len(series):
            self.act(self.p99.observe(series.ids, series.ts_ns, series.values_s,
                                      series.contributors))

    def observe_requests(self, requests: list):
        """(series id, ts_ns, value_s, socket series id) of request samples."""
        ids, ts, values, sids = (np.array(c) for c in zip(*requests))
        self.act(self.p99.observe(ids, ts, values))
        rec = np.zeros(len(ids), REQUEST_SAMPLE)
        rec["ts_ns"], rec["value_s"], rec["series"] = ts, values, sids
        self.request_ring.push(rec)

    def sample_gpus(self, states: list, now_ns: int):
        if states:
            self.gpu_state_ring.push(state_records(states, now_ns))
            self.act(self.memory.on_device_states("gpu", states, now_ns))

    def series_window(self, name: str, window_s: float, now_ns: int) -> dict:
        """The percentiles of the series `name` over the last `window_s`
        seconds the rings hold; ValueError for a name that is no series."""
        since = now_ns - int(min(window_s, self.config.ring_seconds) * 1e9)
        window = SeriesWindow(name, since, now_ns)
        window.add_runq(self.runq_ring.window(since), self.submitters)
        window.add_device(self.aligner.window(since))
        detector = None
        if name in self.series_keys:       # the P99 detector's view of it, beside the figures
            base, limit = self.p99.baseline(name), self.p99.threshold(name)
            detector = {"state": self.p99.state(name),
                        "baseline_p99_ms": None if base is None else base * 1e3,
                        "threshold_p99_ms": None if limit is None else limit * 1e3}
        return {**window.summary(), "detector": detector,
                "held_s": min(window_s, self.config.ring_seconds)}

    # -------------------------------------------------------- the exited

    def forget_exited(self, proc_root: Path, now_ns: int) -> list[str]:
        """Series of processes that have exited are dropped: a pid's alarm
        must not stay firing for ever, nor greet the next process given that
        pid, and each series holds ~23 KiB of windows (kept, those of 2 000
        short-lived processes that called the runtime took RssAnon from 58 to
        184 MB). Returns the names of the series dropped."""
        gone, alive = [], {}
        for name, key in self.series_keys.items():
            if not key.per_process:
                continue
            if key.pid not in alive:
                alive[key.pid] = (proc_root / str(key.pid)).exists()
            if not alive[key.pid]:
                gone.append(name)
        for name in gone:
            del self.series_keys[name]
        self.forgotten_series += self.p99.drop(gone)
        self.launchers.forget([pid for pid in self.launchers.starvation.states
                               if not (proc_root / str(pid)).exists()])
        self.counts.forget_exited()
        self.forget_names_of_exited(proc_root, now_ns)
        return gone

    def forget_names_of_exited(self, proc_root: Path, now_ns: int):
        """The kernel names of a process outlive it by ring_seconds, while
        the rings hold its events and a flight recording may name them."""
        named = {row[0] for row in self.op_names}
        exited = self.names_exited_ns
        for pid in [p for p in exited if p not in named]:
            del exited[pid]
        for pid in named - exited.keys():
            if not (proc_root / str(pid)).exists():
                exited[pid] = now_ns
        expired = {pid for pid, at in exited.items()
                   if now_ns - at >= self.config.ring_seconds * 1e9}
        for pid in [p for p in expired if (proc_root / str(p)).exists()]:
            expired.discard(pid)            # the pid given to a new process: its names stay
            del exited[pid]
        if expired:
            self.op_names = [row for row in self.op_names if row[0] not in expired]
            self.op_name_of = {(pid, addr): name for pid, addr, name in self.op_names}
            for pid in expired:
                del exited[pid]

    # ------------------------------------------------------- the windows

    def windows(self) -> dict:
        """The rings' windows, by schema (SCHEMAS), for a flight recording.
        The compressed rings give their windows a block at a time, written as
        they come: taken whole, 30 s of both streams at the rated rate held
        100 MB more while a recording was written."""
        return {"cpu.runq": self.runq_ring.pieces(),
                "dev.event": map(_plain_device, self.aligner.pieces()),
                "model.entropy": self.entropy_ring.window(),
                "request.latency": self.request_ring.window(),
                "gpu.state": self.gpu_state_ring.window()}


def _plain_device(aligned: np.ndarray) -> np.ndarray:
    """DEV_EVENT records of aligned ones: their leading bytes (the aligned
    layout is the device layout and retired_ns after it), copied as bytes
    (field by field, a flight recording's 30 s took ten times longer)."""
    rows = rows_of(aligned)[:, :device_stream.DEV_EVENT.itemsize].copy()     # always a copy
    return rows.view(device_stream.DEV_EVENT).reshape(-1)
