"""Released files kept open a few seconds more.

A file no traced process maps any more is detached, but the names of its
last events, still in the rings, are read from it (by build id, through
/proc/self/fd even once it is deleted): it stays open RETIRED_KEEP_S, at
most MAX_RETIRED of them (the oldest closes first)."""

import os
from collections import deque
from typing import Callable

from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.kernel.probed_file import ProbedFile

RETIRED_KEEP_S = 5.0        # a released file stays open this long, for its last events' names
MAX_RETIRED = 256           # released files kept open at most (the oldest closes first)


class RetiredFiles:
    """Released files still open. `still_probed(key)` says whether a file
    (dev, inode) is probed again: its parsed symbols then stay cached when
    its retired descriptor closes; otherwise `elf_cache` (where given)
    forgets them."""

    def __init__(self, still_probed: Callable[[tuple[int, int]], bool],
                 elf_cache: ElfCache | None = None):
        self.still_probed = still_probed
        self.elf_cache = elf_cache
        # (close after, descriptor, /proc/self/fd path, file), oldest first.
        self._open: deque[tuple[float, int, str, ProbedFile]] = deque()

    def __len__(self) -> int:
        return len(self._open)

    def retire(self, library: ProbedFile, now: float):
        """Take over `library`'s descriptor until `now` + RETIRED_KEEP_S."""
        if library.fd is None:
            return
        self._open.append((now + RETIRED_KEEP_S, library.fd, library.attach_path.decode(),
                           library))
        library.fd = None
        while len(self._open) > MAX_RETIRED:
            self._close_oldest()

    def close_due(self, now: float, everything: bool = False):
        """Close the files whose time is up at `now` (all, with `everything`)."""
        while self._open and (everything or self._open[0][0] <= now):
            self._close_oldest()

    def paths(self) -> list[str]:
        """Paths that reach the retired files, deleted ones included."""
        return [path for _, _, path, _ in self._open]

    def _close_oldest(self):
        _, fd, _, library = self._open.popleft()
        os.close(fd)
        if not self.still_probed(library.key) and self.elf_cache is not None:
            self.elf_cache.forget(*library.key)     # its parsed symbols, unless probed again
