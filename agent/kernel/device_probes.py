"""Attach the GPU/NPU uprobes to library files, keep each probe's state, and
switch the per-launch probes off and on (the adaptive mode).

Uprobes belong to an inode, not to a path. Each library is opened once and
attached through /proc/<agent pid>/fd/<n>, a link to exactly the file that
was opened: a library replaced on disk afterwards keeps its probes on the
old inode (which running processes still map), and the new file, a new
inode, is a new target. The descriptor stays open while probes are attached.

Two ways to attach, chosen by what the kernel supports (agent/kernel/probes.py
compiles the programs of one of them):
- "multi" (Linux 6.6+): the symbols of a library that share a decoder are
  one uprobe_multi link, each symbol's API id in its cookie. Removing a
  uprobe costs an RCU grace period (about 0.1 s on a VM); a link of any
  size costs one, so switching the per-launch probes or closing takes a
  few grace periods per library, not one per symbol (hundreds of aclnn ops);
  links closed together are closed from several threads, so their grace
  periods overlap.
- "single": one uprobe per symbol through bcc, with a program per symbol;
  the aclnn ops still get a cookie each through a perf link (5.15+), or
  else are named by address in userspace.

Every link and descriptor belongs to the library it probes, and goes with
it: `release(targets)` detaches a file no traced process maps any more
(discovery says which), and keeps the file open a few seconds more so that
the names of its last events can still be read from it. Links are closed
side by side (LINK_CLOSE_THREADS): each close waits for an RCU grace period,
and waits that overlap are shared. One after another, 200 links took 11 s
here (55 ms each); 1000 links closed in 1.37 s from 48 threads, 0.46 s from
256. A process that exits holding links has the kernel close them one
after another (200 links: 9.8 s), which is how 5000 libraries never
released took 636 s to stop.

Per-launch probes (kernel launches, aclnn/aclop submissions) cost one trap
per launch, thousands per second on a busy server. In the adaptive mode they
are detached while graph launches, copies, syncs and the scheduler stay on;
`attach_launches(duration_s)` turns them on for a bounded time (an alarm, a
recording) and off again. Detaching a uprobe touches no other probe and no
ring buffer, so no other event is lost.
"""

import functools
import logging
import os
import re
import resource
import struct
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmtrace.bpf import device as device_stream

from mmtrace.agent import heap
from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.kernel.uprobe_link import BPF_TRACE_UPROBE_MULTI, CookieLink, LinkError, UprobeMultiLink

log = logging.getLogger(__name__)

ATTACHED, DETACHED, NOT_FOUND, FAILED = "attached", "detached", "not_found", "failed"
ENTRY, RETURN = "entry", "return"
MULTI, SINGLE = "multi", "single"
# bcc refuses more than 1000 open probes per process unless told otherwise.
PROBE_LIMIT = 1 << 16
LAUNCHES_OFF = "adaptive mode: per-launch probes off"
REWRITE_CHECK_S = 2.0       # how often libraries are checked for in-place rewrites
# Links closed at once (their grace periods overlap), under the unit's
# TasksMax=64 with the daemon's own threads.
LINK_CLOSE_THREADS = 48
RETIRED_KEEP_S = 5.0        # a released file stays open this long, for its last events' names
MAX_RETIRED = 256           # released files kept open at most (the oldest closes first)
MAX_LIBRARY_FAILURES = 256  # failure rows kept; every failure is counted
# aclnn names given an id (a recording's symbol table: at most ~4 MiB of
# JSON); later or longer ones are named by address in userspace instead.
MAX_SYMBOL_IDS = 1 << 14
MAX_SYMBOL_NAME = 256
M_ARENA_MAX = -8            # mallopt's parameter number
MALLOC_ARENAS = 2
RELEASED = "no traced process maps it any more"


