"""glob.glob that lists folders again only when they have changed.

Discovery globs the install paths and site-packages every poll; listing
/usr/lib/x86_64-linux-gnu (thousands of entries) to find no libcuda was
most of an idle agent's CPU. A folder's mtime changes whenever an entry is
added, removed or renamed in it, so a pattern's matches stand while every
folder its expansion went through keeps its (inode, mtime): those folders
are stat()ed, not listed. Where a folder does not exist, the deepest one
that does is watched instead, so creating it is seen.

A folder changed within RACY_NS of the listing is not trusted (its mtime
may not move again for an entry added in the same clock tick): such a
pattern is listed again next time.
"""

import glob
import os
import time

RACY_NS = 1_000_000_000

Stamp = tuple[int, int] | None


def _stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _folders_walked(pattern: str) -> list[str]:
    """Every existing folder the expansion of `pattern` looks into, from
    its literal head (the part before the first wildcard) down to its last
    part's folders; where a part matches nothing, the folders it was
    looked for in. A missing head is watched through its deepest existing
    parent."""
    parts = pattern.split("/")
    literal = next((i for i, part in enumerate(parts[:-1]) if glob.has_magic(part)),
                   len(parts) - 1)
    head = "/".join(parts[:literal]) or ("/" if pattern.startswith("/") else ".")
    if not os.path.isdir(head):
        while not os.path.isdir(head) and head not in ("/", ".", ""):
            head = os.path.dirname(head) or "."
        return [head]
    level, folders = [head], []
    for part in parts[literal:-1]:
        folders += level
        nxt = []
        for folder in level:
            joined = os.path.join(folder, part)
            nxt += [p for p in (glob.glob(joined) if glob.has_magic(part) else [joined])
                    if os.path.isdir(p)]
        if not nxt:
            return folders
        level = nxt
    return folders + level


class GlobCache:
    def __init__(self, clock_ns=time.time_ns):
        self.clock_ns = clock_ns
        self._entries: dict[str, tuple[list[tuple[str, Stamp]], list[str]]] = {}
        self.listings = 0           # patterns listed (not answered from the cache)

    def glob(self, pattern: str) -> list[str]:
        """Sorted matches of `pattern`, as glob.glob gives them."""
        entry = self._entries.get(pattern)
        if entry is not None and all(_stamp(f) == s for f, s in entry[0]):
            return entry[1]
        self.listings += 1
        stamps = [(f, _stamp(f)) for f in _folders_walked(pattern)]
        matches = sorted(glob.glob(pattern))
        settled = self.clock_ns() - RACY_NS
        if all(s is not None and s[1] < settled for _, s in stamps):
            self._entries[pattern] = (stamps, matches)
        else:
            self._entries.pop(pattern, None)
        return matches

    def forget(self, keep: set[str]) -> None:
        """Drop the patterns not in `keep` (site-packages of exited processes)."""
        for pattern in set(self._entries) - keep:
            del self._entries[pattern]
