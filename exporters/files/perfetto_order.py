"""Perfetto packets in time order within their sequence.

The encoders make a step's packets in the order that is cheap for them:
a slice's begin and end together, a batch of run-queue waits by their
begin, then the GPU/NPU calls. Written so, timestamps would go backwards
within the sequence wherever one slice ends after the next one begins.
PacketOrder holds the timed packets and writes them sorted, once nothing
still to come can be earlier than them: a replay hands out its records
in time order (a step's before the next step's), and no packet is earlier
than the record it comes of by more than a run-queue wait (a wait's
slice begins when it began). Waits longer than `window_ns` are rare; a
packet that comes after later ones were written goes on a sequence of
its own kind (LATE_SEQUENCE), written sorted at the end. So do those a
window holding more than `max_bytes` could not wait for: the memory held
stays bounded whatever the rate.
"""

import os
import tempfile
from array import array

import numpy as np

from mmtrace.exporters.files.perfetto_fields import (
    SEQUENCE_ID, LATE_SEQUENCE, TP_SEQUENCE_ID, sequence_start)
from mmtrace.exporters.files.protowire import varint

REORDER_NS = 500_000_000
MAX_BATCHES = 64
MAX_HELD_BYTES = 8 << 20       # past this, the oldest are written before their window ends
LATE_READS = 1 << 13            # late packets read back at once
RELEASE_PACKETS = 1 << 15       # packets whose bytes are drawn together from the adds held
MAX_GROUPS = 256                # (add, length) groups moved as items, at most ...
ITEMS_A_GROUP = 32              # ... unless they hold this many packets each on average
PIECE = 32                      # else packets move as items of this many bytes, and a tail
_SEQ_TAG = varint(TP_SEQUENCE_ID << 3)[0]


def on_sequence(packet: bytes, sequence: int) -> bytes:
    """One of our packets (TracePacket whose first field is its sequence
    id, one byte) moved to `sequence` (one byte too)."""
    head = 1
    while packet[head] & 0x80:              # the packet's length varint
        head += 1
    at = head + 1
    if packet[at] != _SEQ_TAG or packet[at + 1] != SEQUENCE_ID or not 0 < sequence < 128:
        raise ValueError(f"expected a packet on sequence {SEQUENCE_ID} first, "
                         f"got bytes {packet[:at + 2].hex()}")
    return packet[:at + 1] + bytes([sequence]) + packet[at + 2:]


def _copied(sources: list[np.ndarray], source: np.ndarray, starts: np.ndarray,
            lengths: np.ndarray) -> np.ndarray:
    """The packets one after the other: packet i is lengths[i] bytes at
    starts[i] of sources[source[i]]. The packets of one source and one
    length are moved as items of that many bytes (a view of the source
    with a stride of one byte), each group in one move: packets take a few
    dozen lengths, and moving them so costs half of copying rows as wide as
    the longest and masking them. Where they take too many (a crafted
    recording's names of every length), each is moved as PIECE-byte items
    and a shorter tail."""
    lengths = np.asarray(lengths, np.int64)
    total = int(lengths.sum())
    out = np.empty(total, np.uint8)
    if not total:
        return out
    to = np.cumsum(lengths) - lengths
    source, starts = np.asarray(source, np.int64), np.asarray(starts, np.int64)
    groups = _groups(source, lengths)
    if len(groups) <= MAX_GROUPS or len(groups) * ITEMS_A_GROUP <= len(lengths):
        _move(sources, groups, source, starts, lengths, to, out)
        return out
    count = lengths // PIECE
    owner = np.repeat(np.arange(len(lengths)), count)
    step = (np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)) * PIECE
    pieces = np.full(len(owner), PIECE, np.int64)
    _move(sources, _groups(source[owner], pieces), source[owner], starts[owner] + step,
          pieces, to[owner] + step, out)
    tail, done = lengths - count * PIECE, count * PIECE
    _move(sources, _groups(source, tail), source, starts + done, tail, to + done, out)
    return out


