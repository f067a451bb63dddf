"""Keep what compiling the eBPF programs leaves behind out of the agent's
steady state. bcc compiles with clang and LLVM in this process: the heap
they grew is freed but kept by malloc, and the pages of libLLVM and
libclang-cpp they ran stay mapped. Afterwards malloc hands its free
memory back (malloc_trim), and the libraries' resident code and read-only
data are unmapped from this process (they stay in the page cache, shared,
and come back on a page fault should anything compile again)."""

import ctypes
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from mmtrace.agent import heap

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
COMPILER_LIBRARIES = re.compile(r"/lib(LLVM|clang-cpp|clang)[-.][^/]*$")
MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


@dataclass
class Mapping:
    start: int
    end: int
    perms: str
    path: str
    rss_kb: int = 0
    anonymous_kb: int = 0


def mappings(smaps: str) -> list[Mapping]:
    """The mappings of an smaps text, with their Rss and Anonymous sizes."""
    out = []
    for line in smaps.splitlines():
        head = MAPPING.match(line)
        if head:
            out.append(Mapping(int(head[1], 16), int(head[2], 16), head[3], head[4]))
        elif out and line.startswith(("Rss:", "Anonymous:")):
            key, value = line.split()[:2]
            if key == "Rss:":
                out[-1].rss_kb = int(value)
            else:
                out[-1].anonymous_kb = int(value)
    return out


def droppable(m: Mapping) -> bool:
    """A compiler library's mapping whose resident pages are all the file's:
    not writable, no page of it copied on write (relocated data is), so
    unmapping them loses nothing."""
    return bool(COMPILER_LIBRARIES.search(m.path)) and "w" not in m.perms \
        and m.anonymous_kb == 0 and m.rss_kb > 0


def release(proc_self: Path = Path("/proc/self")) -> int:
    """Trim malloc's free memory and unmap the compiler libraries' resident
    pages; returns the kB the libraries held. Best effort: a libc without
    malloc_trim, or a kernel that refuses, leaves things as they were."""
    heap.trim()
    try:
        found = [m for m in mappings((proc_self / "smaps").read_text()) if droppable(m)]
    except OSError as exc:
        log.debug("compiler memory: %s unreadable (%s)", proc_self / "smaps", exc)
        return 0
    madvise = getattr(heap.libc(), "madvise", None)
    if madvise is None:
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    dropped = 0
    for m in found:
        if madvise(m.start, m.end - m.start, MADV_DONTNEED) == 0:
            dropped += m.rss_kb
    return dropped
