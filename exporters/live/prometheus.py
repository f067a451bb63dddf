"""The daemon's Prometheus endpoint (default :9464/metrics).

A custom collector builds every family at scrape time from the kernel maps
(run-queue histogram and its sum, the loss and activity counters: read,
never cleared) and from the daemon's state (event counts, probe states,
detectors, anomalies, hints, GPU/NPU devices). Names and labels are the
interface's ("Prometheus"); a label that names a workload is capped at a
top-K, the rest folded into `other`, and carries a pid only when the
operator turns that on.

Gauges of a process's figures (the launchers' time split, the detectors'
thresholds and baselines) take the same top-K labels, but have no `other`:
a share or a threshold of unrelated processes mixed together would hide
the one that matters, whose anomaly counts in mmtrace_anomalies_total
wherever it ranks. Where several processes share a label (one name, pids
not labelled), one speaks for them: the launcher with the highest runnable
share, the P99 series with the highest threshold.
"""

import errno
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import ThreadingWSGIServer

from mmtrace.bpf import counters as bpf_counters
from mmtrace.detectors import entropy_drift
from mmtrace.detectors.diagnosis import STATES as LAUNCHER_STATES

from mmtrace.exporters.live.event_counts import (OTHER_LABELS, Histogram, process_labels,
                                                 top_k)

DEFAULT_ADDRESS = ":9464"
# The kernel's run-queue histogram: slot k holds [2^k, 2^(k+1)) µs (slot 0:
# 0-1 µs), so its upper bounds are 2^(k+1) µs; slots past ~1 s go to +Inf.
KERNEL_RUNQ_SLOTS = 20
KERNEL_RUNQ_BOUNDS = tuple(2.0 ** (k + 1) * 1e-6 for k in range(KERNEL_RUNQ_SLOTS))
DETECTOR_STATES = ("normal", "pending", "firing", "resolved")
KNOWN_DETECTORS = ("p99_drift", "attention_entropy", "starvation", "time_share", "call_failures")
STARVATION_SERIES = "runq_share"        # the starvation detector's key kind
KNOWN_HINTS = ("modality_batch", "priority", "route_affinity", "prefer_device", "degrade",
               "cpu_contention")
BPF_STATS_SYSCTL = "sys/kernel/bpf_stats_enabled"
MAX_REASON_CHARS = 200      # a failed probe's reason, as a label value


class MetricsAddressError(ValueError):
    """The listen address is malformed, or cannot be bound."""


def parse_address(text: str) -> tuple[str, int]:
    """":9464" (every interface), "127.0.0.1:9464", "[::1]:9464"."""
    host, sep, port = str(text).rpartition(":")
    # isdigit() would take "²", which int() refuses: ASCII digits only
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise MetricsAddressError(f"metrics address: expected HOST:PORT or :PORT "
                                  f"(e.g. {DEFAULT_ADDRESS}), got {text!r}")
    return host.strip("[]"), int(port)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        """Scrapes are not worth a log line each."""


class MetricsEndpoint:
    """An HTTP server in a thread of its own serving `registry` at /metrics."""

    def __init__(self, address: str, registry: CollectorRegistry):
        host, port = parse_address(address)
        try:
            family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                        flags=socket.AI_PASSIVE)[0][0]
        except socket.gaierror as exc:
            raise MetricsAddressError(f"metrics address {address}: {exc.strerror}") from None

        class Server(ThreadingWSGIServer):
            address_family = family

        try:
            self.httpd = make_server(host or ("::" if family == socket.AF_INET6 else "0.0.0.0"),
                                     port, make_wsgi_app(registry), Server,
                                     handler_class=_QuietHandler)
        except OSError as exc:
            why = "the port is taken" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise MetricsAddressError(f"metrics address {address}: cannot listen ({why})") \
                from None
        self.port = self.httpd.server_port
        self.address = f"{f'[{host}]' if ':' in host else host}:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever,
                                        name="mmtrace-metrics", daemon=True)
        self._thread.start()

    def close(self):
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self._thread.join(5)
            self.httpd = None


