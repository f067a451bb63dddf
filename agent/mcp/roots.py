"""Where the MCP server may read recordings: the state directory, and the
files and directories named on its command line. An assistant names a
path; it is read only when it lies under one of those roots once every
link in it is followed, is a regular file (a FIFO would block the reader,
a device never end) and no larger than a call reads. It is opened once
and judged by what the descriptor holds, then read through it: a name
changed after the open cannot send the read elsewhere."""

import os
import stat
from datetime import datetime, timezone
from pathlib import Path

from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.recording.file_format import RecordingError, RecordingReader
from mmtrace.agent.safe_files import READ_NAMED, file_kind

MAX_PATH_CHARS = 4096
MAX_LISTED = 100            # recordings a listing names, newest first
MAX_SCANNED = 10_000        # entries of one directory looked at: a listing's cost is bounded
SUFFIX = ".mmtr"
DEFAULT_MAX_READ_GIB = 8    # a call reads a file of at most this size (~20 s at worst)
GIB = 1 << 30


class RecordingRoots:
    def __init__(self, state_dir: Path, named: list[Path] = (),
                 max_read_gib: float = DEFAULT_MAX_READ_GIB):
        # the server serves one call at a time: a file of many GiB (a sparse
        # one costs nothing on disk) must not hold every other call for minutes
        self.max_read_gib = max_read_gib
        self.state_dir = Path(os.path.abspath(state_dir))
        self.roots = [self.state_dir] + [Path(os.path.abspath(p)) for p in named]

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def resolve(self, text) -> Path:
        """The real path of the recording `text` names (relative: to the state
        directory); MmtraceError unless it is a regular file under a root."""
        fd, real = self.descriptor(text)
        os.close(fd)
        return real

    def descriptor(self, text) -> tuple[int, Path]:
        """The recording `text` names, opened once (without blocking: a FIFO
        opens at once), and its real path. What is allowed is decided from
        the descriptor, not the name: a directory of the path swapped for a
        link after the open cannot lead the read elsewhere."""
        asked = self._asked(text)
        try:
            fd = os.open(asked, READ_NAMED)
        except FileNotFoundError:
            raise MmtraceError(f"path: no such recording: {text[:200]}") from None
        except OSError as exc:
            raise MmtraceError(f"path: cannot open {text[:200]}: {exc.strerror}") from None
        try:
            real = self._where(fd)
            if not any(_within(real, root) for root in self.roots):
                # where a link leads outside is not said: that would be a
                # way to look around the file system
                raise MmtraceError(f"path: expected a recording under {self.describe()}, "
                                   f"got {text[:200]}; start the server with --recordings "
                                   "PATH to allow more")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise MmtraceError(f"path: expected a regular recording file, got "
                                   f"{file_kind(st.st_mode)}: {text[:200]}")
            if st.st_size > self.max_read_gib * GIB:
                raise MmtraceError(f"path: {text[:200]} is {st.st_size / GIB:.1f} GiB, more "
                                   f"than the {self.max_read_gib:g} GiB a call reads; start "
                                   "the server with --max-read-gib N to read it")
        except BaseException:
            os.close(fd)
            raise
        return fd, real

    def _asked(self, text) -> str:
        if not isinstance(text, str) or not text or len(text) > MAX_PATH_CHARS \
                or "\0" in text:
            shown = f"{len(text)} characters" if isinstance(text, str) and text else repr(text)
            raise MmtraceError(f"path: expected a recording's path of 1..{MAX_PATH_CHARS} "
                               f"characters without NUL, got {shown}")
        if ".." in Path(text).parts:
            raise MmtraceError(f"path: expected a path without '..' components, got "
                               f"{text[:200]!r}")
        return text if os.path.isabs(text) else str(self.state_dir / text)

    def _where(self, fd: int) -> Path:
        """The real path of what `fd` holds open, as the kernel has it."""
        try:
            return Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError as exc:
            raise MmtraceError(f"path: cannot tell where the file opened lies "
                               f"(/proc/self/fd: {exc.strerror})") from None

    def open(self, text, scan: bool = True) -> RecordingReader:
        """The recording `text` names, read through the one descriptor that
        was checked: never opened by name again."""
        fd, real = self.descriptor(text)
        try:
            return RecordingReader(real, scan=scan, fd=fd)
        except RecordingError as exc:
            raise MmtraceError(str(exc)) from None

    def recordings(self, limit: int = MAX_LISTED, cut: list | None = None) -> list[dict]:
        """The recordings held under the roots (the directories' own *.mmtr
        files, not their subdirectories; a named file itself), newest first:
        path, size, when modified, and what the header says made it. Of a
        directory, the first MAX_SCANNED entries are looked at; what was
        passed over is said in `cut`."""
        cut = [] if cut is None else cut
        found = {}
        for root in self.roots:
            for path, st in _regular_files(root, cut):
                found.setdefault(str(path), (st.st_mtime_ns, path, st))
        out = []
        for mtime_ns, path, st in sorted(found.values(), key=lambda f: f[0], reverse=True):
            if len(out) >= limit:
                break
            out.append(_listing(path, st))
        return out

    def unreadable(self) -> list[str]:
        """Why a root could not be listed (a root's state directory is the
        daemon's, 0700): said beside an empty listing."""
        out = []
        for root in self.roots:
            try:
                if root.is_dir():
                    os.listdir(root)
                elif not root.exists():
                    out.append(f"{root}: does not exist")
            except OSError as exc:
                out.append(f"{root}: {exc.strerror}")
        return out


