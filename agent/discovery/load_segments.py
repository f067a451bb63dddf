"""Runtime addresses and file offsets to ELF virtual addresses, through a
file's PT_LOAD segments."""

import os

import numpy as np


class LoadSegments:
    """The PT_LOAD program headers of one file, sorted by file offset."""

    def __init__(self, segments: np.ndarray):
        self._segments = np.sort(segments, order="offset")

    def vaddr_of_offset(self, file_offset: int) -> int | None:
        """The virtual address of a file offset, through the PT_LOAD segment
        whose file bytes contain it; None when no segment does."""
        if not 0 <= file_offset < 1 << 64:
            return None
        vaddrs, ok = self.vaddrs_of_offsets(np.array([file_offset], dtype=np.uint64))
        return int(vaddrs[0]) if ok[0] else None

    def vaddrs_of_offsets(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batch vaddr_of_offset: (vaddrs, valid mask)."""
        offsets = np.asarray(offsets, dtype=np.uint64)
        seg = self._segments
        if not len(seg):
            return np.zeros(len(offsets), np.uint64), np.zeros(len(offsets), bool)
        seg_off = seg["offset"].astype(np.uint64)
        i = np.searchsorted(seg_off, offsets, side="right").astype(np.int64) - 1
        safe = np.where(i >= 0, i, 0)
        ok = (i >= 0) & (offsets < seg_off[safe] + seg["filesz"].astype(np.uint64)[safe])
        vaddrs = offsets - seg_off[safe] + seg["vaddr"].astype(np.uint64)[safe]
        return np.where(ok, vaddrs, 0).astype(np.uint64), ok

    def offset_of_vaddr(self, vaddr: int) -> int | None:
        """The file offset of a virtual address, through the PT_LOAD segment
        whose file bytes hold it; None when none does."""
        for seg in self._segments:
            if int(seg["vaddr"]) <= vaddr < int(seg["vaddr"]) + int(seg["filesz"]):
                offset = vaddr - int(seg["vaddr"]) + int(seg["offset"])
                # A corrupt header can place a segment's bytes past 2^64.
                return offset if offset < 1 << 64 else None
        return None

    def holds_vaddr(self, vaddr: int) -> bool:
        """Whether a PT_LOAD segment's memory holds ELF virtual address `vaddr`."""
        seg = self._segments
        return bool(((seg["vaddr"] <= vaddr) & (vaddr < seg["vaddr"] + seg["memsz"])).any())

    def runtime_to_vaddr(self, addr: int, map_start: int, map_offset: int) -> int | None:
        """ELF virtual address of runtime address `addr` inside a mapping of
        this file that starts at `map_start` with file offset `map_offset`."""
        return self.vaddr_of_offset(addr - map_start + map_offset)

    def load_bias(self, map_start: int, map_offset: int,
                  page_size: int = os.sysconf("SC_PAGE_SIZE")) -> int | None:
        """runtime address - ELF virtual address for the segment a mapping
        (start, file offset) holds; None when no PT_LOAD segment matches."""
        for seg in self._segments:
            low = int(seg["offset"]) & ~(page_size - 1)
            if low <= map_offset < int(seg["offset"]) + int(seg["filesz"]):
                return map_start - (int(seg["vaddr"]) + map_offset - int(seg["offset"]))
        return None
