"""The flight recorder's reach of a high-rate stream, held compressed.

The run-queue stream is most of what an agent on a busy host holds: 30 s
at 20 000 events a second is 34 MB of 56-byte records, half again the
rest of the daemon; the aligned GPU/NPU records are 248 bytes each. The
records compress well once their bytes are regrouped by position and
timestamps kept as differences (the same threads, commands, streams and
APIs recur). A block is packed by block_codec: byte positions that never
change in the block are kept once, near-random ones (the low bytes of time
steps and delays) as they are, and only the rest go through LZ4: on the
soak's mix 7-8 bytes a run-queue record and 7-9 an aligned GPU/NPU one
(bench_sink.py, bench_block_codec.py; BENCHMARKS.md). Records arrive in
batches into a hot block; a block is sealed (packed) once it holds
`block_records` or spans `block_ns` (a quarter second by default: the hot
block is the only part held raw; the run-queue ring's blocks span a
second, about 1 MB raw at the rated rate, so that a block's fixed cost is
spread over a second's records). What is read back is unpacked then: a
flight recording or a `top` reads rarely.

Records are numbered from 0 as they arrive, as in EventRing, so a caller
can still set a field of a record it pushed (update: a GPU submission
retired by a later sync). In the hot block the record is changed in place;
in a sealed one the value is kept beside it and applied when it is read.

Capacity drops the oldest records one by one; age drops whole sealed
blocks, and window() leaves out records older than the age limit behind
the newest, so what it returns matches an EventRing of the same limits
while up to one block more may be held. Evicted records are counted.
"""

import itertools
import mmap
from dataclasses import dataclass

import numpy as np

from mmtrace.agent.ingest import block_codec
from mmtrace.agent.ingest.record_arrays import concat, rows_of, stamped_from


# Sealed blocks of this size or more are kept in pages of their own, off
# malloc's heap: blocks live for the whole reach (30 s) while the batches
# around them live for a tick, and a heap that interleaves the two stays
# resident where a trim cannot reach (in the soak, 28k records a second:
# 31.7 MB of heap resident after a trim, 14.5 MB with the blocks apart).
# Smaller blocks (a quiet stream's) would waste most of a page each.
OWN_PAGES_BYTES = 2048
# Blocks sealed on one judgement of which byte positions are near random
# (block_codec's entropy count: half the cost of packing a device block).
REJUDGE_BLOCKS = 8


def _kept(data: bytes):
    """`data` where it will be held: in an anonymous mapping of its own
    (unmapped when the block is dropped), or as it is when small."""
    if len(data) < OWN_PAGES_BYTES:
        return data
    pages = mmap.mmap(-1, len(data))
    pages.write(data)
    return pages


@dataclass
class _Block:
    packed: block_codec.Packed      # its bytes in `data`: bytes, or an mmap of their own
    first_seq: int      # number of its first record
    last_ns: int        # the latest ts_ns inside: the block's age
    kept: tuple | None = None   # (key, an extract of its records): PackedRing.extracts

    @property
    def data(self) -> bytes | mmap.mmap:
        return self.packed.data

    @property
    def count(self) -> int:
        return self.packed.count

    @property
    def end_seq(self) -> int:
        return self.first_seq + self.count


