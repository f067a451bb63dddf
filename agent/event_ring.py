"""A bounded ring of the recent past for one kind of record: at most
`capacity` records, none older than `max_age_ns` behind the newest. Memory
is fixed at creation whatever the event rate; evicted records are counted."""

import numpy as np


class EventRing:
    def __init__(self, dtype: np.dtype, capacity: int, max_age_ns: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self._ring = np.zeros(capacity, self.dtype)
        self._start = 0     # absolute index of the oldest record held
        self._end = 0       # absolute index of the next record
        self.evicted = 0

    def __len__(self):
        return self._end - self._start

    def push(self, batch: np.ndarray):
        if not len(batch):
            return
        if len(batch) > self.capacity:
            skipped = len(batch) - self.capacity
            self.evicted += skipped
            self._start = self._end = self._end + skipped
            batch = batch[skipped:]
        overflow = len(self) + len(batch) - self.capacity
        if overflow > 0:
            self._drop(overflow)
        at = self._end % self.capacity
        first = min(len(batch), self.capacity - at)
        self._ring[at:at + first] = batch[:first]
        self._ring[:len(batch) - first] = batch[first:]
        self._end += len(batch)
        self._drop_older_than(int(batch["ts_ns"].max()) - self.max_age_ns)

    def window(self, since_ns: int | None = None) -> np.ndarray:
        """A copy of what the ring holds, oldest first (optionally from a time on)."""
        events = self._ring[np.arange(self._start, self._end) % self.capacity]
        if since_ns is not None:
            events = events[events["ts_ns"].astype(np.int64) >= since_ns]
        return events

    def _drop_older_than(self, limit_ns: int, chunk: int = 4096):
        """Records arrive about in time order: drop the leading run older
        than `limit_ns`, a chunk at a time."""
        while len(self):
            n = min(chunk, len(self))
            ts = self._ring["ts_ns"][np.arange(self._start, self._start + n)
                                     % self.capacity].astype(np.int64)
            fresh = np.flatnonzero(ts >= limit_ns)
            lead = int(fresh[0]) if len(fresh) else n
            self._drop(lead)
            if lead < n:
                break

    def _drop(self, n: int):
        n = min(n, len(self))
        self._start += n
        self.evicted += n
