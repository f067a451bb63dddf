"""What a running process has mapped: /proc/PID/maps parsed into sorted
arrays, and where to open the file behind a mapping from the host."""

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_MAPS_LINE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+)[ \t]*([^\n]*)$",
    re.MULTILINE)
DELETED_SUFFIX = " (deleted)"


@dataclass
class ProcessMaps:
    """The mappings of one process, sorted by start address."""
    starts: np.ndarray           # uint64
    ends: np.ndarray             # uint64
    offsets: np.ndarray          # uint64: file offset of each start
    inodes: np.ndarray           # uint64: 0 for anonymous mappings
    devs: list[str]              # "major:minor" as the kernel prints it (hex)
    perms: list[str]
    paths: list[str]             # "" for anonymous, "[heap]", "/x (deleted)", ...
    malformed_lines: int = 0
    read_at: float = 0.0
    elfs: dict = field(default_factory=dict)       # mapping index -> ElfSymbols | reason
    outcomes: dict = field(default_factory=dict)   # address -> (name | None, counter name)

    def find(self, addr: int) -> int:
        """Index of the mapping holding `addr`, or -1."""
        return int(self.find_many(np.array([addr], dtype=np.uint64))[0])

    def find_many(self, addrs: np.ndarray) -> np.ndarray:
        addrs = np.asarray(addrs, dtype=np.uint64)
        if not len(self.starts):
            return np.full(len(addrs), -1, dtype=np.int64)
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        safe = np.where(i >= 0, i, 0)
        return np.where((i >= 0) & (addrs < self.ends[safe]), i, -1)

    def file_backed(self, i: int) -> bool:
        return self.paths[i].startswith("/") and int(self.inodes[i]) != 0


def parse_maps(data: bytes) -> ProcessMaps:
    """Parse the text of /proc/PID/maps; lines that do not parse are counted."""
    rows = _MAPS_LINE.findall(data)
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    rows.sort(key=lambda r: int(r[0], 16))
    return ProcessMaps(
        starts=np.array([int(r[0], 16) for r in rows], dtype=np.uint64),
        ends=np.array([int(r[1], 16) for r in rows], dtype=np.uint64),
        offsets=np.array([int(r[3], 16) for r in rows], dtype=np.uint64),
        inodes=np.array([int(r[5]) for r in rows], dtype=np.uint64),
        devs=[r[4].decode() for r in rows],
        perms=[r[2].decode("ascii", "replace") for r in rows],
        paths=[os.fsdecode(r[6]) for r in rows],
        malformed_lines=lines - len(rows))


def read_maps(proc_root: Path, pid: int) -> ProcessMaps:
    """Read and parse /proc/PID/maps. Raises OSError (FileNotFoundError or
    ProcessLookupError when the process is gone)."""
    with open(proc_root / str(pid) / "maps", "rb") as f:
        return parse_maps(f.read())


def mapped_file_candidates(proc_root: Path, pid: int, maps: ProcessMaps, i: int) -> list[str]:
    """Where to open the file behind mapping `i`, best first: map_files gives
    the very inode that is mapped (even deleted or replaced since), the
    process's root gives its view of the path (containers)."""
    start, end = int(maps.starts[i]), int(maps.ends[i])
    candidates = [str(proc_root / str(pid) / "map_files" / f"{start:x}-{end:x}")]
    path = maps.paths[i]
    if not path.endswith(DELETED_SUFFIX):
        candidates.append(in_process_root(proc_root, pid, path))
    return candidates


def in_process_root(proc_root: Path, pid: int, path: str) -> str:
    """`path` as the process sees it, opened from the host: /proc/PID/root/path."""
    return str(proc_root / str(pid) / "root") + "/" + path.lstrip("/")
