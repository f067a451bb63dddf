"""The flight recorder's reach of a high-rate stream, held compressed.

The run-queue stream is most of what an agent on a busy host holds: 30 s
at 20 000 events a second is 29 MB of 48-byte records, half again the
rest of the daemon. The records compress well once their bytes are
regrouped by position and timestamps kept as differences (the same
threads and commands recur): byte-shuffled, zlib at level 1 takes them to
about 4-7 bytes each, for about 0.1 µs of CPU per record (see
BENCHMARKS.md). Records arrive in batches into a hot block; a block is
sealed (shuffled and compressed) once it holds `block_records` or spans
`block_ns`. Only sealed blocks are held compressed: what is read back is
decompressed then, and a flight recording or a `top` reads it rarely.

Age and capacity drop whole blocks, oldest first; window() leaves out
records older than the age limit behind the newest, so what it returns
matches an EventRing of the same limits, while up to one block more may be
held. Evicted records are counted.
"""

import zlib
from dataclasses import dataclass

import numpy as np

from .records import concat, rows_of


@dataclass
class _Block:
    data: bytes         # zlib of the records' bytes, byte position by byte position
    count: int
    first_ns: int       # the earliest and latest ts_ns inside
    last_ns: int


class PackedRing:
    def __init__(self, dtype: np.dtype, capacity: int, max_age_ns: int, *,
                 block_records: int = 1 << 15, block_ns: int = 1_000_000_000,
                 level: int = 1):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self.block_records = max(1, min(block_records, capacity))
        self.block_ns = block_ns
        self.level = level
        self._blocks: list[_Block] = []
        # The hot block fills one buffer, allocated once: batches copied in
        # and out of the heap left it fragmented, 8 MB more resident at 20k
        # records a second. Pages of it never written are never resident.
        self._hot = np.empty(0, self.dtype)
        self._hot_count = 0
        self._hot_first_ns: int | None = None
        self._held = 0              # records in blocks and hot
        self._newest_ns: int | None = None
        self.evicted = 0

    def __len__(self):
        return self._held

    @property
    def nbytes(self) -> int:
        """Memory the records take now: the compressed blocks and the hot one."""
        return sum(len(b.data) for b in self._blocks) + self._hot_count * self.dtype.itemsize

    def push(self, batch: np.ndarray) -> None:
        """Append `batch` (about in time order); the ring keeps a copy."""
        if not len(batch):
            return
        if not len(self._hot):
            self._hot = np.empty(self.block_records, self.dtype)
        rows, hot = rows_of(batch), rows_of(self._hot)
        done = 0
        while done < len(batch):
            n = min(len(batch) - done, self.block_records - self._hot_count)
            hot[self._hot_count:self._hot_count + n] = rows[done:done + n]
            ts = batch["ts_ns"][done:done + n].astype(np.int64)
            low, high = int(ts.min()), int(ts.max())
            self._newest_ns = high if self._newest_ns is None else max(self._newest_ns, high)
            self._hot_first_ns = low if self._hot_first_ns is None else min(
                self._hot_first_ns, low)
            self._hot_count += n
            self._held += n
            done += n
            if self._hot_count == self.block_records or \
                    self._newest_ns - self._hot_first_ns >= self.block_ns:
                self._seal()
        self._evict()

    def _seal(self):
        """Compress the hot block into a sealed one, and empty it."""
        part = self._hot[:self._hot_count]
        ts = part["ts_ns"].astype(np.int64)
        # Timestamps as differences (uint64 arithmetic wraps, so the
        # cumulative sum gives them back exactly, in any order).
        part["ts_ns"] = np.diff(part["ts_ns"], prepend=np.uint64(0))
        shuffled = np.ascontiguousarray(rows_of(part).T)
        self._blocks.append(_Block(zlib.compress(shuffled, self.level), len(part),
                                   int(ts.min()), int(ts.max())))
        self._hot_count, self._hot_first_ns = 0, None

    def _evict(self):
        limit = self._newest_ns - self.max_age_ns
        while self._blocks and (self._blocks[0].last_ns < limit
                                or self._held > self.capacity):
            gone = self._blocks.pop(0)
            self._held -= gone.count
            self.evicted += gone.count

    def _unpack(self, block: _Block) -> np.ndarray:
        raw = np.frombuffer(zlib.decompress(block.data), np.uint8)
        rows = raw.reshape(self.dtype.itemsize, block.count).T
        records = rows.copy().view(self.dtype).reshape(-1)     # writable, row-major
        records["ts_ns"] = np.cumsum(records["ts_ns"], dtype=np.uint64)
        return records

    def window(self, since_ns: int | None = None) -> np.ndarray:
        """A copy of the records held within the age limit, in arrival order
        (optionally only those from since_ns on: then only the blocks that
        reach that far are decompressed)."""
        if self._newest_ns is None:
            return np.empty(0, self.dtype)
        low = self._newest_ns - self.max_age_ns
        if since_ns is not None:
            low = max(low, since_ns)
        parts = [self._unpack(b) for b in self._blocks if b.last_ns >= low]
        if self._hot_count:
            parts.append(self._hot[:self._hot_count])
        if not parts:
            return np.empty(0, self.dtype)
        records = concat(parts)
        return records[records["ts_ns"].astype(np.int64) >= low]
