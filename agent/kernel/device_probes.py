"""The GPU/NPU uprobes of one loaded bcc object: attach them to library
files, release the files no traced process maps any more, and switch the
per-launch probes off and on (the adaptive mode).

Each file is opened once and probed through its descriptor
(agent/kernel/probed_file.py), its probes planned from its symbols
(probe_plan.py) and attached in the kernel's best mode (probe_attach.py).

Every link and descriptor belongs to the library it probes, and goes with
it: `release(targets)` detaches a file no traced process maps any more
(discovery says which), and keeps the file open a few seconds more so that
the names of its last events can still be read from it (retired_files.py).
Links are closed side by side (concurrent_close.py): each close waits for
an RCU grace period, and waits that overlap are shared.

Per-launch probes (kernel launches, aclnn/aclop submissions) cost one trap
per launch, thousands per second on a busy server. In the adaptive mode they
are detached while graph launches, copies, syncs and the scheduler stay on;
`attach_launches(duration_s)` turns them on for a bounded time (an alarm, a
recording) and off again. Detaching a uprobe touches no other probe and no
ring buffer, so no other event is lost.
"""

import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from mmtrace.bpf import counters as bpf_counters
from mmtrace.bpf import device as device_stream

from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.kernel import probe_report
from mmtrace.agent.kernel.launch_window import LaunchWindow
from mmtrace.agent.kernel.probe_attach import MULTI, ProbeAttacher, raise_limits
from mmtrace.agent.kernel.probe_plan import ProbePlanner, SymbolIds, SymbolsUnreadable
from mmtrace.agent.kernel.probed_file import (ATTACHED, DETACHED, LAUNCHES_OFF, RELEASED,
                                              NotOpened, PathTarget, Probe, ProbedFile,
                                              ProbeState, exited_before_attach,
                                              open_probed_file, target_from_path)
from mmtrace.agent.kernel.probed_symbols import ProbedSymbols
from mmtrace.agent.kernel.retired_files import RetiredFiles

log = logging.getLogger(__name__)

REWRITE_CHECK_S = 2.0       # how often libraries are checked for in-place rewrites
# The tracepoints that tell discovery a process's mapped files changed,
# and their programs (bpf/device.h).
PROCESS_CHANGE_TRACEPOINTS = (("syscalls:sys_enter_mmap", "process_mapping"),
                              ("syscalls:sys_exit_mmap", "process_mapped"))


def program_loader(bpf, mode: str, sessions: bool,
                   table: device_stream.ApiTable | None = None) -> Callable[[str], None]:
    """Loads a GPU/NPU program by name as attaching it will (a process-change
    tracepoint's, or a probe's through ProbeAttacher.load: bcc keeps the
    first load by name), so that bcc's module can go before anything is
    attached (agent/kernel/compiled_module.py)."""
    from bcc import BPF
    attacher = ProbeAttacher(bpf, mode, sessions)
    session_fns = {api.session_fn for api in (table or device_stream.default_table()).apis
                   if api.per_launch}
    tracepoint_fns = {fn for _, fn in PROCESS_CHANGE_TRACEPOINTS}

    def load(fn_name: str):
        if fn_name in tracepoint_fns:
            bpf.load_func(fn_name.encode(), BPF.TRACEPOINT)
        else:
            attacher.load(fn_name, session=fn_name in session_fns)
    return load


