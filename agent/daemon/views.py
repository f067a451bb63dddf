"""What the daemon hands out of itself: the snapshot the metrics collector
renders at each scrape, and the status reply `mmtrace top` shows. Readers
get values, never the daemon's parts."""

import os

from mmtrace.bpf import sched as sched_stream
from mmtrace.exporters.live import status as status_view
from mmtrace.exporters.live.prometheus import DaemonSnapshot, KernelFigures


def kernel_figures(loaded) -> KernelFigures | None:
    """The programs' maps, read now (never cleared)."""
    if loaded is None:
        return None
    programs = {(n.decode() if isinstance(n, bytes) else n): fn.fd
                for n, fn in getattr(loaded.bpf, "funcs", {}).items()}
    return KernelFigures(runq_slots=loaded.runq_hist(),
                         runq_total_ns=sched_stream.sum_from_table(
                             loaded.bpf[sched_stream.SUM_MAP]),
                         counters=loaded.counters(), programs=programs)


def metrics_snapshot(daemon) -> DaemonSnapshot:
    """The metrics endpoint's view, taken in its thread: the kernel's maps
    and the counts outside the daemon's lock, the rest under it."""
    probes, streams = daemon.probes, daemon.streams
    kernel = kernel_figures(probes.loaded)
    device = probes.device
    counts = streams.counts.snapshot()
    with daemon.lock:
        p99 = daemon.p99
        series = [(key.kind, p99.state(name)) for name, key in streams.series_keys.items()]
        entropy_latest = dict(daemon.messages.entropy_latest)
        modalities = {m: set(daemon.entropy.firing(m)) for m in entropy_latest}
        anomalies = dict(daemon.alarms.counts)
        hints = dict(daemon.steering.sent)
        program_states = list(probes.probe_states)
    otlp = daemon.otlp
    return DaemonSnapshot(
        kernel=kernel, counts=counts, p99_series=series, entropy_modalities=modalities,
        entropy_latest=entropy_latest, anomalies=anomalies, hints=hints,
        program_states=program_states,
        device_probes=device.states() if device is not None else None,
        device_held=device.footprint() if device is not None else None,
        nvml=daemon.monitors.nvml, npu=daemon.monitors.npu,
        otlp_stats=otlp.stats if otlp is not None else None)


def status(daemon, now: int, span_s: float) -> dict:
    """What `mmtrace top` shows: the last span_s seconds per process, the
    active anomalies, the latest hints, and the losses."""
    span_s = min(span_s, max(1e-3, (now - daemon.started_ns) / 1e9))  # rates over what was seen
    since = now - int(span_s * 1e9)
    streams, probes = daemon.streams, daemon.probes
    processes = status_view.process_table(streams.runq_ring.window(since),
                                           streams.aligner.window(since),
                                           streams.submitters.tids, span_s)
    device = probes.device
    return {"v": 1, "type": "status", "daemon_pid": os.getpid(),
            "uptime_s": (now - daemon.started_ns) / 1e9, "span_s": round(span_s, 3),
            "launch_probes": ("on" if not daemon.config.adaptive_launches else
                              "burst" if device is not None and device.launches_attached
                              else "on alarm"),
            "processes": processes,
            "anomalies": status_view.active_anomalies(daemon.alarms.anomalies),
            "hints": list(daemon.steering.recent), "hints_sent": daemon.steering.hints_sent,
            "policy": daemon.steering.summary(),
            "probes": probes.footprint(),
            "losses": daemon.losses()}
