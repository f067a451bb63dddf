"""Batch reader for a BPF ring buffer of fixed-size records.

bcc's ring buffer API calls a Python function per record, which tops out
well below the rates a busy host produces. The kernel lets a consumer map
the ring directly: a consumer page we write, then a read-only producer page
and the data area. The kernel offers the data area twice in a row, so that
a run of records that wraps around the end is contiguous; mapped so, every
page of it counts twice in the agent's RSS (the pages are mapped at once).
It is mapped once here, and a batch that wraps around the end is copied
out in its two parts. With every record the same size, the headers of a
whole batch are one strided numpy view: one pass finds the first record
still being written, one copy takes the batch out, one store hands the
space back to the kernel.
"""

import mmap

import numpy as np

BUSY_BIT = 1 << 31
DISCARD_BIT = 1 << 30
HEADER_SIZE = 8


class RingLayoutError(RuntimeError):
    """A record in the ring is not of the size this reader expects."""


class RingReader:
    """Drains one BPF_MAP_TYPE_RINGBUF whose records all have `dtype`.

    `map_fd` is the ring buffer map's file descriptor and `size` its data
    size in bytes (max_entries, a power of two).
    """

    def __init__(self, map_fd: int, size: int, dtype: np.dtype):
        if size <= 0 or size & (size - 1):
            raise ValueError(f"ring buffer size must be a power of two, got {size}")
        self.dtype = np.dtype(dtype)
        if self.dtype.itemsize % 8:
            raise ValueError(
                f"record size must be a multiple of 8, {self.dtype} is {self.dtype.itemsize}")
        self.map_fd = map_fd
        self.size = size
        self.mask = size - 1
        # What a read of an empty ring gives: one array, not one made per
        # read (a quiet daemon reads its rings at each wake, on cold caches).
        self._empty = np.empty(0, self.dtype)
        self.stride = HEADER_SIZE + self.dtype.itemsize
        self._record = np.dtype([
            ("len", "<u4"), ("pg_off", "<u4"), ("data", self.dtype)])
        page = mmap.PAGESIZE
        self._page = page
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        self._producer = mmap.mmap(map_fd, page + size, mmap.MAP_SHARED,
                                   mmap.PROT_READ, offset=page)
        # The positions are read and written as whole aligned 8-byte words
        # through numpy views. struct.pack_into stores byte by byte, and the
        # kernel reading a half-written consumer position in the middle of a
        # carry sees it far behind and refuses new records as "full".
        self._consumer_pos_word = np.frombuffer(self._consumer, "<u8", 1, 0)
        self._producer_pos_word = np.frombuffer(self._producer, "<u8", 1, 0)
        self.records_read = 0
        self.batches = 0

    def fileno(self) -> int:
        """The map's descriptor: readable (epoll) when the kernel wakes its
        reader, which the programs do once per batch, not per record."""
        return self.map_fd

    def pending_bytes(self) -> int:
        return self._producer_pos() - self._consumer_pos()

    def filled(self) -> float:
        """The share of the ring written and not yet read."""
        return self.pending_bytes() / self.size

    def _consumer_pos(self) -> int:
        return int(self._consumer_pos_word[0])

    def _producer_pos(self) -> int:
        return int(self._producer_pos_word[0])

    def read(self, max_records: int | None = None) -> np.ndarray:
        """Take every committed record available now (a copy), oldest first."""
        cons = self._consumer_pos()
        prod = self._producer_pos()
        available = (prod - cons) // self.stride
        if max_records is not None:
            available = min(available, max_records)
        if available <= 0:
            return self._empty
        raw = self._bytes(cons & self.mask, available * self.stride)
        records = raw.view(self._record)
        lengths = records["len"]
        itemsize = self.dtype.itemsize
        # Most batches hold only committed records of the expected size: one
        # pass tells, and only the others (busy, discarded, or of a wrong
        # size) are looked at one by one.
        odd = np.flatnonzero(lengths != itemsize)
        ready, discarded = available, None
        if odd.size:
            busy = odd[(lengths[odd] & BUSY_BIT) != 0]
            if busy.size:
                ready = int(busy[0])
                if ready == 0:
                    return self._empty
                odd = odd[odd < ready]
            flags = lengths[odd]
            sizes = flags & ~np.uint32(BUSY_BIT | DISCARD_BIT)
            wrong = odd[sizes != itemsize]
            if wrong.size:
                raise RingLayoutError(
                    f"ring record {int(wrong[0])} of this batch is "
                    f"{int(lengths[wrong[0]] & ~np.uint32(BUSY_BIT | DISCARD_BIT))} "
                    f"bytes, expected {itemsize} ({self.dtype.names})")
            discarded = odd             # committed, of the right size: discarded ones
        # One strided byte copy of the payloads (field-wise copies are slow).
        raw = raw[:ready * self.stride]
        batch = raw.reshape(ready, self.stride)[:, HEADER_SIZE:].copy().view(self.dtype)
        batch = batch.reshape(-1)
        if discarded is not None and discarded.size:
            keep = np.ones(ready, bool)
            keep[discarded] = False
            batch = batch[keep]
        # Release the space only after the copy: the kernel may reuse it.
        self._consumer_pos_word[0] = cons + ready * self.stride
        self.records_read += len(batch)
        self.batches += 1
        return batch

    def _bytes(self, start: int, length: int) -> np.ndarray:
        """`length` bytes of the data area from `start`: a view, or where they
        wrap around its end a copy of the two parts in order (headers
        first, as the kernel commits them)."""
        first = self.size - start
        if length <= first:
            return np.frombuffer(self._producer, np.uint8, length, self._page + start)
        return np.concatenate([
            np.frombuffer(self._producer, np.uint8, first, self._page + start),
            np.frombuffer(self._producer, np.uint8, length - first, self._page)])

    def close(self):
        del self._consumer_pos_word, self._producer_pos_word
        for m in (self._consumer, self._producer):
            try:
                m.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping dies with it
