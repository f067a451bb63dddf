"""glibc malloc, tuned for a long-running agent that moves numpy batches.

malloc serves a block over its mmap threshold with a mapping of its own,
returned to the kernel on free; but after such a free it raises the
threshold (up to 32 MiB), so later batches come from the heap, where they
fragment it and stay resident. A fixed threshold keeps batch-sized blocks
mapped and returned, and trim() hands back the heap's free pages. Both are
best effort: without glibc they do nothing."""

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 * 1024
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024     # glibc's ceiling on 64-bit


@functools.cache
def libc():
    """The C library, loaded once (find_library runs ldconfig each call);
    None without one."""
    for name in ("libc.so.6", None):    # glibc's soname first: no ldconfig run (10 ms)
        try:
            return ctypes.CDLL(name or ctypes.util.find_library("c"), use_errno=True)
        except (OSError, TypeError):
            continue
    return None


def set_malloc_option(param: int, value: int) -> bool:
    """glibc's mallopt(param, value); whether it took (False without glibc)."""
    mallopt = getattr(libc(), "mallopt", None)
    return bool(mallopt is not None and mallopt(param, value) == 1)


def keep_large_blocks_mapped(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix malloc's mmap threshold (setting it also stops its adjustment)."""
    return set_malloc_option(M_MMAP_THRESHOLD, threshold)


def reuse_freed_blocks(keep_bytes: int = 2 * MMAP_THRESHOLD_MAX) -> bool:
    """For a one-shot command that works through a file batch by batch
    (report, export): serve batch-sized blocks from the heap and keep up to
    `keep_bytes` of freed heap, so that each batch reuses the last one's
    pages. With glibc's defaults every batch maps, faults in, zeroes and
    unmaps its blocks afresh: a third of a JSON Lines export's CPU went
    there (334 k page faults for a 228 MiB recording, against 18 k). A
    user's own malloc tuning (MALLOC_*_ or GLIBC_TUNABLES) is left alone."""
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) \
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    return (set_malloc_option(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
            and set_malloc_option(M_TRIM_THRESHOLD, keep_bytes))


def trim() -> bool:
    """Give the free pages of malloc's arenas back to the kernel."""
    malloc_trim = getattr(libc(), "malloc_trim", None)
    return bool(malloc_trim is not None and malloc_trim(0))


def resident_bytes() -> int:
    """The process's resident set (/proc/self/statm); 0 where unreadable.
    A read of a few microseconds, where a trim walks the whole heap."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
