"""Files and directories that root creates where other users can reach.

A local user may plant a symbolic link, or a file, under a name root is
about to write (a sticky /tmp, a state directory given on the command
line). So every file is opened relative to its directory's descriptor,
never through a symbolic link in its final component (O_NOFOLLOW), and
created new (O_EXCL), with the mode asked for whatever the umask. A file
that is replaced is written under a random name in the same directory and
renamed over the old one (rename never follows a link). A directory the
daemon keeps its files in is created with a tight mode, and one that is
there already must be ours (or root's) and writable by nobody else.
The kernel's fs.protected_symlinks is not relied on: it is off on hosts.
"""

import fcntl
import os
import re
import secrets
import stat
from pathlib import Path

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path root will not write through; the message says why, in one line."""


def private_dir(path: Path, mode: int, *, sticky_ok: bool = False) -> Path:
    """`path` as a directory of this user with `mode` (0o700, 0o750),
    created with its parents where missing; UnsafePathError where one is
    there that another user owns or could write into, or a link. With
    `sticky_ok`, a sticky directory of root's that all may write into
    (/tmp) passes: nobody can remove or rename what another made there."""
    path = Path(path)
    os.makedirs(path.parent, mode=0o755, exist_ok=True)
    try:
        os.mkdir(path, mode)
        made = True
    except FileExistsError:
        made = False
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path}: expected a directory, got a symbolic link "
                              f"(to {os.readlink(path)}); refusing to write through it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePathError(f"{path}: expected a directory, got {file_kind(st.st_mode)}")
    # Through a descriptor of the directory itself: a link swapped in since
    # the lstat is not followed (O_NOFOLLOW fails on it).
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if made:
            os.fchmod(fd, mode)                 # the umask took bits from mode
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid not in (os.geteuid(), 0):
        owner = "root" if os.geteuid() == 0 else f"uid {os.geteuid()} or root"
        raise UnsafePathError(f"{path}: owned by uid {st.st_uid}, expected {owner}; "
                              "another user's directory is not safe to write recordings "
                              "or a socket in")
    if st.st_mode & 0o022 and not (sticky_ok and st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise UnsafePathError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets other users "
                              f"write into it; expected at most {mode:04o} "
                              f"(chmod go-w {path})")
    return path


def create_new(path: Path, mode: int = 0o600) -> int:
    """A descriptor of `path`, created now (never an existing file or a
    link) with exactly `mode`; FileExistsError where the name is taken."""
    fd = os.open(path, _CREATE, mode)
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def replace_file(path: Path, mode: int = 0o600) -> int:
    """A descriptor of a new `path`: an existing regular file of that name
    is removed first; a link, a directory or anything else there is
    refused with UnsafePathError. Creation is exclusive, so a link planted
    between the removal and the creation fails it, not followed."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None:
        refuse_link(path, st)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{path}: expected a regular file to replace, got "
                                  f"{file_kind(st.st_mode)}")
        os.unlink(path)
    try:
        return create_new(path, mode)
    except FileExistsError:
        raise UnsafePathError(f"{path}: created by someone else while it was being "
                              "replaced; refusing to write to it") from None