@dataclass
class ProbeState:
    """What `mmtrace doctor` shows and a recording keeps about one probe.
    A pattern API (every aclnn op) is one row per library with a count."""
    path: str
    inode: int
    symbol: str
    api: str
    stream: str
    point: str
    state: str
    reason: str = ""
    count: int = 1

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(eq=False)
class _Library:
    """One probed file: its descriptor and its probes, released together."""
    path: str
    dev: int
    inode: int
    origin: str
    fd: int | None
    attach_path: bytes
    version: tuple[int, int] = (0, 0)   # (mtime_ns, size) when its probes were planned
    probes: list = field(default_factory=list)

    @property
    def key(self) -> tuple[int, int]:
        return self.dev, self.inode

    def attachments(self) -> list:
        """Its distinct links (a uprobe_multi link serves several probes)."""
        return list({id(p.attachment): p.attachment for p in self.probes
                     if p.attachment is not None}.values())


@dataclass(eq=False)
class _Probe:
    library: _Library
    api: device_stream.Api
    symbol: str
    vaddr: int
    offset: int | None
    point: str
    cookie: int
    state: str = DETACHED
    reason: str = ""
    attachment: object = None   # shared by the probes of one uprobe_multi link

    @property
    def multi_fn(self) -> str:
        return self.api.multi_return_fn if self.point == RETURN else self.api.multi_entry_fn

    @property
    def single_fn(self) -> str:
        return self.api.return_fn if self.point == RETURN else self.api.entry_fn


class _BccUprobe:
    """A uprobe bcc attached; close() detaches it."""
    descriptors = 1     # bcc's perf event

    def __init__(self, bpf, ev_name: bytes):
        self.bpf, self.ev_name = bpf, ev_name

    def close(self):
        if self.ev_name is not None:
            self.bpf.detach_uprobe_event(self.ev_name)
            self.ev_name = None


@dataclass
class _PathTarget:
    """A --lib path when no discovery is at hand: every table symbol wanted."""
    path: str
    dev: int
    inode: int
    symbols: frozenset = frozenset()
    origin: str = "--lib"


def target_from_path(path: str) -> _PathTarget:
    st = os.stat(path)
    return _PathTarget(os.path.abspath(path), st.st_dev, st.st_ino)


@functools.cache
def _symbol_matcher():
    table = device_stream.default_table()
    named = frozenset(api.symbol for api in table.apis if api.pattern is None)
    patterns = [api for api in table.apis if api.pattern is not None]
    return lambda symbol: symbol in named or any(api.matches(symbol) for api in patterns)


def wanted(symbol: str) -> bool:
    """For discovery: is `symbol` one the GPU/NPU programs probe?"""
    return _symbol_matcher()(symbol)


def _wanted_prefixes() -> tuple[str, ...]:
    """Two-letter starts of every probed name and pattern (cu, ac, __):
    discovery decodes only the names of a file that start so."""
    table = device_stream.default_table()
    starts = {api.symbol[:2] for api in table.apis if api.pattern is None}
    starts |= {api.pattern[:2] for api in table.apis if api.pattern is not None}
    if any(len(s) < 2 or not s.isidentifier() for s in starts):
        raise ValueError(f"probed names must start with two name characters, got {starts}")
    return tuple(sorted(starts))