def _groups(source: np.ndarray, sizes: np.ndarray) -> list[tuple[int, int, np.ndarray]]:
    """(source, size, which) of each distinct (source, size)."""
    if not len(sizes):
        return []
    width = int(sizes.max()) + 1
    key = source * width + sizes
    # Few distinct keys: a radix sort where they fit 16 bits.
    order = np.argsort(key.astype(np.uint16) if int(key.max()) < 1 << 16 else key,
                       kind="stable")
    key = key[order]
    bounds = [0, *(np.flatnonzero(key[1:] != key[:-1]) + 1).tolist(), len(key)]
    return [(*divmod(int(key[lo]), width), order[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]


def _move(sources: list[np.ndarray], groups, source, starts, sizes, to, out: np.ndarray):
    """Each group's spans (sizes bytes at starts of its source) to `to` in
    `out`, as items of its size."""
    for h, size, pick in groups:
        if not size:
            continue
        data, item = sources[h], np.dtype((np.void, size))
        # Views as long as a whole item fits: an index past them raises.
        taken = np.ndarray((len(data) - size + 1,), item, data, 0, (1,))[starts[pick]]
        np.ndarray((len(out) - size + 1,), item, out, 0, (1,))[to[pick]] = taken


class _Batch:
    """The packets of one add, their bytes as they came, and the order of
    their stamps; those before `at` (in that order) are written."""

    def __init__(self, ts: np.ndarray, lengths: np.ndarray, data: np.ndarray,
                 in_order: bool = False, starts: np.ndarray | None = None):
        lengths = lengths.astype(np.int32)      # an add is far below 2 GiB
        # Places as 4-byte integers where they fit: what is held per packet
        # is as much as a run-queue packet's own bytes otherwise.
        place = np.int32 if max(len(data), int(lengths.sum())) < 1 << 31 else np.int64
        if starts is None:                      # laid out one after the other
            starts = np.cumsum(lengths, dtype=place) - lengths
        else:
            starts = starts.astype(place)
        if in_order:                            # already by stamp: no sort
            self.ts, self.starts, self.lengths = ts, starts, lengths
        else:
            order = np.argsort(ts, kind="stable")
            self.ts, self.starts, self.lengths = ts[order], starts[order], lengths[order]
        self.bytes_before = np.zeros(len(self.lengths) + 1, place)
        np.cumsum(self.lengths, dtype=place, out=self.bytes_before[1:])
        self.data = data
        self.at = 0

    def unwritten_until(self, before_ns: int | None) -> int:
        """Bytes of the packets not yet written stamped before `before_ns`
        (None: all)."""
        end = max(self.until(before_ns), self.at)
        return int(self.bytes_before[end] - self.bytes_before[self.at])

    def until(self, before_ns: int | None) -> int:
        """The index past the last packet stamped before `before_ns` (None,
        or past every stamp a packet can have: all)."""
        if before_ns is None or before_ns >= 1 << 64:
            return len(self.ts)
        return int(np.searchsorted(self.ts, np.uint64(before_ns), side="left"))

    def compacted(self) -> "_Batch":
        """The packets not yet written, their bytes laid out in their
        stamps' order and copied out of the rest (a packet stamped far
        ahead must not hold its whole add); itself where they are so."""
        rest = slice(self.at, None)
        st, ln = self.starts[rest], self.lengths[rest]
        if not self.at and len(self.data) == int(ln.sum()) and (
                not len(st) or st[0] == 0) and (st[1:] == st[:-1] + ln[:-1]).all():
            return self
        data = _copied([self.data], np.zeros(len(st), np.int64), st, ln)
        return _Batch(self.ts[rest], ln, data, in_order=True)

    def take(self, end: int):
        """Packets at..end: stamps, starts in `data`, lengths (in order)."""
        pick = slice(self.at, end)
        self.at = end
        return self.ts[pick], self.starts[pick], self.lengths[pick]


class _LatePackets:
    """Packets that came after later ones were written: their bytes in a
    temporary file (a crafted recording can make them many), their stamps
    and places in memory (20 bytes each); handed back sorted by stamp."""

    def __init__(self):
        self._file = None
        self._ts, self._at, self._lengths = array("Q"), array("Q"), array("I")
        self._size = 0

    def __len__(self) -> int:
        return len(self._ts)

    def add(self, ts: int, packet: bytes):
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="mmtrace-late-")
        self._file.write(packet)
        self._ts.append(ts)
        self._at.append(self._size)
        self._lengths.append(len(packet))
        self._size += len(packet)

    def in_order(self):
        if not len(self):
            return
        self._file.flush()
        fd, at, lengths = self._file.fileno(), self._at, self._lengths
        order = np.argsort(np.frombuffer(self._ts, np.uint64), kind="stable")
        for lo in range(0, len(order), LATE_READS):
            for i in order[lo:lo + LATE_READS].tolist():
                yield os.pread(fd, lengths[i], at[i])   # not mapped: memory stays flat

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


class PacketOrder:
    """Timed packets of the main sequence, written in time order. Each add
    is sorted once, on its own; writing merges the heads of the adds held
    (a stable sort of sorted runs), so nothing held is sorted again."""

    def __init__(self, out, window_ns: int = REORDER_NS, max_bytes: int = MAX_HELD_BYTES):
        self.out = out
        self.window_ns = window_ns
        self.max_bytes = max_bytes
        self._batches: list[_Batch] = []
        self.written_to = 0                 # the latest timestamp written
        self.late = _LatePackets()

    def add(self, ts, lengths, blob: bytes, starts=None):
        """Packets of `blob` (packet i is lengths[i] bytes, stamped ts[i],
        at starts[i]; by default each after the one before), in that
        order where stamps tie."""
        ts = np.asarray(ts, np.uint64)
        lengths = np.asarray(lengths, np.int64)
        if not len(ts):
            return
        data = np.frombuffer(blob, np.uint8)
        late = ts < np.uint64(self.written_to)
        if late.any():
            if starts is None:
                starts = np.cumsum(lengths) - lengths
            for i in np.flatnonzero(late).tolist():
                raw = bytes(data[starts[i]:starts[i] + lengths[i]])
                self.late.add(int(ts[i]), on_sequence(raw, LATE_SEQUENCE))
            keep = np.flatnonzero(~late)
            data = _copied([data], np.zeros(len(keep), np.int64), starts[keep], lengths[keep])
            ts, lengths, starts = ts[keep], lengths[keep], None
            if not len(ts):
                return
        self._batches.append(_Batch(ts, lengths, data, starts=starts))
        self._bound()

    def add_packets(self, ts, packets: list[bytes]):
        self.add(ts, [len(p) for p in packets], b"".join(packets))

    def passed(self, record_ts_ns: int):
        """Records stamped before `record_ts_ns` have all come: write what
        nothing to come can precede."""
        self._release(max(0, int(record_ts_ns) - self.window_ns))
        self._bound()

    def _bound(self):
        """Held past max_bytes: write the oldest until half of that is left
        (a write copies what it draws from, so it should draw much)."""
        if not self._batches or sum(len(b.data) for b in self._batches) <= self.max_bytes:
            return
        self._compact()
        unwritten = sum(b.unwritten_until(None) for b in self._batches)
        want = unwritten - self.max_bytes // 2
        if want <= 0:
            return
        lo = min(int(b.ts[b.at]) for b in self._batches)
        hi = max(int(b.ts[-1]) for b in self._batches) + 1
        while lo < hi:          # the lowest stamp before which `want` bytes wait
            mid = (lo + hi) // 2
            if sum(b.unwritten_until(mid) for b in self._batches) >= want:
                hi = mid
            else:
                lo = mid + 1
        self._release(lo)       # lo may be 2**64: everything (until() takes it)

    def finish(self):
        """Everything held, then the late packets on their own sequence."""
        self._release(None)
        if len(self.late):
            self.out.write(sequence_start(LATE_SEQUENCE))
            for packet in self.late.in_order():
                self.out.write(packet)
        self.late.close()

    def _compact(self):
        """Adds mostly written keep only what is left of them; past
        MAX_BATCHES adds held, they become one (a packet stamped far ahead
        in each add would hold them all, and every write looks at each)."""
        self._batches = [b if not b.at or b.unwritten_until(None) * 2 > len(b.data)
                         else b.compacted() for b in self._batches]
        if len(self._batches) > MAX_BATCHES:
            parts = [b.compacted() for b in self._batches]
            self._batches = [_Batch(np.concatenate([b.ts for b in parts]),
                                    np.concatenate([b.lengths for b in parts]),
                                    np.concatenate([b.data for b in parts]))]

    def _release(self, before_ns: int | None):
        heads = [(batch, end) for batch in self._batches
                 if (end := batch.until(before_ns)) > batch.at]
        if not heads:
            return
        taken = [batch.take(end) + (batch.data,) for batch, end in heads]
        self._batches = [b for b in self._batches if b.at < len(b.ts)]
        self._compact()
        ts, starts, lengths = (np.concatenate([t[k] for t in taken]) for k in range(3))
        head = np.concatenate([np.full(len(t[0]), h, np.int32) for h, t in enumerate(taken)])
        order = np.argsort(ts, kind="stable") if len(heads) > 1 else np.arange(len(ts))
        data = [t[3] for t in taken]
        for lo in range(0, len(order), RELEASE_PACKETS):
            pick = order[lo:lo + RELEASE_PACKETS]
            self._write_packets(data, head[pick], starts[pick], lengths[pick])
        self.written_to = max(self.written_to, int(ts[order[-1]]))

    def _write_packets(self, data: list[np.ndarray], head: np.ndarray, starts: np.ndarray,
                       lengths: np.ndarray):
        """Packets from several adds' bytes (packet i: lengths[i] bytes at
        starts[i] in data[head[i]]), in that order: what is copied is what
        is written, never the rest of what is held. Packets that already
        lie one after the other in one add go out as they are."""
        starts = starts.astype(np.int64)
        # Written as they are (a binary stream takes any buffer): not copied again.
        if (head[1:] == head[:-1]).all() and (starts[1:] == starts[:-1] + lengths[:-1]).all():
            self.out.write(data[int(head[0])][starts[0]:starts[-1] + lengths[-1]])
        else:
            self.out.write(_copied(data, head, starts, lengths))