@dataclass(frozen=True)
class Labels:
    """How workload labels are bounded."""
    top_k: int = 10
    with_pid: bool = False


def _encodable(text: str) -> str:
    """`text` as UTF-8 can carry it: a file name's undecodable bytes
    (surrogateescape) as \\xNN, any other lone surrogate as U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _encodable_labels(family):
    """The family with label values every scrape can encode: one library
    path of undecodable bytes must not turn every scrape into a 500."""
    for i, sample in enumerate(family.samples):
        if not all(v.isascii() for v in sample.labels.values()):
            family.samples[i] = sample._replace(
                labels={k: _encodable(v) for k, v in sample.labels.items()})
    return family


@dataclass(frozen=True)
class KernelFigures:
    """What the eBPF programs' maps hold at scrape time (read, never cleared)."""
    runq_slots: list                # the run-queue histogram's slots (sched.c)
    runq_total_ns: int              # the sum of its delays
    counters: dict                  # every counter, by name (bpf/counters.py)
    programs: dict                  # program name -> its fd (for run-time stats)


@dataclass(frozen=True)
class DaemonSnapshot:
    """The daemon's state as the collector renders it, handed out by the
    daemon at each scrape (agent/daemon/views.py). The collector reads
    nothing else of the daemon."""
    kernel: KernelFigures | None = None     # None until the CPU stream is loaded
    counts: object = None                   # event_counts.EventCounts.snapshot()
    p99_series: list = field(default_factory=list)        # (series kind, state) per series
    # (series kind, pid, baseline s, threshold s) per P99 series of a process
    p99_levels: list = field(default_factory=list)
    launchers: list = field(default_factory=list)         # launcher_time.LauncherTime.table()
    entropy_modalities: dict = field(default_factory=dict)  # modality -> kinds firing
    entropy_latest: dict = field(default_factory=dict)    # modality -> mean entropy
    anomalies: dict = field(default_factory=dict)         # detector -> fired
    hints: dict = field(default_factory=dict)             # kind -> delivered
    program_states: list = field(default_factory=list)    # the programs' own states
    device_probes: list | None = None       # the GPU/NPU probes' states, once wired
    device_held: dict | None = None         # what they hold (files, links)
    gpu_up: bool = False                    # NVML answers
    gpus: list | None = None                # devices.device_state.DeviceState by GPU; None: off
    npu_up: bool | None = None              # npu-smi answers; None where it is not polled
    npus: list | None = None
    otlp_stats: object = None               # a copy of live.otlp's stats, when OTLP is on
    device_memory: dict | None = None       # agent/daemon/memory_watch.py MemoryWatch.snapshot()