wanted.prefixes = _wanted_prefixes()


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
                 proc_root: Path = Path("/proc"), clock=time.monotonic,
                 elf_cache: ElfCache | None = None):
        self.bpf = bpf
        self.elf_cache = elf_cache
        self.table = table or device_stream.default_table()
        self.mode = mode or MULTI
        self.proc_root = Path(proc_root)
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self._launches = launches
        self._libraries: dict[tuple[int, int], _Library] = {}
        self._library_failures: deque[ProbeState] = deque(maxlen=MAX_LIBRARY_FAILURES)
        # Released files still open: (close after, descriptor, /proc/self/fd path, library).
        self._retired: deque[tuple[float, int, str, _Library]] = deque()
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._window_end: float | None = None
        self._closed = False
        self._next_rewrite_check = 0.0
        self._named = {api.symbol: api for api in self.table.apis if api.pattern is None}
        self._patterns = [api for api in self.table.apis if api.pattern is not None]
        # Pattern APIs (aclnn): one id per symbol name, across libraries.
        self._symbol_ids: dict[str, int] = {}

    def wanted(self, symbol: str) -> bool:
        return symbol in self._named or any(api.matches(symbol) for api in self._patterns)

    def _api_of(self, symbol: str) -> device_stream.Api | None:
        api = self._named.get(symbol)
        if api is not None:
            return api
        return next((p for p in self._patterns if p.matches(symbol)), None)

    @property
    def _probes(self) -> list[_Probe]:
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
            library = self._open(target)
            if library is None:
                return [self._library_failures[-1]]
            replaced = self._replaced(library)
            self._libraries[key] = library
            probes = library.probes = self._plan(library, getattr(target, "symbols",
                                                                  frozenset()))
            _raise_limits(sum(len(lib.probes) for lib in self._libraries.values()))
            self._attach([p for p in probes if p.state == DETACHED
                          and (self._launches or not p.api.per_launch)])
            if replaced is not None:
                log.warning("%s was replaced on disk (inode %d, now %d): the new file is "
                            "probed too; the old one keeps its probes while processes map it",
                            library.path, replaced.inode, library.inode)
            self._count_untraced_origin(target)
            return self._summarise(probes)

    def add_path(self, path: str) -> list[ProbeState]:
        return self.add(target_from_path(path))

    def _count_untraced_origin(self, target):
        """A process that mapped the file and exited before its probes were
        attached (it lived less than a discovery scan) went untraced."""
        origin = str(getattr(target, "origin", ""))
        if origin.startswith("maps:") and origin[5:].isdigit() \
                and not (self.proc_root / origin[5:]).exists():
            self.counters["exited_before_attach"] += 1

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
            self._forget_failures(targets)
            if leaving:
                self._detach([p for library in leaving for p in library.probes], reason)
                for library in leaving:
                    library.probes = []
                    self._retire(library)
                self.counters["released_libraries"] += len(leaving)
                log.debug("released %d probed files (%s); %d still probed", len(leaving),
                          reason, len(self._libraries))
            self._close_retired()
            return len(leaving)

    def _forget_failures(self, targets: list):
        """The failure rows of released files go with them."""
        gone = {(str(t.path), int(t.inode)) for t in targets}
        if gone and any((row.path, row.inode) in gone for row in self._library_failures):
            self._library_failures = deque(
                (row for row in self._library_failures if (row.path, row.inode) not in gone),
                maxlen=MAX_LIBRARY_FAILURES)

    def _retire(self, library: _Library):
        if library.fd is None:
            return
        self._retired.append((self.clock() + RETIRED_KEEP_S, library.fd,
                              library.attach_path.decode(), library))
        library.fd = None
        while len(self._retired) > MAX_RETIRED:
            self._close_oldest_retired()

    def _close_retired(self, everything: bool = False):
        now = self.clock()
        while self._retired and (everything or self._retired[0][0] <= now):
            self._close_oldest_retired()

    def _close_oldest_retired(self):
        _, fd, _, library = self._retired.popleft()
        os.close(fd)
        if library.key not in self._libraries and self.elf_cache is not None:
            self.elf_cache.forget(*library.key)     # its parsed symbols, unless probed again

    def decoding_files(self) -> list[str]:
        """Paths that reach every probed file and every file released in the
        last RETIRED_KEEP_S, deleted ones included: where the names of
        exited processes' events are looked up (by build id)."""
        with self._lock:
            return ([lib.attach_path.decode() for lib in self._libraries.values()
                     if lib.fd is not None] + [path for _, _, path, _ in self._retired])

    def _open(self, target) -> _Library | None:
        path = str(target.path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._library_failed(target, f"cannot open it: {exc.strerror}")
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (int(target.dev), int(target.inode)):
            os.close(fd)
            self._library_failed(
                target, f"replaced on disk since it was found: expected inode "
                f"{target.inode}, the path now holds inode {st.st_ino}")
            return None
        return _Library(path, st.st_dev, st.st_ino, getattr(target, "origin", ""), fd,
                        f"/proc/{os.getpid()}/fd/{fd}".encode(), (st.st_mtime_ns, st.st_size))

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
                st = os.fstat(library.fd)
                if (st.st_mtime_ns, st.st_size) == library.version:
                    continue
                mine = library.probes
                self._detach(mine, "the file was rewritten in place")
                library.probes = []
                del self._libraries[key]
                os.close(library.fd)
                library.fd = None
                again = self.add(_PathTarget(library.path, st.st_dev, st.st_ino,
                                             origin=library.origin))
                log.warning("%s was rewritten in place (inode %d): its %d probes detached, "
                            "the file probed again as it is now (%d attached)", library.path,
                            library.inode, len(mine),
                            sum(s.count for s in again if s.state == ATTACHED))
                states += again
            return states

    def _replaced(self, library: _Library) -> _Library | None:
        """The library probed before at the same path, when that path now
        holds another file."""
        return next((old for old in self._libraries.values() if old.path == library.path),
                    None)

    def _library_failed(self, target, reason: str):
        self.counters["library_failures"] += 1
        self._library_failures.append(ProbeState(
            str(target.path), int(target.inode), "*", "*", "", ENTRY, FAILED, reason))

    def _plan(self, library: _Library, offered: frozenset) -> list[_Probe]:
        """The probes this file can take: every table symbol it defines."""
        from bcc import BPF
        pattern = "|".join([re.escape(s) for s in self._named]
                           + [api.pattern for api in self._patterns])
        try:
            found = BPF.get_user_functions_and_addresses(
                library.attach_path, f"^({pattern})(@.*)?$".encode())
            segments = _load_segments(library.fd)
        except Exception as exc:  # bcc raises bare Exception; ours raise ValueError/OSError
            self._library_failed(library, f"its symbols cannot be read: {exc}")
            return []
        vaddrs: dict[str, int] = {}
        for raw, vaddr in found:
            symbol = raw.decode(errors="replace").split("@", 1)[0]
            if offered and symbol not in offered:
                continue
            if self._api_of(symbol) is not None and vaddr:
                vaddrs.setdefault(symbol, vaddr)
        probes = []
        seen_at: dict[tuple[int, str], str] = {}
        for symbol in sorted(vaddrs):
            api = self._api_of(symbol)
            symbol_id = 0
            if api.pattern is not None:
                symbol_id = self._symbol_id(symbol)
            cookie = device_stream.cookie(api.id, self.table.slots.get(api.id, 0), symbol_id)
            offset = _file_offset(segments, vaddrs[symbol])
            for point in (ENTRY, RETURN) if api.return_impl else (ENTRY,):
                probe = _Probe(library, api, symbol, vaddrs[symbol], offset, point, cookie)
                twin = seen_at.setdefault((probe.vaddr, point), symbol)
                if twin != symbol:
                    # Aliases share code: one probe, or every call counts twice.
                    probe.state, probe.reason = FAILED, f"same address as {twin}, probed as that"
                elif offset is None:
                    probe.state, probe.reason = FAILED, "address outside every loaded segment"
                elif api.per_launch and not self._launches:
                    probe.reason = LAUNCHES_OFF
                probes.append(probe)
        families = {self._api_of(s).library for s in vaddrs}
        for symbol, api in self._named.items():
            if api.library in families and symbol not in vaddrs:
                probes.append(_Probe(library, api, symbol, 0, None, ENTRY, 0, state=NOT_FOUND,
                                     reason=f"{api.library} library without this symbol"))
        return probes

    def _symbol_id(self, symbol: str) -> int:
        """The id of an aclnn name, kept for as long as the probes run (events
        recorded name it); 0, named by address instead, past MAX_SYMBOL_IDS
        names or MAX_SYMBOL_NAME characters."""
        known = self._symbol_ids.get(symbol)
        if known is None and len(self._symbol_ids) < MAX_SYMBOL_IDS \
                and len(symbol) <= MAX_SYMBOL_NAME:
            known = self._symbol_ids[symbol] = len(self._symbol_ids) + 1
        return known or 0

    # ----- attaching and detaching -----------------------------------------

    def _attach(self, probes: list[_Probe]):
        if self.mode == MULTI:
            self._attach_multi(probes)
        else:
            for probe in probes:
                self._attach_single(probe)

    def _attach_multi(self, probes: list[_Probe]):
        from bcc import BPF
        groups: dict[tuple, list[_Probe]] = {}
        for p in probes:
            groups.setdefault((id(p.library), p.multi_fn, p.point, p.api.per_launch),
                              []).append(p)
        for group in groups.values():
            first = group[0]
            try:
                fn = self.bpf.load_func(first.multi_fn.encode(), BPF.KPROBE,
                                        attach_type=BPF_TRACE_UPROBE_MULTI)
            except Exception as exc:    # bcc's bare Exception: the program did not load
                log.warning("program %s for %d symbols of %s not loaded: %s", first.multi_fn,
                            len(group), first.library.path, exc)
                for p in group:
                    p.state, p.reason = FAILED, _attach_failure(exc)
                continue
            self._link(fn.fd, group)
            failed = [p for p in group if p.state == FAILED]
            if failed:
                log.warning("%d of %d %s probes of %s not attached: %s",
                            len(failed), len(group), first.point, first.library.path,
                            "; ".join(f"{p.symbol}: {p.reason}" for p in failed[:5]))

    def _link(self, prog_fd: int, group: list[_Probe]):
        """One link for the group. The kernel refuses a whole link for one
        offset it cannot probe: then halves, so that only the symbols at
        fault fail (a few more links, not one per symbol)."""
        first = group[0]
        try:
            link = UprobeMultiLink(prog_fd, first.library.attach_path,
                                   [p.offset for p in group], [p.cookie for p in group],
                                   retprobe=first.point == RETURN)
        except LinkError as exc:
            if len(group) == 1:
                first.state, first.reason = FAILED, _attach_failure(exc)
                return
            half = len(group) // 2
            self._link(prog_fd, group[:half])
            self._link(prog_fd, group[half:])
            return
        for p in group:
            p.attachment, p.state, p.reason = link, ATTACHED, ""

    def _attach_single(self, probe: _Probe):
        from bcc import BPF
        if probe.api.pattern is not None:
            try:
                fn = self.bpf.load_func(probe.single_fn.encode(), BPF.KPROBE)
                probe.attachment = CookieLink(fn.fd, probe.library.attach_path, probe.offset,
                                              probe.cookie, retprobe=probe.point == RETURN)
                probe.state, probe.reason = ATTACHED, ""
                return
            except (LinkError, OSError) as exc:
                # Named by address in userspace instead, while the process lives.
                log.info("uprobe %s:%s attached without a cookie: %s", probe.library.path,
                         probe.symbol, exc)
        before = set(self.bpf.uprobe_fds)
        attach = self.bpf.attach_uretprobe if probe.point == RETURN else self.bpf.attach_uprobe
        try:
            attach(name=probe.library.attach_path, addr=probe.vaddr,
                   fn_name=probe.single_fn.encode())
        except Exception as exc:  # bcc raises bare Exception, with the cause on stderr
            probe.state, probe.reason = FAILED, _attach_failure(exc)
            log.warning("uprobe %s:%s (%s) not attached: %s", probe.library.path,
                        probe.symbol, probe.point, probe.reason)
            return
        added = set(self.bpf.uprobe_fds) - before
        probe.attachment = _BccUprobe(self.bpf, added.pop()) if added else None
        probe.state, probe.reason = ATTACHED, ""

    def _detach(self, probes: list[_Probe], reason: str):
        """Detach `probes`; a link shared with probes not listed stays (only
        probes of one library share a link)."""
        leaving = set(probes)
        libraries = {id(p.library): p.library for p in probes}.values()
        staying = {id(p.attachment) for library in libraries for p in library.probes
                   if p not in leaving and p.attachment is not None}
        close_side_by_side([attachment for attachment in
                            {id(p.attachment): p.attachment for p in probes
                             if p.attachment is not None}.values()
                            if id(attachment) not in staying])
        for probe in probes:
            probe.attachment = None
            if probe.state == ATTACHED:
                probe.state, probe.reason = DETACHED, reason

    # ----- the adaptive mode -------------------------------------------------

    @property
    def launches_attached(self) -> bool:
        return self._launches

    @property
    def launch_window_end(self) -> float | None:
        """time.monotonic() at which a bounded attach_launches ends, else None."""
        return self._window_end

    def detach_launches(self, reason: str = LAUNCHES_OFF):
        """Per-launch probes off; everything else keeps tracing."""
        with self._lock:
            self._cancel_window()
            self._detach([p for p in self._probes if p.api.per_launch], reason)
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
            self._cancel_window()
            self._attach([p for p in self._probes
                          if p.api.per_launch and p.state == DETACHED])
            self._launches = True
            if duration_s is not None:
                self._window_end = time.monotonic() + duration_s
                self._timer = threading.Timer(duration_s, self._end_window)
                self._timer.daemon = True
                self._timer.start()

    def _end_window(self):
        self.detach_launches(reason="launch-tracing window ended")

    def _cancel_window(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._window_end = None

    # ----- states ---------------------------------------------------------

    def states(self) -> list[dict]:
        with self._lock:
            rows = self._summarise(self._probes) + list(self._library_failures)
        return [row.as_dict() for row in rows]

    def summary(self) -> dict:
        """Probe points by state (a pattern API counts each symbol), and
        what the probes hold (footprint())."""
        with self._lock:
            out = {ATTACHED: 0, DETACHED: 0, NOT_FOUND: 0, FAILED: 0}
            for probe in self._probes:
                out[probe.state] += 1
            out.update(self.footprint())
            out["mode"] = self.mode
            return out

    def footprint(self) -> dict[str, int]:
        """What the probes hold now: libraries (files probed), links
        (uprobe_multi links, perf events), descriptors (theirs and the
        files', released files still open included), retired (released
        files still open); and the counters."""
        with self._lock:
            links = [a for library in self._libraries.values()
                     for a in library.attachments()]
            files_open = sum(lib.fd is not None for lib in self._libraries.values())
            return {"libraries": len(self._libraries), "links": len(links),
                    "descriptors": files_open + len(self._retired)
                    + sum(getattr(a, "descriptors", 1) for a in links),
                    "retired": len(self._retired),
                    "released_libraries": self.counters["released_libraries"],
                    "library_failures": self.counters["library_failures"],
                    "exited_before_attach": self.counters["exited_before_attach"]}

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

    def symbol_names(self) -> dict[int, str]:
        """Symbol id (in an event's symbol_id) -> aclnn symbol."""
        with self._lock:
            return {symbol_id: name for name, symbol_id in self._symbol_ids.items()}

    def _summarise(self, probes: list[_Probe]) -> list[ProbeState]:
        rows: dict[tuple, ProbeState] = {}
        out = []
        for p in probes:
            if p.api.pattern is None:
                out.append(ProbeState(p.library.path, p.library.inode, p.symbol, p.api.name,
                                      p.api.stream, p.point, p.state, p.reason))
                continue
            key = (p.library.inode, p.api.id, p.point, p.state, p.reason)
            row = rows.get(key)
            if row is None:
                row = rows[key] = ProbeState(p.library.path, p.library.inode,
                                             p.api.pattern, p.api.name, p.api.stream,
                                             p.point, p.state, p.reason, count=0)
                out.append(row)
            row.count += 1
        return out

    def close(self):
        """Detach everything and close the files; a second call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cancel_window()
            self._detach(self._probes, "closed")
            for library in self._libraries.values():
                if library.fd is not None:
                    os.close(library.fd)
                    library.fd = None
            self._close_retired(everything=True)


def close_side_by_side(attachments: list, threads: int = LINK_CLOSE_THREADS):
    """Close links from up to `threads` threads at once: each close waits
    for a grace period, and the kernel lets waits that overlap share one.
    Where no more threads can start (systemd's TasksMax), those started do
    the rest, or this thread alone. A close that fails is logged; the others
    still run."""
    pending = deque(attachments)
    if len(pending) > 1:
        _cap_malloc_arenas()

    def close_pending():
        while True:
            try:
                attachment = pending.popleft()
            except IndexError:
                return
            try:
                attachment.close()
            except Exception as exc:  # bcc raises bare Exception
                log.warning("a uprobe did not detach cleanly: %s", exc)

    started = []
    for i in range(min(threads, len(pending)) - 1):
        worker = threading.Thread(target=close_pending, name=f"mmtrace-detach-{i}",
                                  daemon=True)
        try:
            worker.start()
        except RuntimeError:        # can't start new thread: the task limit
            break
        started.append(worker)
    close_pending()
    for worker in started:
        worker.join()


@functools.cache
def _cap_malloc_arenas() -> bool:
    """glibc gives a thread that allocates while others run an arena of its
    own (up to 8 per core) and keeps every arena, about 250 KB each after a
    trim: the first wide burst of close threads left the daemon 3.5 MB (6 %)
    larger for good, and 0.4 MB with arenas capped at MALLOC_ARENAS. The
    daemon's Python runs one thread at a time: few arenas cost it nothing."""
    mallopt = getattr(heap.libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(M_ARENA_MAX, MALLOC_ARENAS) == 1)


# ----- ELF load segments: symbol address -> file offset ----------------------

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF64_PHDR = struct.Struct("<IIQQQQQQ")
PT_LOAD = 1


def _load_segments(fd: int) -> list[tuple[int, int, int]]:
    """(vaddr, offset, filesz) of each PT_LOAD segment of a 64-bit
    little-endian ELF file (x86-64, aarch64)."""
    head = os.pread(fd, _ELF64_HEADER.size, 0)
    if len(head) < _ELF64_HEADER.size or head[:4] != b"\x7fELF":
        raise ValueError("expected an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise ValueError(f"expected a 64-bit little-endian ELF file, class {head[4]} "
                         f"byte order {head[5]}")
    fields = _ELF64_HEADER.unpack(head)
    phoff, phentsize, phnum = fields[5], fields[9], fields[10]
    if phentsize != _ELF64_PHDR.size:
        raise ValueError(f"expected program headers of {_ELF64_PHDR.size} bytes, "
                         f"got {phentsize}")
    table = os.pread(fd, phentsize * phnum, phoff)
    if len(table) != phentsize * phnum:
        raise ValueError("program headers cut short: the file changed or is truncated")
    out = []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = _ELF64_PHDR.unpack_from(
            table, i * phentsize)
        if p_type == PT_LOAD:
            out.append((p_vaddr, p_offset, p_filesz))
    return out


def _file_offset(segments, vaddr: int) -> int | None:
    for seg_vaddr, seg_offset, filesz in segments:
        if seg_vaddr <= vaddr < seg_vaddr + filesz:
            return vaddr - seg_vaddr + seg_offset
    return None


def _attach_failure(exc: Exception) -> str:
    text = exc.strerror if isinstance(exc, LinkError) and exc.strerror else str(exc)
    if "quota" in text:
        return f"{text} (BCC_PROBE_LIMIT)"
    return text or type(exc).__name__


def _raise_limits(probes: int):
    """One perf event descriptor per probe when attached one by one: lift
    bcc's probe quota and the soft descriptor limit to what they need."""
    need = max(probes + 64, PROBE_LIMIT)
    current = os.environ.get("BCC_PROBE_LIMIT", "")
    if not current.isdigit() or int(current) < need:
        os.environ["BCC_PROBE_LIMIT"] = str(need)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = probes + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit to %d (%s): some probes may "
                        "fail with EMFILE", target, exc)