def _within(real: Path, root: Path) -> bool:
    try:
        root = Path(os.path.realpath(root))
    except OSError:                 # a root changing under it: taken as named
        pass
    return real == root or root in real.parents


def _regular_files(root: Path, cut: list):
    real = Path(os.path.realpath(root))
    try:
        st = os.lstat(real)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        yield real, st
        return
    if not stat.S_ISDIR(st.st_mode):
        return
    try:
        with os.scandir(real) as scan:
            entries = [e for _, e in zip(range(MAX_SCANNED), scan)]
            passed = sum(1 for _ in scan)       # counted by name only: no stat, no read
    except OSError:
        return
    if passed:
        cut.append(f"{real}: the first {MAX_SCANNED:,} entries were looked at, {passed:,} "
                   "more were not (a newer recording may be among them); name it with "
                   "`path`, or keep fewer files there")
    for entry in entries:
        if not entry.name.endswith(SUFFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)     # a link is passed over, not followed
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            yield real / entry.name, st


def _listing(path: Path, st: os.stat_result) -> dict:
    row = {"path": str(path), "size_bytes": st.st_size,
           "modified_utc": datetime.fromtimestamp(st.st_mtime, timezone.utc)
           .isoformat(timespec="seconds"),
           "flight_recording": False, "trigger": None, "started_utc": None, "problem": None}
    try:
        with RecordingReader(path, scan=False) as rec:
            header = rec.header
    except RecordingError as exc:
        row["problem"] = str(exc)
        return row
    row["flight_recording"] = bool(header.get("flight_recorder"))
    row["trigger"] = _trigger(header)
    created = header.get("created_unix_s")
    if isinstance(created, (int, float)):
        try:
            row["started_utc"] = datetime.fromtimestamp(created, timezone.utc) \
                .isoformat(timespec="seconds")
        except (OverflowError, ValueError, OSError):     # 1e300, -1e15: this row's problem
            row["problem"] = (f"header: expected created_unix_s as a time, got "
                              f"{str(created)[:40]}")
    return row


def _trigger(header: dict) -> dict | None:
    """What made a flight recording: the anomaly that fired, or a dump."""
    anomaly = header.get("anomaly")
    if isinstance(anomaly, dict):
        evidence = anomaly.get("evidence") if isinstance(anomaly.get("evidence"), dict) else {}
        return {"kind": "anomaly", "detector": _text(anomaly.get("detector")),
                "what": _text(anomaly.get("series") or anomaly.get("kind")),
                "ts_ns": anomaly.get("ts_ns") if isinstance(anomaly.get("ts_ns"), int)
                else None,
                "verdict": _text(evidence.get("verdict"))}
    trigger = header.get("trigger")
    if isinstance(trigger, dict):
        return {"kind": _text(trigger.get("kind")), "reason": _text(trigger.get("reason"))}
    return None


MAX_TEXT = 200


def _text(value) -> str | None:
    """A header's string as a listing shows it: anyone who can write a file
    under a root writes it, so it is short (a long one is a flood, and text
    an assistant would read as instructions)."""
    if not isinstance(value, str):
        return None
    return value if len(value) <= MAX_TEXT else \
        f"{value[:MAX_TEXT]}... (cut: {len(value):,} characters)"

