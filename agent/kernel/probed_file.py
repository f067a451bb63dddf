"""One probed file, its probes, and the state of each.

Uprobes belong to an inode, not to a path. Each library is opened once and
attached through /proc/<agent pid>/fd/<n>, a link to exactly the file that
was opened: a library replaced on disk afterwards keeps its probes on the
old inode (which running processes still map), and the new file, a new
inode, is a new target. The descriptor stays open while probes are attached.
"""

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmtrace.bpf import device as device_stream

ATTACHED, DETACHED, NOT_FOUND, FAILED = "attached", "detached", "not_found", "failed"
ENTRY, RETURN = "entry", "return"
LAUNCHES_OFF = "adaptive mode: per-launch probes off"
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
class ProbedFile:
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

    def rewritten(self) -> os.stat_result | None:
        """Its status now, when it was rewritten in place since its probes
        were planned (the same inode, another mtime or size); else None."""
        st = os.fstat(self.fd)
        return None if (st.st_mtime_ns, st.st_size) == self.version else st

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def attachments(self) -> list:
        """Its distinct links (a uprobe_multi link serves several probes)."""
        return list({id(p.attachment): p.attachment for p in self.probes
                     if p.attachment is not None}.values())


@dataclass(eq=False)
class Probe:
    library: ProbedFile
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


@dataclass
class PathTarget:
    """A --lib path when no discovery is at hand: every table symbol wanted."""
    path: str
    dev: int
    inode: int
    symbols: frozenset = frozenset()
    origin: str = "--lib"


def target_from_path(path: str) -> PathTarget:
    st = os.stat(path)
    return PathTarget(os.path.abspath(path), st.st_dev, st.st_ino)


def exited_before_attach(target, proc_root: Path) -> bool:
    """Whether the process discovery found mapping the file (origin
    "maps:PID") has exited: it lived less than a discovery scan, and went
    untraced."""
    origin = str(getattr(target, "origin", ""))
    return origin.startswith("maps:") and origin[5:].isdigit() \
        and not (proc_root / origin[5:]).exists()


class NotOpened(Exception):
    """The file a target names could not be opened as that very file."""


def open_probed_file(target) -> ProbedFile:
    """Open the file `target` (path, dev, inode, origin) names, with no
    probes yet; NotOpened says why not (unreadable, or replaced on disk
    since discovery found it)."""
    path = str(target.path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise NotOpened(f"cannot open it: {exc.strerror}") from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (int(target.dev), int(target.inode)):
        os.close(fd)
        raise NotOpened(f"replaced on disk since it was found: expected inode "
                        f"{target.inode}, the path now holds inode {st.st_ino}")
    return ProbedFile(path, st.st_dev, st.st_ino, getattr(target, "origin", ""), fd,
                      f"/proc/{os.getpid()}/fd/{fd}".encode(), (st.st_mtime_ns, st.st_size))