class DeviceProbes:
    """The uprobes of one loaded bcc object.

    Thread-safe: a timer thread may end a launch-tracing window while the
    owner's loop attaches newly discovered libraries.

    `counters`: released_libraries (files released since the start),
    library_failures (files that could not be probed; the latest
    MAX_LIBRARY_FAILURES keep their row), exited_before_attach (files whose
    process, the one discovery found mapping them, had exited by the time
    their probes were attached: that process went untraced).

    `elf_cache`, where given, is told to forget each released file once its
    descriptor closes: the names of its addresses are read through it."""

    def __init__(self, bpf, table: device_stream.ApiTable | None = None,
                 launches: bool = True, mode: str | None = None, *,
                 sessions: bool = False,
                 proc_root: Path = Path("/proc"), clock=time.monotonic,
                 elf_cache: ElfCache | None = None):
        self.bpf = bpf
        self.elf_cache = elf_cache
        self.table = table or device_stream.default_table()
        self.mode = mode or MULTI
        self.proc_root = Path(proc_root)
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.wanted = ProbedSymbols(self.table)
        self.symbol_ids = SymbolIds()
        self.planner = ProbePlanner(self.table, self.wanted, self.symbol_ids)
        self.attacher = ProbeAttacher(bpf, self.mode, sessions)
        self._launches = launches
        self._libraries: dict[tuple[int, int], ProbedFile] = {}
        self._failed = probe_report.FailedFiles()
        self._retired = RetiredFiles(lambda key: key in self._libraries, elf_cache)
        self._window = LaunchWindow(self._end_window)
        self._lock = threading.RLock()
        self._closed = False
        self._changes_taken = None      # process_changes(), once turned on
        self._next_rewrite_check = 0.0

    @property
    def _probes(self) -> list[Probe]:
        return [p for library in self._libraries.values() for p in library.probes]

    # ----- libraries -------------------------------------------------------

    def add(self, target) -> list[ProbeState]:
        """Attach every probe `target` (a discovery.LibraryTarget, or
        anything with path, dev, inode, symbols, origin) offers; return the
        states of its probes. A file already attached is skipped."""
        with self._lock:
            if self._closed:
                return []
            key = (int(target.dev), int(target.inode))
            if key in self._libraries:
                return []
            try:
                library = open_probed_file(target)
            except NotOpened as exc:
                return [self._library_failed(target, str(exc))]
            replaced = self._replaced(library)
            self._libraries[key] = library
            library.probes = self._plan(library, getattr(target, "symbols", frozenset()))
            raise_limits(sum(len(lib.probes) for lib in self._libraries.values()))
            self.attacher.attach([p for p in library.probes if p.state == DETACHED
                                  and (self._launches or not p.api.per_launch)])
            if replaced is not None:
                log.warning("%s was replaced on disk (inode %d, now %d): the new file is "
                            "probed too; the old one keeps its probes while processes map it",
                            library.path, replaced.inode, library.inode)
            if exited_before_attach(target, self.proc_root):
                self.counters["exited_before_attach"] += 1
            return probe_report.summarise(library.probes)

    def add_path(self, path: str) -> list[ProbeState]:
        return self.add(target_from_path(path))

    def _plan(self, library: ProbedFile, offered: frozenset) -> list[Probe]:
        try:
            return self.planner.plan(library, offered, self._launches)
        except SymbolsUnreadable as exc:
            self._library_failed(library, str(exc))
            return []

    def _replaced(self, library: ProbedFile) -> ProbedFile | None:
        """The library probed before at the same path, when that path now
        holds another file."""
        return next((old for old in self._libraries.values() if old.path == library.path),
                    None)

    def _library_failed(self, target, reason: str) -> ProbeState:
        self.counters["library_failures"] += 1
        return self._failed.add(target, reason)

    def release(self, targets, reason: str = RELEASED) -> int:
        """Detach the files `targets` name (anything with path, dev and
        inode) and drop their state, failure rows included; returns how many
        were probed. Each stays open
        RETIRED_KEEP_S more (decoding_files() lists it), so that the names
        of events already in the rings still resolve. Files not probed are
        ignored. Also closes the released files whose time is up, so call
        it often (with no targets it does only that)."""
        targets = list(targets)
        with self._lock:
            leaving = [self._libraries.pop(key) for key in
                       {(int(t.dev), int(t.inode)) for t in targets}
                       if key in self._libraries]
            self._failed.forget(targets)
            if leaving:
                self.attacher.detach([p for library in leaving for p in library.probes],
                                     reason)
                for library in leaving:
                    library.probes = []
                    self._retired.retire(library, self.clock())
                self.counters["released_libraries"] += len(leaving)
                log.debug("released %d probed files (%s); %d still probed", len(leaving),
                          reason, len(self._libraries))
            self._retired.close_due(self.clock())
            return len(leaving)

    def decoding_files(self) -> list[str]:
        """Paths that reach every probed file and every file released in the
        last RETIRED_KEEP_S, deleted ones included: where the names of
        exited processes' events are looked up (by build id)."""
        with self._lock:
            return ([lib.attach_path.decode() for lib in self._libraries.values()
                     if lib.fd is not None] + self._retired.paths())

    def check_rewritten(self) -> list[ProbeState]:
        """Libraries rewritten in place since they were probed (`cp` over
        them: the same inode, other contents) have probes at the old code's
        offsets, which in the new code may fall inside an instruction: they
        are detached, and the file is probed again as it is now. Looks at
        most every REWRITE_CHECK_S; returns the states of the new probes."""
        with self._lock:
            now = time.monotonic()
            if self._closed or now < self._next_rewrite_check:
                return []
            self._next_rewrite_check = now + REWRITE_CHECK_S
            states = []
            for key, library in list(self._libraries.items()):
                st = library.rewritten()
                if st is None:
                    continue
                mine = library.probes
                self.attacher.detach(mine, "the file was rewritten in place")
                library.probes = []
                del self._libraries[key]
                library.close()
                again = self.add(PathTarget(library.path, st.st_dev, st.st_ino,
                                            origin=library.origin))
                log.warning("%s was rewritten in place (inode %d): its %d probes detached, "
                            "the file probed again as it is now (%d attached)", library.path,
                            library.inode, len(mine),
                            sum(s.count for s in again if s.state == ATTACHED))
                states += again
            return states

    # ----- the adaptive mode -------------------------------------------------

    @property
    def launches_attached(self) -> bool:
        return self._launches

    @property
    def launch_window_end(self) -> float | None:
        """time.monotonic() at which a bounded attach_launches ends, else None."""
        return self._window.end

    def detach_launches(self, reason: str = LAUNCHES_OFF):
        """Per-launch probes off; everything else keeps tracing."""
        with self._lock:
            self._window.cancel()
            self.attacher.detach([p for p in self._probes if p.api.per_launch], reason)
            # Read without the lock (status): off once they are detached.
            self._launches = False

    def attach_launches(self, duration_s: float | None = None):
        """Per-launch probes on; for `duration_s` seconds when given, then
        off again (a timer thread does it, whatever the caller is doing)."""
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {duration_s}")
        with self._lock:
            if self._closed:
                return
            self._window.cancel()
            self.attacher.attach([p for p in self._probes
                                  if p.api.per_launch and p.state == DETACHED])
            self._launches = True
            if duration_s is not None:
                self._window.open(duration_s)

    def _end_window(self):
        self.detach_launches(reason="launch-tracing window ended")

    # ----- states ---------------------------------------------------------

    def states(self) -> list[dict]:
        with self._lock:
            rows = probe_report.summarise(self._probes) + self._failed.rows()
        return [row.as_dict() for row in rows]

    def summary(self) -> dict:
        """Probe points by state (a pattern API counts each symbol), and
        what the probes hold (footprint())."""
        with self._lock:
            out = probe_report.by_state(self._probes)
            out.update(self.footprint())
            out["mode"] = self.mode
            return out

    def footprint(self) -> dict[str, int]:
        """What the probes hold now: libraries (files probed), links
        (uprobe_multi links, perf events), descriptors (theirs and the
        files', released files still open included), retired (released
        files still open); and the counters."""
        with self._lock:
            return probe_report.footprint(list(self._libraries.values()), len(self._retired),
                                          self.counters)

    def unread_exits(self):
        """Turn on the count of processes that exit before discovery read
        them (exited_unread); what marks a process read, or None for a
        program without the count."""
        try:
            marks, on = self.bpf["processes_read"], self.bpf["unread_exits_on"]
        except KeyError:            # a program built without it (tests' stand-ins)
            return None
        on[on.Key(0)] = on.Leaf(1)
        read = marks.Leaf(1)

        def mark(pid: int):
            marks[marks.Key(pid)] = read
        return mark

    def process_changes(self):
        """Turn on the kernel's list of the processes whose mapped files may
        have changed (bpf/device.h: exec, fork, a file mapped executable,
        exit); what takes it (pid -> CHANGE_* bits, or None when the kernel
        could not keep them all: discovery reads /proc in rounds as before,
        that poll). None where the program or the kernel cannot (no syscall
        tracepoints): discovery then reads /proc as before."""
        try:
            table, on = self.bpf["process_changes"], self.bpf["process_changes_on"]
        except KeyError:            # a program built without it (tests' stand-ins)
            return None
        if self._changes_taken is not None:
            return self._changes_taken          # one list, one taker
        attached = []
        try:
            for tp, fn in PROCESS_CHANGE_TRACEPOINTS:
                self.bpf.attach_tracepoint(tp=tp, fn_name=fn)
                attached.append(tp)
        except Exception as exc:    # bcc raises bare Exception when a tracepoint is missing
            for tp in attached:
                self.bpf.detach_tracepoint(tp)
            log.info("process changes not followed (%s): discovery reads /proc", exc)
            return None
        on[on.Key(0)] = on.Leaf(1)
        counters = self.bpf["counters"]
        full = [bpf_counters.read_counter(counters, "process_changes_full")]

        def take() -> dict[int, int] | None:
            changes: dict[int, int] = {}
            # bcc's batch read allocates room for the whole map at each
            # call: a look at its first key first, as most polls find none.
            for key, _ in table.items_lookup_and_delete_batch() if _holds_any(table) else ():
                key = int(getattr(key, "value", key))       # process << 8 | reason
                changes[key >> 8] = changes.get(key >> 8, 0) | (key & 0xFF)
            now = bpf_counters.read_counter(counters, "process_changes_full")
            kept_all, full[0] = now == full[0], now
            return changes if kept_all else None
        self._changes_taken = take
        return take

    def symbol_names(self) -> dict[int, str]:
        """Symbol id (in an event's symbol_id) -> aclnn symbol."""
        with self._lock:
            return self.symbol_ids.names()

    def close(self):
        """Detach everything and close the files; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._window.cancel()
            self.attacher.detach(self._probes, "closed")
            for library in self._libraries.values():
                library.close()
            self._retired.close_due(self.clock(), everything=True)


def _holds_any(table) -> bool:
    """Whether a bcc hash table holds an entry now (one syscall)."""
    try:
        table.next(None)
    except StopIteration:
        return False
    return True

