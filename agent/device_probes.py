"""Attach the GPU/NPU uprobes to library files, keep each probe's state, and
switch the per-launch probes off and on (the adaptive mode).

Uprobes belong to an inode, not to a path. Each library is opened once and
attached through /proc/<agent pid>/fd/<n>, a link to exactly the file that
was opened: a library replaced on disk afterwards keeps its probes on the
old inode (which running processes still map), and the new file, a new
inode, is a new target. The descriptor stays open while probes are attached.

Two ways to attach, chosen by what the kernel supports (agent/probes.py
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
from dataclasses import asdict, dataclass

from mmtrace.bpf import device as device_stream

from .concurrent_close import close_all
from .uprobe_link import BPF_TRACE_UPROBE_MULTI, CookieLink, LinkError, UprobeMultiLink

log = logging.getLogger(__name__)

ATTACHED, DETACHED, NOT_FOUND, FAILED = "attached", "detached", "not_found", "failed"
ENTRY, RETURN = "entry", "return"
MULTI, SINGLE = "multi", "single"
# bcc refuses more than 1000 open probes per process unless told otherwise.
PROBE_LIMIT = 1 << 16
LAUNCHES_OFF = "adaptive mode: per-launch probes off"
REWRITE_CHECK_S = 2.0       # how often libraries are checked for in-place rewrites


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


@dataclass
class _Library:
    path: str
    dev: int
    inode: int
    origin: str
    fd: int | None
    attach_path: bytes
    version: tuple[int, int] = (0, 0)   # (mtime_ns, size) when its probes were planned


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
    owner's loop attaches newly discovered libraries."""

    def __init__(self, bpf, table: device_stream.ApiTable | None = None,
                 launches: bool = True, mode: str | None = None):
        self.bpf = bpf
        self.table = table or device_stream.default_table()
        self.mode = mode or MULTI
        self._launches = launches
        self._libraries: dict[tuple[int, int], _Library] = {}
        self._probes: list[_Probe] = []
        self._library_failures: list[ProbeState] = []
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
                return self._library_failures[-1:]
            replaced = self._replaced(library)
            self._libraries[key] = library
            probes = self._plan(library, getattr(target, "symbols", frozenset()))
            self._probes.extend(probes)
            _raise_limits(len(self._probes))
            self._attach([p for p in probes if p.state == DETACHED
                          and (self._launches or not p.api.per_launch)])
            if replaced is not None:
                log.warning("%s was replaced on disk (inode %d, now %d): the new file is "
                            "probed too; the old one keeps its probes while processes map it",
                            library.path, replaced.inode, library.inode)
            return self._summarise(probes)

    def add_path(self, path: str) -> list[ProbeState]:
        return self.add(target_from_path(path))

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
                mine = [p for p in self._probes if p.library is library]
                self._detach(mine, "the file was rewritten in place")
                self._probes = [p for p in self._probes if p.library is not library]
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
                symbol_id = self._symbol_ids.setdefault(symbol, len(self._symbol_ids) + 1)
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
        """Detach `probes`; a link shared with probes not listed stays."""
        leaving = set(probes)
        closing = [attachment for attachment in
                   {id(p.attachment): p.attachment for p in probes
                    if p.attachment is not None}.values()
                   if not any(p.attachment is attachment and p not in leaving
                              for p in self._probes)]
        close_all([attachment.close for attachment in closing], "uprobe")
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
            self._launches = False
            self._detach([p for p in self._probes if p.api.per_launch], reason)

    def attach_launches(self, duration_s: float | None = None):
        """Per-launch probes on; for `duration_s` seconds when given, then
        off again (a timer thread does it, whatever the caller is doing)."""
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {duration_s}")
        with self._lock:
            if self._closed:
                return
            self._cancel_window()
            self._launches = True
            self._attach([p for p in self._probes
                          if p.api.per_launch and p.state == DETACHED])
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
        """Probe points by state (a pattern API counts each symbol)."""
        with self._lock:
            out = {ATTACHED: 0, DETACHED: 0, NOT_FOUND: 0, FAILED: 0}
            for probe in self._probes:
                out[probe.state] += 1
            out["libraries"] = len(self._libraries)
            out["library_failures"] = len(self._library_failures)
            out["mode"] = self.mode
            return out

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