class PackedRing:
    def __init__(self, dtype: np.dtype, capacity: int, max_age_ns: int, *,
                 block_records: int = 1 << 15, block_ns: int = 250_000_000,
                 raw_bits: float = block_codec.RAW_BITS, lz4: bool | None = None):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self.block_records = max(1, min(block_records, capacity))
        self.block_ns = block_ns
        self.raw_bits = raw_bits        # block_codec.pack's
        self.lz4 = lz4                  # ... and its codec (None: LZ4 if installed)
        self._blocks: list[_Block] = []
        # Which byte positions are kept raw (block_codec.pack's `judged`), and
        # the blocks sealed since it was cleared: a stream's bytes keep their
        # character from block to block, so a position's entropy is counted
        # once every REJUDGE_BLOCKS blocks, and the blocks between take its
        # verdict (a position that starts to vary is judged when it does).
        self._judged = np.full(self.dtype.itemsize, -1, np.int8)
        self._since_judged = 0
        # The hot block fills one buffer, allocated once: batches copied in
        # and out of the heap left it fragmented, 8 MB more resident at 20k
        # records a second. Pages of it never written are never resident.
        self._hot = np.empty(0, self.dtype)
        self._hot_count = 0
        self._hot_first_ns: int | None = None
        self._newest_ns: int | None = None
        self.start = 0      # number of the oldest record held
        self.end = 0        # number the next record gets
        # Values set in sealed blocks: field -> {record number: value}.
        self._patches: dict[str, dict[int, object]] = {}

    def __len__(self):
        return self.end - self.start

    @property
    def evicted(self) -> int:
        return self.start

    @property
    def nbytes(self) -> int:
        """Memory the records take now: the compressed blocks and the hot one."""
        return sum(b.packed.nbytes for b in self._blocks) + self._hot_count * self.dtype.itemsize

    @property
    def _hot_first_seq(self) -> int:
        return self.end - self._hot_count

    def push(self, batch: np.ndarray) -> int:
        """Append `batch` (about in time order; the ring keeps a copy);
        returns the number of its first record."""
        first_seq = self.end
        if not len(batch):
            return first_seq
        if not len(self._hot):
            self._hot = np.empty(self.block_records, self.dtype)
        rows, hot = rows_of(batch), rows_of(self._hot)
        done = 0
        while done < len(batch):
            n = min(len(batch) - done, self.block_records - self._hot_count)
            hot[self._hot_count:self._hot_count + n] = rows[done:done + n]
            ts = batch["ts_ns"][done:done + n].view(np.int64)     # read in place, as int64
            low, high = int(ts.min()), int(ts.max())
            self._newest_ns = high if self._newest_ns is None else max(self._newest_ns, high)
            self._hot_first_ns = low if self._hot_first_ns is None else min(
                self._hot_first_ns, low)
            self._hot_count += n
            self.end += n
            done += n
            if self._hot_count == self.block_records or \
                    self._newest_ns - self._hot_first_ns >= self.block_ns:
                self._seal()
            self._evict()
        return first_seq

    def update(self, seq: np.ndarray, field: str, values: np.ndarray):
        """Set `field` of the records numbered `seq` that the ring still holds."""
        seq = np.asarray(seq, dtype=np.int64)
        values = np.asarray(values)
        held = seq >= self.start
        in_hot = held & (seq >= self._hot_first_seq)
        self._hot[field][seq[in_hot] - self._hot_first_seq] = values[in_hot]
        sealed = held & ~in_hot
        if sealed.any():
            self._patches.setdefault(field, {}).update(
                zip(seq[sealed].tolist(), values[sealed].tolist()))
            for block in self._blocks:      # an extract that holds the field is stale now
                if block.kept is not None and field in block.kept[1].dtype.names and \
                        ((seq >= block.first_seq) & (seq < block.end_seq) & sealed).any():
                    block.kept = None

    def _seal(self):
        """Compress the hot block (what is still held of it) into a sealed one."""
        skip = max(0, self.start - self._hot_first_seq)
        part = self._hot[skip:self._hot_count]
        if len(part):
            last_ns = int(part["ts_ns"].max())
            # The hot block is written over next: packed where it is.
            if self._since_judged == REJUDGE_BLOCKS:
                self._judged[:], self._since_judged = -1, 0
            packed = block_codec.pack(part, "ts_ns", in_place=True, raw_bits=self.raw_bits,
                                      judged=self._judged, lz4=self.lz4)
            self._since_judged += 1
            packed.data = _kept(packed.data)
            self._blocks.append(_Block(packed, self._hot_first_seq + skip, last_ns))
        self._hot_count, self._hot_first_ns = 0, None

    def _evict(self):
        start = self.start
        limit = self._newest_ns - self.max_age_ns
        while self._blocks and self._blocks[0].last_ns < limit:
            start = max(start, self._blocks.pop(0).end_seq)
        if self.end - start > self.capacity:
            start = self.end - self.capacity
            while self._blocks and self._blocks[0].end_seq <= start:
                self._blocks.pop(0)
        if not self._blocks and self._hot_count:
            # The leading run of the hot block that is older than the limit.
            first = max(start, self._hot_first_seq) - self._hot_first_seq
            ts = self._hot["ts_ns"][first:self._hot_count].astype(np.int64)
            fresh = np.flatnonzero(ts >= limit)
            start += int(fresh[0]) if len(fresh) else len(ts)
        if start != self.start:
            self.start = start
            for field, patches in self._patches.items():
                if patches and min(patches) < start:
                    self._patches[field] = {s: v for s, v in patches.items() if s >= start}

    def _unpack(self, block: _Block) -> np.ndarray:
        records = block_codec.unpack(block.packed, self.dtype, "ts_ns")     # writable
        for field, patches in self._patches.items():
            if not patches:
                continue
            seqs = np.fromiter(patches, dtype=np.int64, count=len(patches))
            inside = (seqs >= block.first_seq) & (seqs < block.end_seq)
            if inside.any():
                values = np.array([patches[s] for s in seqs[inside].tolist()],
                                  dtype=records.dtype[field])
                records[field][seqs[inside] - block.first_seq] = values
        return records[max(0, self.start - block.first_seq):]

    def _hot_held(self) -> np.ndarray:
        """The hot block's records still held (a view: written over later)."""
        return self._hot[max(0, self.start - self._hot_first_seq):self._hot_count]

    def _low(self, since_ns: int | None) -> int:
        low = self._newest_ns - self.max_age_ns
        return low if since_ns is None else max(low, since_ns)

    def extracts(self, since_ns: int | None, key, extract):
        """extract(records) of what window(since_ns) holds, a piece at a
        time. A sealed block's extract is kept with it and handed out again
        while it is asked with the same `key` (which names the extract and
        what it depends on) and no field it holds has changed in the block
        (update): a reader that asks every half second (top's status, over
        5 s) unpacks each sealed block once, not at every ask. The extract must
        keep ts_ns (the oldest block is cut by it after) and be small: a
        block outside the window lets go of its own. A block's extract
        wholly inside the window is handed out as kept, read-only."""
        if self._newest_ns is None:
            return
        low = self._low(since_ns)
        for block in self._blocks:
            if block.last_ns < low:
                block.kept = None
                continue
            cut = max(0, self.start - block.first_seq)     # capacity evicts inside a block too
            if block.kept is None or block.kept[0] != (key, cut):
                block.kept = ((key, cut), extract(self._unpack(block)))
                block.kept[1].flags.writeable = False   # handed out as it is, again
            part = block.kept[1]
            part = stamped_from(part, low)
            if len(part):
                yield part
        part = extract(stamped_from(self._hot_held().copy(), low))     # written over later
        if len(part):
            yield part

    def pieces(self, since_ns: int | None = None):
        """The records window() returns, a block at a time (decompressed as
        they are taken): a flight recording writes them so, and never holds
        the whole reach decompressed."""
        if self._newest_ns is None:
            return
        low = self._low(since_ns)
        blocks = [b for b in self._blocks if b.last_ns >= low]
        hot = self._hot_held().copy()
        for records in itertools.chain(map(self._unpack, blocks), [hot]):   # one block at a time
            records = stamped_from(records, low)
            if len(records):
                yield records

    def window(self, since_ns: int | None = None) -> np.ndarray:
        """A copy of the records held within the age limit, in arrival order
        (optionally only those from since_ns on: then only the blocks that
        reach that far are decompressed)."""
        parts = list(self.pieces(since_ns))
        return concat(parts) if parts else np.empty(0, self.dtype)
