"""Where a process's files were loaded, known after the process has exited.

At a process's first GPU/NPU submission the kernel keeps its user stack
twice (bpf/device.h, load_frames): as addresses, and as (build id, file
offset) pairs. A frame that has both gives the load bias of its file:
address - virtual address of that offset. At exec the kernel also keeps the
executable's path (exe_paths). A process that exits a millisecond after its
last launch is gone before userspace reads the batch, yet its addresses
still resolve against the files on disk: the files probes are attached to
and its executable, matched by build id.
"""

import ctypes
import os
from collections import OrderedDict
from typing import Callable, Iterable

import numpy as np

from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.discovery.elf_reader import ElfError, FileKey
from mmtrace.agent.discovery.elf_symbols import ElfSymbols

LOAD_FRAMES = 8
# Files whose build ids are remembered, the most recently seen first: the
# probed files come and go (each copy of a library is a file of its own).
# Above what may need decoding at once: 128 probed and 256 released files.
MAX_INDEXED_FILES = 512
BUILD_ID_VALID = 1          # enum bpf_stack_build_id_status: BPF_STACK_BUILD_ID_VALID
# Mirrors struct load_frames (bpf/device.h): struct bpf_stack_build_id is
# {s32 status; u8 build_id[20]; u64 offset-or-ip}.
STACK_BUILD_ID = np.dtype([("status", "<i4"), ("build_id", "V20"), ("offset", "<u8")])
LOAD_FRAMES_LAYOUT = np.dtype([("ips", "<u8", (LOAD_FRAMES,)),
                               ("ids", STACK_BUILD_ID, (LOAD_FRAMES,)),
                               ("ips_bytes", "<i8"), ("ids_bytes", "<i8")])


def frame_biases(frames: np.void, files_by_build_id: Callable[[bytes], ElfSymbols | None]
                 ) -> list[tuple[int, ElfSymbols]]:
    """(load bias, file) for each distinct file that a frame with both an
    address and a build id names."""
    ips = frames["ips"][:max(0, int(frames["ips_bytes"])) // 8]
    ids = frames["ids"][:max(0, int(frames["ids_bytes"])) // STACK_BUILD_ID.itemsize]
    out: dict[tuple[int, str], tuple[int, ElfSymbols]] = {}
    for ip, frame in zip(ips.tolist(), ids):
        if int(frame["status"]) != BUILD_ID_VALID:
            continue
        elf = files_by_build_id(bytes(frame["build_id"]))
        if elf is None:
            continue
        vaddr = elf.segments.vaddr_of_offset(int(frame["offset"]))
        if vaddr is not None:
            bias = (ip - vaddr) % (1 << 64)
            out.setdefault((bias, elf.path), (bias, elf))
    return list(out.values())


class ProcessImages:
    """images(pid) -> [(load bias, ElfSymbols)], from the kernel's maps of a
    loaded program; `known_files()` lists files to match build ids against
    (the probed files), besides each process's executable.

    Counters: no_load_frames (the kernel kept none for the process),
    build_id_unknown (no file at hand has a frame's build id).

    A file's symbols stay indexed after it is gone (released, deleted),
    for the `max_files` build ids seen last. Files are read through
    `elf_cache` (one of its own where none is given)."""

    def __init__(self, bpf, known_files: Callable[[], Iterable[str]] = list,
                 max_processes: int = 4096, max_files: int = MAX_INDEXED_FILES,
                 elf_cache: ElfCache | None = None):
        self.elf_cache = elf_cache if elf_cache is not None else ElfCache()
        self.bpf = bpf
        self.known_files = known_files
        self.max_processes = max_processes
        self.max_files = max_files
        self.counters: dict[str, int] = {}
        self._by_build_id: OrderedDict[bytes, ElfSymbols] = OrderedDict()
        self._indexed: OrderedDict[FileKey, None] = OrderedDict()
        self._images: OrderedDict[tuple[int, bytes], list] = OrderedDict()

    def images(self, pid: int) -> list[tuple[int, ElfSymbols]]:
        frames = self._frames(pid)
        if frames is None:
            self._count("no_load_frames")
            return []
        # Keyed by the frames too: a reused pid is another process.
        key = (pid, frames.tobytes())
        cached = self._images.get(key)
        if cached is not None:
            return cached
        self._index(list(self.known_files()) + [p for p in [self._exe_path(pid)] if p])
        found = frame_biases(frames, self._by_build_id.get)
        if not found:
            self._count("build_id_unknown")
        self._images[key] = found
        while len(self._images) > self.max_processes:
            self._images.popitem(last=False)
        return found

    def forget(self, proc_root) -> None:
        """Drop the images of processes that have exited (their build ids
        stay indexed: names of their events still come from them)."""
        alive: dict[int, bool] = {}
        for key in list(self._images):
            pid = key[0]
            if pid not in alive:
                alive[pid] = (proc_root / str(pid)).exists()
            if not alive[pid]:
                del self._images[key]

    def _count(self, name: str):
        self.counters[name] = self.counters.get(name, 0) + 1

    def _frames(self, pid: int) -> np.void | None:
        table = self.bpf["load_frames"]
        try:
            leaf = table[table.Key(pid)]
        except KeyError:
            return None
        raw = ctypes.string_at(ctypes.addressof(leaf), ctypes.sizeof(leaf))
        if len(raw) != LOAD_FRAMES_LAYOUT.itemsize:
            raise RuntimeError(f"load_frames: expected {LOAD_FRAMES_LAYOUT.itemsize}-byte "
                               f"entries, the compiled program has {len(raw)}")
        return np.frombuffer(raw, LOAD_FRAMES_LAYOUT)[0]

    def _exe_path(self, pid: int) -> str | None:
        table = self.bpf["exe_paths"]
        try:
            leaf = table[table.Key(pid)]
        except KeyError:
            return None
        path = bytes(leaf.path).split(b"\0", 1)[0]
        return path.decode("utf-8", "surrogateescape") if path.startswith(b"/") else None

    def _index(self, paths: list[str]):
        for path in paths:
            try:
                key = FileKey.of(os.stat(path))
                if key in self._indexed:
                    self._indexed.move_to_end(key)
                    continue
                # Keys are small: remember more of them than there are files
                # out at once, so that none is parsed again each lookup.
                _remember(self._indexed, key, None, 4 * self.max_files)
                elf = self.elf_cache.open(path)
            except (ElfError, OSError):
                continue
            if elf.build_id:
                # The first file with a build id keeps it (copies are alike).
                _remember(self._by_build_id, elf.build_id,
                          self._by_build_id.get(elf.build_id, elf), self.max_files)

    def indexed_files(self) -> int:
        """How many build ids are indexed now."""
        return len(self._by_build_id)


def _remember(table: OrderedDict, key, value, limit: int):
    table[key] = value
    table.move_to_end(key)
    while len(table) > limit:
        table.popitem(last=False)
