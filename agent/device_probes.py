"""Attach the GPU/NPU uprobes to library files, keep each probe's state, and
switch the per-launch probes off and on (the adaptive mode).

Uprobes belong to an inode, not to a path. Each library is opened once and
attached through /proc/<agent pid>/fd/<n>, a link to exactly the file that
was opened: a library replaced on disk afterwards keeps its probes on the
old inode (which running processes still map), and the new file, a new
inode, is a new target. The descriptor stays open while probes are attached.

Per-launch probes (kernel launches, aclnn/aclop submissions) cost one trap
per launch, thousands per second on a busy server. In the adaptive mode they
are detached while graph launches, copies, syncs and the scheduler stay on;
`attach_launches(duration_s)` turns them on for a bounded time (an alarm, a
recording) and off again. Detaching a uprobe touches no other probe and no
ring buffer, so no other event is lost.
"""

import errno
import logging
import os
import re
import resource
import threading
from dataclasses import asdict, dataclass, field

from mmtrace.bpf import device as device_stream

log = logging.getLogger(__name__)

ATTACHED, DETACHED, NOT_FOUND, FAILED = "attached", "detached", "not_found", "failed"
ENTRY, RETURN = "entry", "return"
# bcc refuses more than 1000 open probes per process unless told otherwise.
PROBE_LIMIT = 1 << 16


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


@dataclass
class _Probe:
    library: _Library
    api: device_stream.Api
    symbol: str
    vaddr: int
    point: str
    fn: str
    state: str = DETACHED
    reason: str = ""
    ev_name: bytes | None = None


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


class DeviceProbes:
    """The uprobes of one loaded bcc object.

    Thread-safe: a timer thread may end a launch-tracing window while the
    owner's loop attaches newly discovered libraries."""

    def __init__(self, bpf, table: device_stream.ApiTable | None = None,
                 launches: bool = True):
        self.bpf = bpf
        self.table = table or device_stream.default_table()
        self._launches = launches
        self._libraries: dict[tuple[int, int], _Library] = {}
        self._probes: list[_Probe] = []
        self._library_failures: list[ProbeState] = []
        self._lock = threading.RLock()
        self._timer: threading.Timer | None = None
        self._window_end: float | None = None
        self._closed = False
        self._named = {api.symbol: api for api in self.table.apis if api.pattern is None}
        self._patterns = [api for api in self.table.apis if api.pattern is not None]

    # ----- which symbols -------------------------------------------------

    def wanted(self, symbol: str) -> bool:
        """For discovery: is `symbol` one this agent probes?"""
        if symbol in self._named:
            return True
        return any(api.matches(symbol) for api in self._patterns)

    def _api_of(self, symbol: str) -> device_stream.Api | None:
        api = self._named.get(symbol)
        if api is not None:
            return api
        return next((p for p in self._patterns if p.matches(symbol)), None)

    # ----- attaching -------------------------------------------------------

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
            self._libraries[key] = library
            probes = self._plan(library, getattr(target, "symbols", frozenset()))
            _raise_limits(len(self._probes) + len(probes))
            for probe in probes:
                if probe.state == DETACHED and (self._launches or not probe.api.per_launch):
                    self._attach(probe)
            self._probes.extend(probes)
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
                        f"/proc/{os.getpid()}/fd/{fd}".encode())

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
        except Exception as exc:  # bcc raises bare Exception
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
            points = [(ENTRY, api.entry_fn)]
            if api.return_fn:
                points.append((RETURN, api.return_fn))
            for point, fn in points:
                probe = _Probe(library, api, symbol, vaddrs[symbol], point, fn)
                twin = seen_at.setdefault((probe.vaddr, point), symbol)
                if twin != symbol:
                    # Aliases share code: one probe, or every call counts twice.
                    probe.state, probe.reason = FAILED, f"same address as {twin}, probed as that"
                elif api.per_launch and not self._launches:
                    probe.reason = "adaptive mode: per-launch probes off"
                probes.append(probe)
        families = {self._api_of(s).library for s in vaddrs}
        for symbol, api in self._named.items():
            if api.library in families and symbol not in vaddrs:
                probes.append(_Probe(library, api, symbol, 0, ENTRY, api.entry_fn,
                                     state=NOT_FOUND,
                                     reason=f"{api.library} library without this symbol"))
        return probes

    def _attach(self, probe: _Probe):
        before = set(self.bpf.uprobe_fds)
        attach = (self.bpf.attach_uretprobe if probe.point == RETURN
                  else self.bpf.attach_uprobe)
        try:
            attach(name=probe.library.attach_path, addr=probe.vaddr, fn_name=probe.fn)
        except Exception as exc:  # bcc raises bare Exception, with the cause on stderr
            probe.state, probe.reason = FAILED, _attach_failure(exc)
            log.warning("uprobe %s:%s (%s) not attached: %s", probe.library.path,
                        probe.symbol, probe.point, probe.reason)
            return
        added = set(self.bpf.uprobe_fds) - before
        probe.ev_name = added.pop() if added else None
        probe.state, probe.reason = ATTACHED, ""

    def _detach(self, probe: _Probe, reason: str):
        if probe.ev_name is not None:
            try:
                self.bpf.detach_uprobe_event(probe.ev_name)
            except Exception as exc:  # bcc raises bare Exception
                log.warning("uprobe %s:%s not detached cleanly: %s",
                            probe.library.path, probe.symbol, exc)
            probe.ev_name = None
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

    def detach_launches(self, reason: str = "adaptive mode: per-launch probes off"):
        """Per-launch probes off; everything else keeps tracing."""
        with self._lock:
            self._cancel_window()
            self._launches = False
            for probe in self._probes:
                if probe.api.per_launch:
                    self._detach(probe, reason)

    def attach_launches(self, duration_s: float | None = None):
        """Per-launch probes on; for `duration_s` seconds when given, then
        off again (a timer thread does it, whatever the caller is doing)."""
        import time
        if duration_s is not None and duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {duration_s}")
        with self._lock:
            if self._closed:
                return
            self._cancel_window()
            self._launches = True
            for probe in self._probes:
                if probe.api.per_launch and probe.state == DETACHED:
                    self._attach(probe)
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

    def summary(self) -> dict[str, int]:
        """Probe points by state (a pattern API counts each symbol)."""
        with self._lock:
            out = {ATTACHED: 0, DETACHED: 0, NOT_FOUND: 0, FAILED: 0}
            for probe in self._probes:
                out[probe.state] += 1
            out["libraries"] = len(self._libraries)
            out["library_failures"] = len(self._library_failures)
            return out

    def attached_symbols(self) -> set[str]:
        with self._lock:
            return {p.symbol for p in self._probes if p.state == ATTACHED}

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
            for probe in self._probes:
                self._detach(probe, "closed")
            for library in self._libraries.values():
                if library.fd is not None:
                    os.close(library.fd)
                    library.fd = None


def _attach_failure(exc: Exception) -> str:
    text = str(exc)
    if "quota" in text:
        return f"{text} (BCC_PROBE_LIMIT)"
    return text or type(exc).__name__


def _raise_limits(probes: int):
    """One perf event descriptor per probe: lift bcc's probe quota and the
    soft descriptor limit to what the probes need."""
    current = os.environ.get("BCC_PROBE_LIMIT", "")
    if not current.isdigit() or int(current) < max(probes + 64, PROBE_LIMIT):
        os.environ["BCC_PROBE_LIMIT"] = str(max(probes + 64, PROBE_LIMIT))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = probes + 1024
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the descriptor limit to %d (%s): some probes may "
                        "fail with %s", target, exc, errno.errorcode.get(errno.EMFILE))