class DaemonCollector:
    """Renders the daemon's snapshot, taken at each scrape."""

    def __init__(self, snapshot: Callable[[], DaemonSnapshot], labels: Labels = Labels(),
                 proc_root: Path = Path("/proc")):
        self.snapshot = snapshot
        self.labels = labels
        self.proc_root = Path(proc_root)

    def describe(self):
        return []       # the families are only known at scrape time

    def collect(self):
        for family in self._families():
            yield _encodable_labels(family)

    def _families(self):
        d = self.snapshot()
        if d.kernel is not None:
            yield from self._kernel(d.kernel)
        yield from self._submitters(d.counts)
        workloads = process_labels(d.counts.processes, self.labels.top_k, self.labels.with_pid)
        yield from self._launchers(workloads, d.launchers)
        yield from self._p99_levels(workloads, d.p99_levels)
        yield from self._device(d.counts)
        if d.device_memory is not None:
            yield from _device_memory(d.device_memory, d.gpus, d.npus)
        yield from self._probes(d.program_states, d.device_probes, d.device_held)
        yield from self._detectors(_detector_rows(d), d.entropy_latest, d.anomalies, d.hints)
        yield from self._devices(d)
        if d.otlp_stats is not None:
            yield from self._otlp(d.otlp_stats)

    # ------------------------------------------------------------ kernel

    def _kernel(self, figures: KernelFigures):
        slots, total_ns = figures.runq_slots, figures.runq_total_ns
        hist = Histogram(KERNEL_RUNQ_BOUNDS)
        hist.counts[:KERNEL_RUNQ_SLOTS] = slots[:KERNEL_RUNQ_SLOTS]
        hist.counts[KERNEL_RUNQ_SLOTS] = sum(slots[KERNEL_RUNQ_SLOTS:])
        h = HistogramMetricFamily("mmtrace_runq_delay_seconds",
                                  "Run-queue delay of every wake-up in scope (the host when "
                                  "no --pid is given), from the kernel's histogram.")
        h.add_metric([], hist.cumulative(), total_ns / 1e9)
        yield h
        counters = figures.counters
        lost = CounterMetricFamily("mmtrace_events_lost_total",
                                   "Events or facts the eBPF programs could not deliver, "
                                   "by stream and kernel counter (as `record` counts them).",
                                   labels=["stream", "reason"])
        for name in bpf_counters.LOSS_COUNTERS:
            lost.add_metric([bpf_counters.stream_of(name), name], counters.get(name, 0))
        yield lost
        kernel = CounterMetricFamily("mmtrace_kernel_events_total",
                                     "Every counter of the eBPF programs (losses, events "
                                     "emitted, oddities), by name.", labels=["stream", "counter"])
        for name in bpf_counters.COUNTER_NAMES:
            kernel.add_metric([bpf_counters.stream_of(name), name], counters.get(name, 0))
        yield kernel
        yield from self._bpf_run_time(figures.programs)

    def _bpf_run_time(self, programs: dict):
        """Run time of our programs, where kernel.bpf_stats_enabled is on."""
        try:
            enabled = (self.proc_root / BPF_STATS_SYSCTL).read_text().strip() == "1"
        except OSError:
            enabled = False
        on = GaugeMetricFamily("mmtrace_bpf_stats_enabled",
                               "1 when kernel.bpf_stats_enabled is on (program run times "
                               "are measured).", value=int(enabled))
        yield on
        if not enabled:
            return
        seconds = CounterMetricFamily("mmtrace_bpf_program_run_seconds",
                                      "Time the kernel spent in each eBPF program.",
                                      labels=["program"])
        runs = CounterMetricFamily("mmtrace_bpf_program_runs", "Runs of each eBPF program.",
                                   labels=["program"])
        for name, fd in sorted(programs.items()):
            stats = _prog_stats(self.proc_root / "self" / "fdinfo" / str(fd))
            if stats is not None:
                seconds.add_metric([name], stats[0] / 1e9)
                runs.add_metric([name], stats[1])
        yield seconds
        yield runs

    # ------------------------------------------------------------ events

    def _submitters(self, counts):
        labels = ["process", "pid"] if self.labels.with_pid else ["process"]
        h = HistogramMetricFamily(
            "mmtrace_submitter_runq_delay_seconds",
            f"Run-queue delay of the threads that submit GPU/NPU work, per process "
            f"(the {self.labels.top_k} busiest by name, the rest as other).", labels=labels)
        for key, hist in top_k(counts.processes, self.labels.top_k, self.labels.with_pid):
            h.add_metric(list(key), hist.cumulative(), hist.sum)
        yield h

    def _workload_names(self) -> list[str]:
        return ["process", "pid"] if self.labels.with_pid else ["process"]

    def _named(self, workloads: dict, pid) -> tuple | None:
        """A process's labels where it is among the top-K (not `other`, nor
        unknown to the counts yet)."""
        key = workloads.get(pid)
        return None if key is None or key == OTHER_LABELS[self.labels.with_pid] else key

    def _launchers(self, workloads: dict, rows: list):
        """The latest window's time split of the threads that launch GPU/NPU
        work, and the starvation detector's threshold and baseline."""
        speaks: dict[tuple, dict] = {}
        for row in rows:
            key = self._named(workloads, row["pid"])
            if key is None:
                continue
            held = speaks.get(key)
            if held is None or row["shares"].get("runnable", 0.0) > \
                    held["shares"].get("runnable", 0.0):
                speaks[key] = row
        names = self._workload_names()
        split = GaugeMetricFamily(
            "mmtrace_launcher_time_share",
            f"Share (0..1) of the wall time of each process's GPU/NPU-launching threads, over "
            f"the latest closed window in which they launched (within ring_seconds), by state: "
            f"on_cpu, runnable (waiting on a run queue), "
            f"sync, copy (in synchronous copies), blocked (asleep otherwise). The "
            f"{self.labels.top_k} busiest processes by name; no other.",
            labels=[*names, "state"])
        threshold = GaugeMetricFamily(
            "mmtrace_launcher_runnable_threshold",
            "The runnable share at which the starvation detector calls a window starved, "
            "per process.", labels=names)
        baseline = GaugeMetricFamily(
            "mmtrace_launcher_runnable_baseline",
            "The starvation detector's baseline runnable share (median of the process's "
            "windows that were not starved), once learnt.", labels=names)
        for key, row in sorted(speaks.items()):
            for state in LAUNCHER_STATES:
                split.add_metric([*key, state], float(row["shares"].get(state, 0.0)))
            if row.get("threshold") is not None:
                threshold.add_metric(list(key), float(row["threshold"]))
            if row.get("baseline") is not None:
                baseline.add_metric(list(key), float(row["baseline"]))
        yield split
        yield threshold
        yield baseline

    def _p99_levels(self, workloads: dict, levels: list):
        """The P99 detector's threshold and baseline per series kind and
        process, for the series of processes (a dispatcher's own series are
        named by it: not labels)."""
        speaks: dict[tuple, tuple[float, float]] = {}
        for kind, pid, base, limit in levels:
            key = self._named(workloads, pid)
            if key is None or base is None or limit is None:
                continue
            held = speaks.get((kind, *key))
            if held is None or limit > held[1]:
                speaks[(kind, *key)] = (base, limit)
        labels = ["detector", "series", *self._workload_names()]
        threshold = GaugeMetricFamily(
            "mmtrace_detector_threshold_seconds",
            "The p99 a window must pass to count as bad, per series kind and process, once "
            "the series' baseline is learnt.", labels=labels)
        baseline = GaugeMetricFamily(
            "mmtrace_detector_baseline_seconds",
            "The P99 detector's baseline p99, per series kind and process, once learnt.",
            labels=labels)
        for (kind, *key), (base, limit) in sorted(speaks.items()):
            threshold.add_metric(["p99_drift", kind, *key], float(limit))
            baseline.add_metric(["p99_drift", kind, *key], float(base))
        yield threshold
        yield baseline

    def _device(self, counts):
        subs = CounterMetricFamily("mmtrace_device_submissions_total",
                                   "GPU/NPU submissions seen by the probes (failed calls "
                                   "not counted: see mmtrace_device_call_failures_total).",
                                   labels=["stream", "kind", "api"])
        for (stream, kind, api), n in sorted(counts.submissions.items()):
            subs.add_metric([stream, kind, api], n)
        yield subs
        memcpy = CounterMetricFamily("mmtrace_device_memcpy_bytes_total",
                                     "Bytes copied by GPU/NPU memcpys that did not fail, "
                                     "by direction.", labels=["stream", "direction"])
        for (stream, direction), n in sorted(counts.memcpy_bytes.items()):
            memcpy.add_metric([stream, direction], n)
        yield memcpy
        failures = CounterMetricFamily(
            "mmtrace_device_call_failures_total",
            "GPU/NPU calls that returned an error code, by API and code (error: the "
            "code's name, unknown where the library's table does not name it).",
            labels=["stream", "api", "code", "error"])
        for (stream, api, code, error), n in sorted(counts.failures.items()):
            failures.add_metric([stream, api, code, error], n)
        yield failures
        for name, doc, hists in (
                ("mmtrace_device_sync_wait_seconds",
                 "Time blocked in GPU/NPU synchronisations.", counts.sync_wait),
                ("mmtrace_device_submit_to_retire_seconds",
                 "From a GPU/NPU submission to the first sync that covered it.",
                 counts.submit_to_retire)):
            h = HistogramMetricFamily(name, doc, labels=["stream"])
            for stream, hist in sorted(hists.items()):
                h.add_metric([stream], hist.cumulative(), hist.sum)
            yield h

    # ------------------------------------------------------------ probes

    def _probes(self, program_states, device_probes, held):
        """1 attached, 0 failed; a symbol absent from its library, or a
        per-launch probe detached on purpose (adaptive mode), is not down."""
        up: dict[tuple[str, str], int] = {}
        by_state: dict[str, int] = {}
        # The scheduler program, and GPU/NPU programs that failed as a whole
        # (they did not compile or load: no library is probed).
        rows = [{"symbol": Path(s.get("program", "sched")).stem,
                 "path": "kernel" if s.get("stream") == "cpu" else "*",
                 "state": s.get("state", ""), "point": s.get("point", ""),
                 "reason": s.get("reason", "")}
                for s in program_states
                if s.get("stream") == "cpu" or (s.get("state") == "failed" and s.get("program"))]
        rows += device_probes or []
        failures: dict[tuple[str, str, str], str] = {}
        for row in rows:
            state = row["state"]
            # Probe points of libraries, as doctor and run --check count them:
            # the scheduler's tracepoints are mmtrace_probe_up{probe="sched"}.
            if row["path"] != "kernel":
                by_state[state] = by_state.get(state, 0) + int(row.get("count", 1))
            if state in ("attached", "failed"):
                key = (row["symbol"], Path(row["path"]).name)
                up[key] = min(up.get(key, 1), int(state == "attached"))
            if state == "failed":
                failures.setdefault((*key, row.get("point", "")),
                                    str(row.get("reason", ""))[:MAX_REASON_CHARS])
        g = GaugeMetricFamily("mmtrace_probe_up", "1 when the probe is attached, 0 when it "
                              "failed to attach.", labels=["probe", "library"])
        for (probe, library), value in sorted(up.items()):
            g.add_metric([probe, library], value)
        yield g
        if failures:
            why = GaugeMetricFamily("mmtrace_probe_failure_info",
                                    "1 for each probe that failed to load or attach, with "
                                    "the reason (as `mmtrace doctor` gives it).",
                                    labels=["probe", "library", "point", "reason"])
            for labels, reason in sorted(failures.items()):
                why.add_metric([*labels, reason], 1)
            yield why
        s = GaugeMetricFamily("mmtrace_probes", "GPU/NPU probe points by state (detached: "
                              "per-launch probes waiting for an alarm).", labels=["state"])
        for state in ("attached", "detached", "not_found", "failed"):
            s.add_metric([state], by_state.get(state, 0))
        yield s
        if held is not None:
            yield GaugeMetricFamily("mmtrace_probed_files", "Files (libraries, executables) "
                                    "the GPU/NPU probes are attached to now.",
                                    value=held["libraries"])
            yield GaugeMetricFamily("mmtrace_probe_links", "Kernel attachments (uprobe_multi "
                                    "links, perf events) the GPU/NPU probes hold now.",
                                    value=held["links"])

    # --------------------------------------------------------- detectors

    def _detectors(self, rows, entropy, anomalies, hints):
        g = GaugeMetricFamily("mmtrace_detector_series",
                              "Series watched by each detector, by series kind and state "
                              "(normal, pending, firing, resolved).",
                              labels=["detector", "series", "state"])
        for (detector, series, state), n in sorted(rows.items()):
            g.add_metric([detector, series, state], n)
        yield g
        e = GaugeMetricFamily("mmtrace_attention_entropy",
                              "Latest mean normalised attention entropy reported, by modality.",
                              labels=["modality"])
        for modality, value in sorted(entropy.items()):
            e.add_metric([modality], value)
        yield e
        a = CounterMetricFamily("mmtrace_anomalies_total", "Anomalies fired, by detector.",
                                labels=["detector"])
        for detector in sorted(set(KNOWN_DETECTORS) | set(anomalies)):
            a.add_metric([detector], anomalies.get(detector, 0))
        yield a
        h = CounterMetricFamily("mmtrace_hints_total",
                                "Hints delivered to subscribed dispatchers, by kind.",
                                labels=["kind"])
        for kind in sorted(set(KNOWN_HINTS) | set(hints)):
            h.add_metric([kind], hints.get(kind, 0))
        yield h

    # -------------------------------------------------------------- otlp

    def _otlp(self, stats):
        spans = CounterMetricFamily(
            "mmtrace_otlp_spans_total",
            "OTLP spans by outcome: exported, failed (in batches the collector refused or "
            "never got), dropped (queue full), capped (sampled submissions over the rate cap).",
            labels=["outcome"])
        for outcome in ("exported", "failed", "dropped", "capped"):
            spans.add_metric([outcome], getattr(stats, outcome))
        yield spans
        yield CounterMetricFamily("mmtrace_otlp_export_failures_total",
                                  "OTLP export batches that failed.", value=stats.failed_batches)

    # ----------------------------------------------------------- devices

    def _devices(self, d: DaemonSnapshot):
        yield GaugeMetricFamily("mmtrace_nvml_up", "1 when NVML answers (GPU device state is "
                                "polled), 0 without a driver or when polling fails.",
                                value=int(d.gpu_up))
        if d.npu_up is not None:
            yield GaugeMetricFamily("mmtrace_npu_smi_up", "1 when npu-smi answers (NPU device "
                                    "state is polled), 0 when it fails.", value=int(d.npu_up))
        for kind, devices in (("gpu", d.gpus), ("npu", d.npus)):
            if devices is not None:
                yield from _device_gauges(kind, devices)


