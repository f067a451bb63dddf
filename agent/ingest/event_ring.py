"""A bounded ring of the recent past for one kind of record: at most
`capacity` records, none older than `max_age_ns` behind the newest. Memory
follows the rate: the ring starts at `initial` records and grows while
what `max_age_ns` holds at the rate seen needs more, up to `capacity`; it
never shrinks, so a steady rate holds steady memory. Evicted records are
counted.
Records are numbered from 0 as they arrive, so a caller can still reach a
record it pushed (update) while the ring holds it."""

import numpy as np

from mmtrace.agent.ingest.record_arrays import rows_of, stamped_from, take


class EventRing:
    def __init__(self, dtype: np.dtype, capacity: int, max_age_ns: int,
                 initial: int = 1 << 12):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.dtype = np.dtype(dtype)
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self._allocate(min(capacity, max(1, initial)))
        self.start = 0      # number of the oldest record held
        self.end = 0        # number the next record gets
        self.evicted = 0

    def __len__(self):
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Memory the ring holds now (at most capacity records)."""
        return self._ring.nbytes

    @property
    def allocated(self) -> int:
        """Records the ring has room for now."""
        return len(self._ring)

    def _allocate(self, size: int, held: np.ndarray | None = None):
        ring = np.zeros(size, self.dtype)
        # Touch every page now: the memory is the ring's for good, and its
        # first fill should not pay the page faults batch by batch.
        ring.view(np.uint8)[::4096] = 0
        if held is not None:
            ring[held % size] = self._ring[held % len(self._ring)]
        self._ring = ring
        self._bytes = ring.view(np.uint8).reshape(size, self.dtype.itemsize)

    def _grow_for(self, n: int):
        """Room for `n` records and a quarter more, at least a quarter more
        than now: a steady rate settles within 25 % of what it needs, and a
        rising one costs a copy per step (records keep their numbers)."""
        size = len(self._ring)
        if n <= size or size >= self.capacity:
            return
        size = max(n + n // 4, size + size // 4)
        self._allocate(min(size, self.capacity), np.arange(self.start, self.end))

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
        if len(self) + len(batch) > len(self._ring):
            # What the age limit drops anyway needs no room.
            self._drop_older_than(int(batch["ts_ns"].max()) - self.max_age_ns)
            self._grow_for(len(self) + len(batch))
        size = len(self._ring)
        overflow = len(self) + len(batch) - size
        if overflow > 0:
            self._drop(overflow)
        at = self.end % size
        first = min(len(batch), size - at)
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
        events = take(self._ring, np.arange(first, self.end) % len(self._ring))
        if since_ns is not None:
            events = stamped_from(events, since_ns)
        return events

    def pieces(self, since_ns: int | None = None):
        """window(since_ns) as an iterable of pieces (one here), as
        PackedRing gives them."""
        records = self.window(since_ns)
        if len(records):
            yield records

    def extracts(self, since_ns: int | None, key, extract):
        """extract(records) of window(since_ns) (PackedRing's keeps them a
        block at a time; nothing is packed here to be kept from)."""
        for records in self.pieces(since_ns):
            part = extract(records)
            if len(part):
                yield part

    def _first_recent(self, since_ns: int, chunk: int = 1 << 14) -> int:
        """The number of a record at or before the first one from since_ns
        (records are about in time order: stop at a chunk wholly older)."""
        first = self.end
        while first > self.start:
            lo = max(self.start, first - chunk)
            ts = self._ring["ts_ns"][np.arange(lo, first) % len(self._ring)].astype(np.int64)
            first = lo
            if ts.max(initial=since_ns) < since_ns:
                break
        return first

    def update(self, seq: np.ndarray, field: str, values: np.ndarray):
        """Set `field` of the records numbered `seq` that the ring still holds."""
        held = seq >= self.start
        self._ring[field][seq[held] % len(self._ring)] = values[held]

    def _drop_older_than(self, limit_ns: int, chunk: int = 4096):
        """Records arrive about in time order: drop the leading run older
        than `limit_ns`, a chunk at a time."""
        while len(self):
            n = min(chunk, len(self))
            ts = self._ring["ts_ns"][np.arange(self.start, self.start + n)
                                     % len(self._ring)].astype(np.int64)
            fresh = np.flatnonzero(ts >= limit_ns)
            lead = int(fresh[0]) if len(fresh) else n
            self._drop(lead)
            if lead < n:
                break

    def _drop(self, n: int):
        n = min(n, len(self))
        self.start += n
        self.evicted += n
