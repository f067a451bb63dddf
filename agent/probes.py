"""Compile and load the eBPF programs as one object, so that every stream
shares the per-thread maps (the GPU/NPU probes read the scheduler's), and
hand out batch readers for their ring buffers."""

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrace import bpf as bpf_sources
from mmtrace.bpf import ascend as ascend_stream
from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import cuda as cuda_stream
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream

from .errors import MmtraceError
from .layout import LayoutMismatch, check_layout
from .privileges import can_load_bpf
from .ringbuf import RingReader

log = logging.getLogger(__name__)

TRACEFS_EVENTS = (Path("/sys/kernel/debug/tracing/events"),
                  Path("/sys/kernel/tracing/events"))


@dataclass
class StreamRing:
    stream: str
    reader: RingReader


@dataclass
class ProbeOptions:
    pids: tuple[int, ...] = ()
    runq_ringbuf_pages: int = 8192      # 32 MiB: ~600k runq records, >1 s at a busy host's rate
    max_threads: int = 65536
    extra_cflags: tuple[str, ...] = ()
    device: bool = True                 # compile the GPU/NPU programs
    dev_ringbuf_pages: int = 2048       # 8 MiB: ~40k device records
    max_calls_in_flight: int = 16384
    trace_launches: bool = True         # False: the adaptive mode, per-launch probes off
    attach_mode: str | None = None      # "multi" / "single"; None: the best the kernel has


def import_bcc():
    try:
        import bcc  # noqa: F401  (Debian's python3-bpfcc)
    except ImportError as exc:
        raise MmtraceError(
            "the bcc Python module is not importable: install Debian's python3-bpfcc "
            "and use a virtual environment made with --system-site-packages "
            f"(scripts/setup does both); import said: {exc}") from None
    return bcc


def require_privileges():
    if not can_load_bpf():
        raise MmtraceError(
            "loading eBPF needs root, or CAP_BPF with CAP_PERFMON; "
            "run it with sudo (mmtrace doctor lists what else is missing)")


def require_tracefs():
    denied = []
    for events in TRACEFS_EVENTS:
        try:
            if (events / "sched" / "sched_switch").exists():
                return
        except PermissionError:
            denied.append(str(events))
    if denied:
        # debugfs is mode 0700: root, or CAP_DAC_READ_SEARCH, may look inside.
        raise MmtraceError(
            f"tracefs is not readable here ({', '.join(denied)}: permission denied); "
            "run as root, or grant CAP_DAC_READ_SEARCH besides CAP_BPF and CAP_PERFMON")
    raise MmtraceError(
        "tracefs is not mounted (no /sys/kernel/debug/tracing/events/sched): "
        "mount -t tracefs nodev /sys/kernel/tracing; "
        "mount -t debugfs nodev /sys/kernel/debug")


@dataclass
class LoadedProbes:
    bpf: object
    rings: list[StreamRing] = field(default_factory=list)
    device: object = None       # agent.device_probes.DeviceProbes: uprobes per library

    def read(self) -> dict[str, np.ndarray]:
        """One batch from every ring; streams with nothing new are left out."""
        out = {}
        for ring in self.rings:
            batch = ring.reader.read()
            if len(batch):
                out[ring.stream] = batch
        return out

    def counters(self) -> dict[str, int]:
        return bpf_counters.read_counters(self.bpf["counters"])

    def runq_hist(self) -> list[int]:
        return sched_stream.hist_from_table(self.bpf[sched_stream.HIST_MAP])

    def learn_threads(self, tid_to_tgid: dict[int, int]):
        """Tell the kernel the process of threads it has not seen switch out."""
        set_thread_tgids(self.bpf, tid_to_tgid)

    def close(self):
        if self.device is not None:
            self.device.close()
            self.device = None
        for ring in self.rings:
            ring.reader.close()
        self.rings.clear()
        if self.bpf is not None:
            self.bpf.cleanup()
            self.bpf = None


def program_text(options: ProbeOptions) -> str:
    """One compilation unit: the device programs read the scheduler's
    per-thread maps, and sched.c forgets a freed thread's device calls."""
    parts = [bpf_sources.source("common.h"), bpf_sources.source(device_stream.HEADER),
             bpf_sources.source(sched_stream.SOURCE)]
    if options.device:
        multi = attach_mode(options) == "multi"
        parts += [bpf_sources.source(cuda_stream.SOURCE), bpf_sources.source(ascend_stream.SOURCE),
                  device_stream.default_table().generated_programs(multi=multi)]
    return "\n".join(parts)


def attach_mode(options: ProbeOptions) -> str:
    """How the GPU/NPU probes attach (agent/device_probes.py): uprobe_multi
    links where the kernel has them, else one uprobe per symbol."""
    if options.attach_mode is not None:
        if options.attach_mode not in ("multi", "single"):
            raise MmtraceError(f"attach mode must be multi or single, "
                               f"got {options.attach_mode!r}")
        return options.attach_mode
    from .uprobe_link import uprobe_multi_available
    return "multi" if uprobe_multi_available() else "single"