def _device_memory(memory: dict, gpus: list | None, npus: list | None):
    """What traced processes hold (0 on each device NVML or npu-smi knows
    where they hold nothing), their allocation counts, and the calls stuck
    past the hang threshold (agent/daemon/memory_watch.py)."""
    held = GaugeMetricFamily("mmtrace_device_memory_outstanding_bytes",
                             "Device memory that live traced processes hold (allocated and "
                             "not freed; failed allocations hold nothing).",
                             labels=["stream", "device"])
    outstanding = dict(memory["outstanding"])
    for stream, devices in (("gpu", gpus), ("npu", npus)):
        for dev in devices or ():
            outstanding.setdefault((stream, dev.index), 0)
    for (stream, device), n in sorted(outstanding.items()):
        held.add_metric([stream, str(device)], n)
    yield held
    for name, key, doc in (("mmtrace_device_allocations_total", "allocs",
                            "Device memory allocations that succeeded."),
                           ("mmtrace_device_frees_total", "frees",
                            "Device memory frees that gave back a traced allocation.")):
        c = CounterMetricFamily(name, doc, labels=["stream"])
        for stream, n in sorted(memory["totals"][key].items()):
            c.add_metric([stream], n)
        yield c
    stuck = GaugeMetricFamily("mmtrace_device_calls_stuck",
                              "Syncs and blocking calls in flight past the hang threshold "
                              "([hangs] after_s).", labels=["stream"])
    for stream, n in sorted(memory["stuck"].items()):
        stuck.add_metric([stream], n)
    yield stuck


