"""A bounded ring of the recent past for one kind of record: at most
`capacity` records, none older than `max_age_ns` behind the newest. Memory
is fixed at creation whatever the event rate; evicted records are counted.
Records are numbered from 0 as they arrive, so a caller can still reach a
record it pushed (update) while the ring holds it."""

import numpy as np

from .records import rows_of, take


class EventRing:
    def __init__(self, dtype: np.dtype, capacity: int, max_age_ns: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self._ring = np.zeros(capacity, self.dtype)
        # Touch every page now: the memory is the ring's for good, and its
        # first fill should not pay the page faults batch by batch.
        self._ring.view(np.uint8)[::4096] = 0
        self._bytes = self._ring.view(np.uint8).reshape(capacity, self.dtype.itemsize)
        self.start = 0      # number of the oldest record held
        self.end = 0        # number the next record gets
        self.evicted = 0

    def __len__(self):
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Memory the ring holds, fixed at creation."""
        return self._ring.nbytes

    def push(self, batch: np.ndarray) -> int:
        """Append `batch` (about in time order); returns the number of its first record."""
        first_seq = self.end
        if not len(batch):
            return first_seq
        if len(batch) > self.capacity:
            skipped = len(batch) - self.capacity
            self.evicted += len(self) + skipped
            self.start = self.end = self.end + skipped
            batch = batch[skipped:]
        overflow = len(self) + len(batch) - self.capacity
        if overflow > 0:
            self._drop(overflow)
        at = self.end % self.capacity
        first = min(len(batch), self.capacity - at)
        data = rows_of(batch)
        self._bytes[at:at + first] = data[:first]
        self._bytes[:len(batch) - first] = data[first:]
        self.end += len(batch)
        self._drop_older_than(int(batch["ts_ns"].max()) - self.max_age_ns)
        return first_seq

    def window(self, since_ns: int | None = None) -> np.ndarray:
        """A copy of what the ring holds, oldest first (optionally from a time
        on: then only the recent tail is copied, found a chunk at a time
        from the newest end)."""
        first = self.start if since_ns is None else self._first_recent(since_ns)
        events = take(self._ring, np.arange(first, self.end) % self.capacity)
        if since_ns is not None:
            events = events[events["ts_ns"].astype(np.int64) >= since_ns]
        return events

    def _first_recent(self, since_ns: int, chunk: int = 1 << 14) -> int:
        """The number of a record at or before the first one from since_ns
        (records are about in time order: stop at a chunk wholly older)."""
        first = self.end
        while first > self.start:
            lo = max(self.start, first - chunk)
            ts = self._ring["ts_ns"][np.arange(lo, first) % self.capacity].astype(np.int64)
            first = lo
            if ts.max(initial=since_ns) < since_ns:
                break
        return first

    def update(self, seq: np.ndarray, field: str, values: np.ndarray):
        """Set `field` of the records numbered `seq` that the ring still holds."""
        held = seq >= self.start
        self._ring[field][seq[held] % self.capacity] = values[held]

    def _drop_older_than(self, limit_ns: int, chunk: int = 4096):
        """Records arrive about in time order: drop the leading run older
        than `limit_ns`, a chunk at a time."""
        while len(self):
            n = min(chunk, len(self))
            ts = self._ring["ts_ns"][np.arange(self.start, self.start + n)
                                     % self.capacity].astype(np.int64)
            fresh = np.flatnonzero(ts >= limit_ns)
            lead = int(fresh[0]) if len(fresh) else n
            self._drop(lead)
            if lead < n:
                break

    def _drop(self, n: int):
        n = min(n, len(self))
        self.start += n
        self.evicted += n
