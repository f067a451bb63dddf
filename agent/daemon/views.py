"""What the daemon hands out of itself: the snapshot the metrics collector
renders at each scrape, and the status reply `mmtrace top` shows. Readers
get values (copies, read now), never the daemon's parts."""

import copy
import os

import numpy as np

from mmtrace.bpf import sched as sched_stream
from mmtrace.exporters.live import status as status_view
from mmtrace.exporters.live.prometheus import DaemonSnapshot, KernelFigures

from mmtrace.agent.ingest.record_arrays import concat
from mmtrace.agent.ingest.series_keys import RUNQ


def metrics_snapshot(daemon) -> DaemonSnapshot:
    """The metrics endpoint's view, taken in its thread: the kernel's maps
    and the counts outside the daemon's lock, the rest under it."""
    probes, streams = daemon.probes, daemon.streams
    loaded = probes.loaded
    kernel = KernelFigures(**loaded.figures()) if loaded is not None else None
    device = probes.device
    counts = streams.counts.snapshot()
    with daemon.lock:
        p99 = daemon.p99
        series = [(key.kind, p99.state(name)) for name, key in streams.series_keys.items()]
        levels = [(key.kind, key.pid, p99.baseline(name), p99.threshold(name))
                  for name, key in streams.series_keys.items() if key.per_process]
        launchers = [dict(row, shares=dict(row["shares"])) for row in streams.launchers.table()]
        entropy_latest = dict(daemon.messages.entropy_latest)
        modalities = {m: set(daemon.entropy.firing(m)) for m in entropy_latest}
        anomalies = dict(daemon.alarms.counts)
        hints = dict(daemon.steering.sent)
        program_states = list(probes.probe_states)
        device_memory = streams.memory.snapshot()
    otlp, nvml, npu = daemon.otlp, daemon.monitors.nvml, daemon.monitors.npu
    return DaemonSnapshot(
        kernel=kernel, counts=counts, p99_series=series, p99_levels=levels,
        launchers=launchers, entropy_modalities=modalities,
        entropy_latest=entropy_latest, anomalies=anomalies, hints=hints,
        program_states=program_states,
        device_probes=device.states() if device is not None else None,
        device_held=device.footprint() if device is not None else None,
        gpu_up=nvml is not None and nvml.up, gpus=nvml.devices() if nvml is not None else None,
        npu_up=npu.up if npu is not None else None,
        npus=npu.devices() if npu is not None else None,
        otlp_stats=copy.copy(otlp.stats) if otlp is not None else None,
        device_memory=device_memory)


def _extracted(ring, since: int, key, extract, dtype: np.dtype) -> np.ndarray:
    """extract(...) of the ring's records from `since` on, in one array of
    `dtype`: the sealed blocks' extracts kept between asks
    (PackedRing.extracts)."""
    parts = list(ring.extracts(since, key, extract))
    return concat(parts) if parts else np.empty(0, dtype)


def status(daemon, now: int, span_s: float) -> dict:
    """What `mmtrace top` shows: the last span_s seconds per process, the
    active anomalies, the latest hints, and the losses."""
    span_s = min(span_s, max(1e-3, (now - daemon.started_ns) / 1e9))  # rates over what was seen
    since = now - int(span_s * 1e9)
    streams, probes = daemon.streams, daemon.probes
    device = probes.device
    launch_probes = ("on" if not daemon.config.adaptive_launches else
                     "burst" if device is not None and device.launches_attached else "on alarm")
    submitters = streams.submitters
    runq = _extracted(streams.runq_ring, since, ("launchers", submitters.version),
                      lambda records: records[submitters.mask(records["tid"])],
                      sched_stream.RUNQ_EVENT)
    calls = _extracted(streams.aligner, since, "status", status_view.device_rows,
                       status_view.DEVICE_ROWS)
    processes = status_view.process_table(runq, calls, submitters.tids, span_s,
                                           names=streams.counts.process_name,
                                           launches_traced=launch_probes != "on alarm",
                                           infos=streams.infos)
    p99 = daemon.p99
    runq_levels = {key.pid: (p99.baseline(name), p99.threshold(name))
                   for name, key in streams.series_keys.items()
                   if key.kind == RUNQ and key.pid is not None}
    processes = status_view.with_launchers(
        processes, {row["pid"]: row for row in streams.launchers.table()}, runq_levels)
    return {"v": 1, "type": "status", "daemon_pid": os.getpid(),
            "uptime_s": (now - daemon.started_ns) / 1e9, "span_s": round(span_s, 3),
            "launch_probes": launch_probes,
            "processes": processes,
            "anomalies": status_view.active_anomalies(daemon.alarms.anomalies),
            "hints": list(daemon.steering.recent), "hints_sent": daemon.steering.hints_sent,
            "policy": daemon.steering.summary(),
            "probes": probes.footprint(),
            "losses": daemon.losses()}