DEVICE_GAUGES = {
    "weight": ("device_weight", "(1 - SM util) x (1 - mem-bw util) x max(0.1, 1/(hops+1))."),
    "profile": ("resource_profile", "0.3 norm(temp, 35-100 C) + 0.4 memory fragmentation + "
                "0.3 bandwidth saturation."),
    "sm_util": ("sm_utilization_ratio", "SM (NPU: AI Core) utilisation, 0..1."),
    "mem_bw_util": ("memory_bandwidth_utilization_ratio", "Memory-bandwidth utilisation, 0..1."),
    "memory_used_bytes": ("memory_used_bytes", "Device memory in use."),
    "memory_total_bytes": ("memory_total_bytes", "Device memory."),
    "temperature_c": ("temperature_celsius", "Device temperature."),
    "power_w": ("power_watts", "Power draw."),
    "hops": ("hops", "Mean links from the device to each other device."),
}


def _device_gauges(kind: str, devices: list):
    """mmtrace_gpu_* {gpu="0"} from NVML, mmtrace_npu_* {npu="0"} from npu-smi."""
    for attr, (suffix, doc) in DEVICE_GAUGES.items():
        g = GaugeMetricFamily(f"mmtrace_{kind}_{suffix}", doc, labels=[kind])
        for dev in devices:
            g.add_metric([str(dev.index)], float(getattr(dev, attr)))
        yield g
    if kind != "gpu":
        return
    pcie = GaugeMetricFamily("mmtrace_gpu_pcie_throughput_bytes_per_second",
                             "PCIe throughput over NVML's last sample.",
                             labels=["gpu", "direction"])
    for dev in devices:
        pcie.add_metric([str(dev.index), "tx"], dev.pcie_tx_bytes_per_s)
        pcie.add_metric([str(dev.index), "rx"], dev.pcie_rx_bytes_per_s)
    yield pcie
    link = GaugeMetricFamily("mmtrace_gpu_nvlink_peer", "1 for each pair of devices "
                             "joined by a direct NVLink.", labels=["gpu", "peer"])
    for dev in devices:
        for peer in dev.nvlink_peers:
            link.add_metric([str(dev.index), str(peer)], 1)
    yield link


