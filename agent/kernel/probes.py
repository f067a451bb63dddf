"""Compile and load the eBPF programs as one object, so that every stream
shares the per-thread maps (the GPU/NPU probes read the scheduler's), and
hand out batch readers for their ring buffers."""

import functools
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrace import bpf as bpf_sources
from mmtrace.bpf import ascend as ascend_stream
from mmtrace.bpf import device_memory as memory_stream
from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import cuda as cuda_stream
from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream

from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.kernel import compiled_module, compiler_memory

from mmtrace.agent.kernel import compiler_output
from mmtrace.agent.kernel.concurrent_close import close_all
from mmtrace.agent.errors import MmtraceError, os_failure
from mmtrace.agent.kernel.layout import LayoutMismatch, check_layout
from mmtrace.agent.kernel.privileges import can_load_bpf
from mmtrace.agent.kernel.device_ring import DeviceRing
from mmtrace.agent.kernel.ringbuf import RingReader

log = logging.getLogger(__name__)

TRACEFS_EVENTS = (Path("/sys/kernel/debug/tracing/events"),
                  Path("/sys/kernel/tracing/events"))
# The probe state of the scheduler program once load_cpu has returned: the
# first row of a recording's (and a flight recording's) probe states.
CPU_PROBE_STATE = {"stream": "cpu", "program": sched_stream.SOURCE, "state": "attached"}


@dataclass
class StreamRing:
    stream: str
    reader: RingReader | DeviceRing

    def filenos(self) -> tuple[int, ...]:
        """The descriptors to wait on (the device stream reads two rings)."""
        filenos = getattr(self.reader, "filenos", None)
        return filenos() if filenos is not None else (self.reader.fileno(),)

    def filled(self) -> float:
        """The largest share of its ring(s) written and not yet read."""
        return self.reader.filled()