# Names of the caller's own descriptors (a shell's >(gzip) is /dev/fd/63):
# what the caller already holds, so they are taken as they are, not opened.
_OWN_DESCRIPTOR = re.compile(r"^/(?:dev/fd|proc/self/fd)/(\d+)$")
_STANDARD = {"/dev/stdout": 1, "/dev/stderr": 2}
_IN_PLACE = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
# Opening a file someone named, to read it: a FIFO or a terminal opens at
# once instead of blocking or becoming ours; fstat then says what it is.
READ_NAMED = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def stream_in_place(path: Path) -> int | None:
    """A descriptor to write `path` in place, where it is one of the
    caller's own descriptors (/dev/stdout, /dev/fd/N: a copy of it, if it
    is open for writing), or a pipe or character device of root's or the
    caller's that is no link (/dev/null, a FIFO): nothing is created or
    replaced there. None for anything else. Root must not stream into
    another user's FIFO, nor a device behind a user's link; what is
    checked is what was opened (fstat of the descriptor), so swapping the
    name after the check changes nothing."""
    name = str(path)
    if is_own_descriptor(name):
        found = _OWN_DESCRIPTOR.match(name)
        return _own_descriptor(name, int(found.group(1)) if found else _STANDARD[name])
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
        return None             # a regular file, a link, nothing: the caller decides
    # O_NONBLOCK: a FIFO nobody reads fails at once (ENXIO) instead of hanging
    fd = os.open(path, _IN_PLACE)
    try:
        st = os.fstat(fd)
        if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode)):
            raise UnsafePathError(f"{path}: replaced while it was opened (now "
                                  f"{file_kind(st.st_mode)}); refusing to write to it")
        _refuse_others(path, st)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_own_descriptor(path) -> bool:
    """/dev/stdout, /dev/stderr, /dev/fd/N or /proc/self/fd/N."""
    return str(path) in _STANDARD or _OWN_DESCRIPTOR.match(str(path)) is not None


def refuse_unsafe_output(path) -> None:
    """The checks of stream_in_place and refuse_link, without opening
    anything: a link (not one of the caller's descriptors), or another
    user's pipe or device, raises UnsafePathError. For saying so early; the
    writer checks again on what it opens."""
    if is_own_descriptor(path):
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    refuse_link(Path(path), st)
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISCHR(st.st_mode):
        _refuse_others(path, st)


def _refuse_others(path, st: os.stat_result) -> None:
    if st.st_uid not in _callers():
        raise UnsafePathError(f"{path}: {file_kind(st.st_mode)} owned by uid {st.st_uid}; "
                              "refusing to write into another user's pipe or device "
                              "(expected root's or yours)")


def _own_descriptor(name: str, number: int) -> int:
    try:
        flags = fcntl.fcntl(number, fcntl.F_GETFL)
    except OSError:
        raise UnsafePathError(f"{name}: descriptor {number} is not open") from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise UnsafePathError(f"{name}: descriptor {number} is open for reading only; "
                              "refusing to write to it")
    return os.dup(number)


def _callers() -> set[int]:
    """root, the real user, and the user sudo ran us for."""
    uids = {0, os.getuid()}
    sudo = os.environ.get("SUDO_UID", "")
    if sudo.isascii() and sudo.isdigit():
        uids.add(int(sudo))
    return uids


def refuse_link(path: Path, st: os.stat_result | None = None):
    """UnsafePathError where the final component of `path` is a symbolic link."""
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePathError(f"{path}: is a symbolic link (to {os.readlink(path)}); "
                              "refusing to write through it")


class DirFile:
    """A new file in an open directory, written under a random name and
    renamed into place by `commit()`, all relative to the directory's
    descriptor: the directory can be renamed or a link planted meanwhile,
    and neither changes where the file lands."""

    def __init__(self, path: Path, mode: int | None):
        """`mode` exactly, or None: 0o666 less the umask."""
        path = Path(path)
        self.name = path.name
        self.dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.tmp = f".{self.name}.{secrets.token_hex(4)}.tmp"
        self.fd = None
        try:
            self.fd = os.open(self.tmp, _CREATE, 0o666 if mode is None else mode,
                              dir_fd=self.dir_fd)
            if mode is not None:
                os.fchmod(self.fd, mode)
        except BaseException:
            if self.fd is not None:
                os.close(self.fd)
                os.unlink(self.tmp, dir_fd=self.dir_fd)
            os.close(self.dir_fd)
            raise

    def commit(self):
        os.rename(self.tmp, self.name, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        self.tmp = None

    def close(self):
        """Remove the temporary file unless committed; close the directory."""
        try:
            if self.tmp is not None:
                os.unlink(self.tmp, dir_fd=self.dir_fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(self.dir_fd)


def file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "something else"