def _detector_rows(d: DaemonSnapshot) -> dict:
    """(detector, series kind, state) -> number of series; zeros included,
    so that alert expressions always have series to evaluate."""
    rows = {}
    for kind, state in d.p99_series:
        for each in DETECTOR_STATES:
            rows.setdefault(("p99_drift", kind, each), 0)
        rows[("p99_drift", kind, state)] += 1
    for kind in entropy_drift.KINDS:
        for state in ("normal", "firing"):
            rows[("attention_entropy", kind, state)] = 0
    for state in ("normal", "firing"):
        rows[("starvation", STARVATION_SERIES, state)] = 0
    for row in d.launchers:
        if row.get("share") is not None:        # the detector has judged a window of it
            rows[("starvation", STARVATION_SERIES, "firing" if row["firing"] else "normal")] += 1
    for firing in d.entropy_modalities.values():
        for kind in entropy_drift.KINDS:
            rows[("attention_entropy", kind, "firing" if kind in firing else "normal")] += 1
    return rows


def _prog_stats(fdinfo: Path) -> tuple[int, int] | None:
    """(run_time_ns, run_cnt) from a program fd's fdinfo."""
    try:
        text = fdinfo.read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["run_time_ns"]), int(fields["run_cnt"])
    except (KeyError, ValueError):
        return None


def registry_for(snapshot: Callable[[], DaemonSnapshot], labels: Labels,
                 proc_root: Path = Path("/proc")) -> CollectorRegistry:
    """The daemon's collector (rendering `snapshot()` at each scrape), and
    the agent's own CPU and memory (mmtrace_process_cpu_seconds_total,
    mmtrace_process_resident_memory_bytes, ...)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(snapshot, labels, proc_root))
    ProcessCollector(namespace="mmtrace", pid=lambda: os.getpid(), proc=str(proc_root),
                     registry=registry)
    return registry