def cflags(options: ProbeOptions) -> list[str]:
    flags = [
        f"-DMMTRACE_MAX_THREADS={options.max_threads}",
        f"-DMMTRACE_RUNQ_RINGBUF_PAGES={options.runq_ringbuf_pages}",
        f"-DMMTRACE_DEV_RINGBUF_PAGES={options.dev_ringbuf_pages}",
        f"-DMMTRACE_MAX_CALLS={options.max_calls_in_flight}",
        f"-DMMTRACE_CALL_SLOTS={device_stream.default_table().call_slots}",
        f"-DMMTRACE_MAX_CPUS={possible_cpu_slots()}",
        "-Wno-macro-redefined",
    ]
    return flags + list(options.extra_cflags)


def possible_cpu_slots(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """One more than the highest CPU id the kernel may bring online, from
    its "0-3,8-11" list; 4096 where the file cannot be read."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 4096
    return max(int(part.split("-")[-1]) for part in text.split(",")) + 1


def threads_of(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    try:
        return [int(t) for t in os.listdir(proc_root / str(pid) / "task")]
    except OSError:
        return []


def load(options: ProbeOptions = ProbeOptions()) -> LoadedProbes:
    """Compile, load and attach the scheduler program, and ready the GPU/NPU
    programs (attached per library through `probes.device`); raise
    MmtraceError with the reason when this host cannot."""
    require_privileges()
    require_tracefs()
    bcc = import_bcc()
    pages = options.runq_ringbuf_pages
    for what, value in (("ring buffer pages", pages),
                        ("device ring buffer pages", options.dev_ringbuf_pages)):
        if value <= 0 or value & (value - 1):
            raise MmtraceError(f"{what} must be a power of two, got {value}")
    try:
        program = bcc.BPF(text=program_text(options), cflags=cflags(options))
    except Exception as exc:  # bcc raises bare Exception on compile/attach failure
        raise MmtraceError(
            f"the eBPF programs did not load ({exc}); "
            "run `mmtrace doctor` for kernel headers and tracefs") from None
    probes = LoadedProbes(bpf=program)
    try:
        check_layout("runq_event", sched_stream.RUNQ_EVENT,
                     program[sched_stream.LAYOUT_MAP].Leaf)
        if len(program["counters"]) != len(bpf_counters.COUNTER_NAMES):
            raise LayoutMismatch(
                f"counters: expected {len(bpf_counters.COUNTER_NAMES)} entries, "
                f"the compiled program has {len(program['counters'])}")
        _set_scope(program, options.pids)
        ring = program[sched_stream.RINGBUF]
        size = pages * 4096 if ring.max_entries == 0 else ring.max_entries
        probes.rings.append(StreamRing(
            "cpu", RingReader(ring.map_fd, size, sched_stream.RUNQ_EVENT)))
        check_layout("dev_event", device_stream.DEV_EVENT,
                     program[device_stream.LAYOUT_MAP].Leaf)
        dev_ring = program[device_stream.RINGBUF]
        dev_size = (options.dev_ringbuf_pages * 4096 if dev_ring.max_entries == 0
                    else dev_ring.max_entries)
        probes.rings.append(StreamRing(
            "dev", RingReader(dev_ring.map_fd, dev_size, device_stream.DEV_EVENT)))
        if options.device:
            from .device_probes import DeviceProbes
            probes.device = DeviceProbes(program, launches=options.trace_launches,
                                         mode=attach_mode(options))
    except LayoutMismatch as exc:
        probes.close()
        raise MmtraceError(str(exc)) from None
    except BaseException:
        probes.close()
        raise
    return probes


def set_thread_tgids(program, tid_to_tgid: dict[int, int]):
    """Set the process of these threads in the per-thread map, keeping
    whatever else the kernel already holds for them."""
    table = program["threads"]
    for tid, tgid in tid_to_tgid.items():
        key = table.Key(tid)
        try:
            leaf = table[key]
        except KeyError:
            leaf = table.Leaf()
        leaf.tgid = tgid
        table[key] = leaf


def _set_scope(program, pids):
    """Fill the scope, then mark it configured: the programs trace nothing
    until then, so no event from outside the scope slips in at start."""
    scope = program["scope_tgids"]
    for pid in pids:
        scope[scope.Key(pid)] = scope.Leaf(1)
        set_thread_tgids(program, {tid: pid for tid in threads_of(pid)})
    settings = program["settings"]
    leaf = settings.Leaf()
    leaf.filter_pids = 1 if pids else 0
    leaf.configured = 1
    settings[settings.Key(0)] = leaf