@dataclass
class ProbeOptions:
    pids: tuple[int, ...] = ()
    # The rings absorb what arrives between a wake-up and the drain that
    # follows (the reader is woken when one is about a quarter full, and
    # drains at least every few hundred ms), and a daemon kept off the CPU
    # for a while: 8 MiB holds ~150k runq records, 0.6 s at 250k/s, 7 s at
    # the rated 20k/s. The agent maps each ring once (its size counts once
    # in its RSS, from the start: agent/kernel/ringbuf.py).
    runq_ringbuf_pages: int = 2048      # 8 MiB
    max_threads: int = 65536
    extra_cflags: tuple[str, ...] = ()
    device: bool = True                 # compile the GPU/NPU programs
    # The device ring takes every call whole (144-byte records, 152 with
    # the ring's header): the launches whose return is probed, and every
    # one while a process's calls fail. Sized for a burst of 50 000
    # launches back to back held whole with no drain at all (55 188 records
    # in 8 MiB), about 55 ms at the ~1 M/s the uprobe trap allows here; its
    # reader drains it well before (at a signal once 1/16 full). The
    # launch ring (the other launches, 72 bytes with the header) is half
    # its size for the same burst (58 254). Memory: 12 MiB of kernel
    # memory, mapped by the agent (12 MiB of its RSS once written).
    dev_ringbuf_pages: int = 2048       # 8 MiB
    # Names (a kernel handle's, an aclop call's opType) and each thread's
    # comm, once: rare beside calls. 1 MiB: ~4 300 records.
    dev_names_ringbuf_pages: int = 256
    max_calls_in_flight: int = 16384
    trace_launches: bool = True         # False: the adaptive mode, per-launch probes off
    attach_mode: str | None = None      # "multi" / "single"; None: the best the kernel has
    # Per-launch calls whose return code is probed: one in N on each CPU, and
    # every call of a process whose calls failed in the last second (uprobe
    # sessions, Linux 6.13+, multi mode); 1: every call; 0: none.
    launch_return_every: int = 64

    @property
    def dev_launch_ringbuf_pages(self) -> int:
        """The launch ring: half the device ring (its records are half the size)."""
        return max(1, self.dev_ringbuf_pages // 2)


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


class Programs:
    """The compiled programs seen as one bcc object: tables and functions
    are looked up in the scheduler's program, then the GPU/NPU one's."""

    def __init__(self, sched, device=None):
        self.sched = sched
        self.device = device
        # The device program's own tables: a miss in the scheduler's costs
        # bcc a lookup by name each time (the daemon asks every check).
        self._device_names: set = set()

    def __getitem__(self, name):
        if name in self._device_names and self.device is not None:
            return self.device[name]
        try:
            return self.sched[name]
        except KeyError:
            if self.device is None:
                raise
            table = self.device[name]
            self._device_names.add(name)
            return table

    @property
    def funcs(self) -> dict:
        return {**self.sched.funcs, **(self.device.funcs if self.device is not None else {})}

    def cleanup(self):
        for program in (self.device, self.sched):
            if program is not None:
                program.cleanup()
        self.device = None

    @property
    def tracepoint_fds(self) -> dict:
        return {**self.sched.tracepoint_fds,
                **(self.device.tracepoint_fds if self.device is not None else {})}

    def detach_tracepoint(self, tp):
        owner = self.sched if tp in self.sched.tracepoint_fds else self.device
        owner.detach_tracepoint(tp)


@dataclass
class LoadedProbes:
    bpf: object
    rings: list[StreamRing] = field(default_factory=list)
    device: object = None       # agent.kernel.device_probes.DeviceProbes: uprobes per library
    options: ProbeOptions = field(default_factory=ProbeOptions)
    split: bool = False         # the GPU/NPU programs compiled apart (load_cpu's compile_apart)
    device_program: object = None   # compiled, not yet wired (compile_device)
    # The parsed files this session's addresses are named from: the device
    # probes forget each file they release (exited_process_resolver reads it).
    elf_cache: ElfCache = field(default_factory=ElfCache)
    # The programs' tables' own descriptors (compiled_module.own_tables).
    owned_fds: list[int] = field(default_factory=list)

    def read(self) -> dict[str, np.ndarray]:
        """One batch from every ring; streams with nothing new are left out."""
        out = {}
        for ring in list(self.rings):
            batch = ring.reader.read()
            if len(batch):
                out[ring.stream] = batch
        return out

    def counters(self) -> dict[str, int]:
        return bpf_counters.read_counters(self.bpf["counters"])

    def device_table(self, name: str):
        """A map of the GPU/NPU programs (bpf/device_memory.py's, calls in
        flight), or None before they are wired."""
        if self.device is None:
            return None
        return self.bpf[name]

    def runq_hist(self) -> list[int]:
        return sched_stream.hist_from_table(self.bpf[sched_stream.HIST_MAP])

    def figures(self) -> dict:
        """What the maps hold now, for the metrics (read, never cleared): the
        run-queue histogram and its sum, every counter, and each program's
        fd (its run-time statistics are in /proc/self/fdinfo)."""
        programs = {(n.decode() if isinstance(n, bytes) else n): fn.fd
                    for n, fn in getattr(self.bpf, "funcs", {}).items()}
        return {"runq_slots": self.runq_hist(),
                "runq_total_ns": sched_stream.sum_from_table(self.bpf[sched_stream.SUM_MAP]),
                "counters": self.counters(), "programs": programs}

    def thread_comms(self) -> dict[str, int]:
        """How the device events' comms were found: threads_sent (the
        kernel's comm records), comm_from_proc, comm_unknown (device_ring.py);
        and what compact launches missed: pid_from_proc, pid_unknown,
        outer_caller_unknown (launch_records.py)."""
        for ring in self.rings:
            comms = getattr(ring.reader, "comms", None)
            if comms is not None:
                return dict(comms.counters + ring.reader.facts.counters)
        return {}

    def learn_threads(self, tid_to_tgid: dict[int, int]):
        """Tell the kernel the process of threads it has not seen switch out."""
        set_thread_tgids(self.bpf, tid_to_tgid)

    @property
    def device_pending(self) -> bool:
        """The GPU/NPU programs are wanted and not wired yet."""
        return self.options.device and self.device is None and self.bpf is not None

    def compile_device(self):
        """Compile and load the GPU/NPU programs on the scheduler's maps (in
        any thread: the CPU stream drains meanwhile); load_device wires them."""
        if self.split and self.device_program is None:
            program = _compile(device_text(self.options),
                               cflags(self.options) + ["-DMMTRACE_SHARED_EXTERN"])
            try:
                self.owned_fds += compiled_module.own_tables(program)
                compiled_module.drop_module(program, _device_loader(program, self.options))
            except BaseException:
                program.cleanup()           # its autoloaded tracepoints go with it
                raise
            self.device_program = program
            compiler_memory.release()

    def load_device(self):
        """Wire the GPU/NPU programs: their ring, and DeviceProbes to attach
        them per library. Compiles them first where compile_device did not."""
        if not self.device_pending:
            return
        try:
            self.compile_device()
            if self.split:
                self.bpf = Programs(self.bpf, self.device_program)
                self.device_program = None
            program = self.bpf
            self.rings.append(_device_ring(program, self.options))
            from mmtrace.agent.kernel.device_probes import DeviceProbes
            self.device = DeviceProbes(program.device if self.split else program,
                                       launches=self.options.trace_launches,
                                       mode=attach_mode(self.options),
                                       sessions=launch_sessions(self.options),
                                       elf_cache=self.elf_cache)
        except LayoutMismatch as exc:
            raise MmtraceError(str(exc)) from None
        finally:
            self.drop_scheduler_module()

    def drop_scheduler_module(self):
        """The scheduler's bcc module, kept for the GPU/NPU programs compiled
        apart, goes once they are wired or cannot be."""
        if self.split and self.bpf is not None:
            compiled_module.drop_module(getattr(self.bpf, "sched", self.bpf), _autoloaded)

    def close(self):
        if self.device is not None:
            self.device.close()
            self.device = None
        for ring in self.rings:
            ring.reader.close()
        self.rings.clear()
        if self.device_program is not None:
            self.device_program.cleanup()
            self.device_program = None
        if self.bpf is not None:
            close_all([functools.partial(self.bpf.detach_tracepoint, tp)
                       for tp in list(self.bpf.tracepoint_fds)], "tracepoint")
            self.bpf.cleanup()
            self.bpf = None
        compiled_module.close_owned(self.owned_fds)


def program_text(options: ProbeOptions) -> str:
    """One compilation unit: the device programs read the scheduler's
    per-thread maps, and sched.c forgets a freed thread's device calls."""
    parts = [bpf_sources.source("common.h"), bpf_sources.source(device_stream.HEADER),
             bpf_sources.source(sched_stream.SOURCE)]
    if options.device:
        parts.append(_device_programs(options))
    return "\n".join(parts)


def sched_text() -> str:
    """The scheduler program alone: the CPU stream, live before the rest compiles."""
    return "\n".join([bpf_sources.source("common.h"), bpf_sources.source(sched_stream.SOURCE)])


def device_text(options: ProbeOptions) -> str:
    """The GPU/NPU programs alone, on the maps sched_text exports."""
    return "\n".join([bpf_sources.source("common.h"), bpf_sources.source(device_stream.HEADER),
                      _device_programs(options)])


def _device_programs(options: ProbeOptions) -> str:
    multi = attach_mode(options) == "multi"
    return "\n".join([bpf_sources.source(cuda_stream.SOURCE),
                      bpf_sources.source(ascend_stream.SOURCE),
                      bpf_sources.source(memory_stream.SOURCE),
                      device_stream.default_table().generated_programs(
                          multi=multi, sessions=launch_sessions(options))])


def launch_sessions(options: ProbeOptions) -> bool:
    """Whether per-launch calls are probed as uprobe sessions, their return
    codes sampled (bpf/device.h launch_return_wanted): multi mode on a
    kernel that has them, unless launch_return_every is 0."""
    every = options.launch_return_every
    if not isinstance(every, int) or isinstance(every, bool) or not 0 <= every <= 1 << 20:
        raise MmtraceError(f"launch_return_every must be an integer from 0 to {1 << 20}, "
                           f"got {every!r}")
    if every == 0 or attach_mode(options) != "multi":
        return False
    from mmtrace.agent.kernel.uprobe_link import uprobe_session_available
    return uprobe_session_available()


def launch_returns(options: ProbeOptions) -> str:
    """How the return codes of per-launch calls are probed, for a person."""
    if not launch_sessions(options):
        if options.launch_return_every == 0:
            return "per-launch return codes: off (launch_return_every = 0)"
        return ("per-launch return codes: not probed (needs uprobe sessions, Linux 6.13+, "
                "and uprobe_multi links)")
    every = options.launch_return_every
    sampled = "every call" if every == 1 else f"1 call in {every} per CPU"
    return (f"per-launch return codes: {sampled}, and every call of a process whose "
            "calls failed in the last second")


def attach_mode(options: ProbeOptions) -> str:
    """How the GPU/NPU probes attach (agent/kernel/probe_attach.py): uprobe_multi
    links where the kernel has them, else one uprobe per symbol."""
    if options.attach_mode is not None:
        if options.attach_mode not in ("multi", "single"):
            raise MmtraceError(f"attach mode must be multi or single, "
                               f"got {options.attach_mode!r}")
        return options.attach_mode
    from mmtrace.agent.kernel.uprobe_link import uprobe_multi_available
    return "multi" if uprobe_multi_available() else "single"


def cflags(options: ProbeOptions) -> list[str]:
    flags = [
        f"-DMMTRACE_MAX_THREADS={options.max_threads}",
        f"-DMMTRACE_RUNQ_RINGBUF_PAGES={options.runq_ringbuf_pages}",
        f"-DMMTRACE_DEV_RINGBUF_PAGES={options.dev_ringbuf_pages}",
        f"-DMMTRACE_DEV_NAMES_RINGBUF_PAGES={options.dev_names_ringbuf_pages}",
        f"-DMMTRACE_DEV_LAUNCH_RINGBUF_PAGES={options.dev_launch_ringbuf_pages}",
        f"-DMMTRACE_MAX_CALLS={options.max_calls_in_flight}",
        f"-DMMTRACE_CALL_SLOTS={device_stream.default_table().call_slots}",
        f"-DMMTRACE_MAX_CPUS={possible_cpu_slots()}",
        f"-DMMTRACE_RUNQ_WAKEUP_EVERY="
        f"{wakeup_period(options.runq_ringbuf_pages, sched_stream.RUNQ_EVENT.itemsize)}",
        f"-DMMTRACE_DEV_WAKEUP_EVERY="
        f"{wakeup_period(options.dev_ringbuf_pages, device_stream.DEV_RECORD.itemsize)}",
        f"-DMMTRACE_DEV_NAMES_WAKEUP_EVERY="
        f"{wakeup_period(options.dev_names_ringbuf_pages, device_stream.DEV_NAMED.itemsize)}",
        f"-DMMTRACE_DEV_LAUNCH_WAKEUP_EVERY="
        f"{wakeup_period(options.dev_launch_ringbuf_pages, device_stream.DEV_LAUNCH.itemsize)}",
        "-Wno-macro-redefined",
    ] + task_rename_flags()
    if exit_has_group_dead():
        flags.append("-DMMTRACE_EXIT_GROUP_DEAD")
    if options.device and launch_sessions(options):
        flags += ["-DMMTRACE_LAUNCH_SESSIONS",
                  f"-DMMTRACE_RETURN_EVERY={options.launch_return_every}"]
    return flags + list(options.extra_cflags)


@functools.cache
def tracepoint_format(system: str, event: str) -> str | None:
    """A tracepoint's format as tracefs gives it; None where it has none."""
    for events in TRACEFS_EVENTS:
        try:
            return (events / system / event / "format").read_text()
        except OSError:
            continue
    return None


def exit_has_group_dead() -> bool:
    """sched_process_exit says whether the thread was its process's last
    (group_dead, Linux 6.x); without it, the leader's exit stands for it."""
    return "group_dead" in (tracepoint_format("sched", "sched_process_exit") or "")


def task_rename_flags() -> list[str]:
    """The task_rename tracepoint, where tracefs has it: a renamed thread's
    comm is sent again (bpf/device.h comm_changed). Its format has the
    renamed task's pid on most kernels; without it, the current task."""
    text = tracepoint_format("task", "task_rename")
    if text is None:
        return []
    return ["-DMMTRACE_TASK_RENAME"] + (["-DMMTRACE_TASK_RENAME_PID"] if " pid;" in text else [])


def wakeup_period(pages: int, record_size: int, cpus: int | None = None) -> int:
    """Records each CPU submits between forced wake-ups of the reader: the
    ring is about a quarter full when every CPU has reached its period."""
    records = pages * 4096 // (record_size + 8)        # 8: the ring's record header
    return max(1, records // (4 * (cpus or os.cpu_count() or 1)))


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


def load(options: ProbeOptions | None = None, *, compile_apart: bool = False) -> LoadedProbes:
    """Compile, load and attach the scheduler program, and ready the GPU/NPU
    programs (attached per library through `probes.device`); raise
    MmtraceError with the reason when this host cannot. `compile_apart`:
    as for load_cpu."""
    probes = load_cpu(options, compile_apart=compile_apart)
    try:
        probes.load_device()
    except BaseException:
        probes.close()
        raise
    return probes


# bcc's own table of exported maps is per process and outlives the program
# that filled it: this mirrors it, so that a second split load in one process
# is refused (it would share another load's maps) rather than taken silently.
_split_loads_in_process = 0


def _refuse_a_second_split_load():
    global _split_loads_in_process
    if _split_loads_in_process:
        raise MmtraceError("compile_apart: this process has already loaded the programs "
                           "apart, and bcc keeps the first load's exported maps by name; "
                           "load with compile_apart=False")
    _split_loads_in_process += 1


def load_cpu(options: ProbeOptions | None = None, *,
             compile_apart: bool = False) -> LoadedProbes:
    """The CPU stream live: the scheduler program compiled, loaded and
    attached, its ring read. The GPU/NPU programs follow through
    load_device. Raises MmtraceError with the reason when this host cannot.

    With `compile_apart`, the scheduler program compiles alone and exports
    the maps every stream shares: the CPU stream is live at once, and the
    GPU/NPU programs compile afterwards on those very maps (compile_device,
    in any thread meanwhile). bcc keeps exported maps by name, once per
    process, and keeps a name after its program is gone (the descriptor it
    holds may then name another map): only the first load of a process may
    compile apart, and only its caller knows that it is the first (the
    daemon and the `record`, `doctor` and `run --check` commands load once
    per process). Otherwise everything compiles now as one unit."""
    options = options or ProbeOptions()
    require_privileges()
    require_tracefs()
    import_bcc()
    pages = options.runq_ringbuf_pages
    for what, value in (("ring buffer pages", pages),
                        ("device ring buffer pages", options.dev_ringbuf_pages),
                        ("device names ring buffer pages", options.dev_names_ringbuf_pages)):
        if value <= 0 or value & (value - 1):
            raise MmtraceError(f"{what} must be a power of two, got {value}")
    split = options.device and compile_apart
    if split:
        _refuse_a_second_split_load()
        program = _compile(sched_text(), cflags(options) + ["-DMMTRACE_SHARED_PUBLIC"])
    else:
        program = _compile(program_text(options), cflags(options) + ["-DMMTRACE_DEVICE_IN_UNIT"])
        compiler_memory.release()      # compiling is done: its leftovers go
    probes = LoadedProbes(bpf=program, options=options, split=split)
    try:
        probes.owned_fds += compiled_module.own_tables(program)
        check_layout("runq_event", sched_stream.RUNQ_EVENT,
                     program[sched_stream.LAYOUT_MAP].Leaf)
        if len(program["counters"]) != len(bpf_counters.COUNTER_NAMES):
            raise LayoutMismatch(
                f"counters: expected {len(bpf_counters.COUNTER_NAMES)} entries, "
                f"the compiled program has {len(program['counters'])}")
        _set_scope(program, options.pids)
        ring = program[sched_stream.RINGBUF]
        size = pages * 4096 if ring.max_entries == 0 else ring.max_entries
        try:
            reader = RingReader(ring.map_fd, size, sched_stream.RUNQ_EVENT)
        except OSError as exc:
            raise os_failure("the CPU stream's ring could not be mapped", exc) from None
        probes.rings.append(StreamRing("cpu", reader))
        # Every program loaded, bcc's module goes; but the GPU/NPU programs
        # compiled apart find the maps the scheduler's exports through it
        # (without it, they do not load): then it goes once they are in.
        if not split:
            compiled_module.drop_module(program, _device_loader(program, options)
                                        if options.device else _autoloaded)
    except LayoutMismatch as exc:
        probes.close()
        raise MmtraceError(str(exc)) from None
    except BaseException:
        probes.close()
        raise
    return probes


def _device_loader(program, options: ProbeOptions):
    from mmtrace.agent.kernel.device_probes import program_loader
    return program_loader(program, attach_mode(options), launch_sessions(options))


def _autoloaded(fn_name: str):
    """The scheduler's programs are all tracepoint__ ones, which bcc loads
    and attaches as it compiles them: any other keeps the module."""
    raise KeyError(f"{fn_name}: a scheduler program bcc did not load")


def _compile(text: str, flags: list[str]):
    bcc = import_bcc()
    with compiler_output.captured() as diagnostics:
        try:
            return bcc.BPF(text=text, cflags=flags)
        except Exception as exc:  # bcc raises bare Exception on compile/attach failure
            failure = exc
    said = diagnostics.errors()
    raise MmtraceError(
        f"the eBPF programs did not load ({failure}{': ' + said if said else ''}); "
        "run `mmtrace doctor` for kernel headers and tracefs")


def _device_ring(program, options: ProbeOptions) -> StreamRing:
    """The device stream's rings: calls, names and launches
    (agent/kernel/device_ring.py)."""
    check_layout("dev_event", device_stream.DEV_RECORD, program[device_stream.LAYOUT_MAP].Leaf)
    check_layout("dev_named_event", device_stream.DEV_NAMED,
                 program[device_stream.NAMED_LAYOUT_MAP].Leaf)
    check_layout("dev_launch", device_stream.DEV_LAUNCH,
                 program[device_stream.LAUNCH_LAYOUT_MAP].Leaf)
    readers = []
    try:
        for name, pages, dtype in ((device_stream.RINGBUF, options.dev_ringbuf_pages,
                                    device_stream.DEV_RECORD),
                                   (device_stream.NAMES_RINGBUF, options.dev_names_ringbuf_pages,
                                    device_stream.DEV_NAMED),
                                   (device_stream.LAUNCHES_RINGBUF,
                                    options.dev_launch_ringbuf_pages,
                                    device_stream.DEV_LAUNCH)):
            ring = program[name]
            size = pages * 4096 if ring.max_entries == 0 else ring.max_entries
            try:
                readers.append(RingReader(ring.map_fd, size, dtype))
            except OSError as exc:
                raise os_failure(f"the GPU/NPU ring {name} could not be mapped", exc) from None
    except BaseException:
        for reader in readers:          # the first mapped, the second refused
            reader.close()
        raise
    events, names, launches = readers
    return StreamRing("dev", DeviceRing(events, names, launches=launches))


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
