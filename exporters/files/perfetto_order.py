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
GATHER_PACKETS = 1 << 13        # packets gathered at once
PIECE = 48                      # bytes a row, where packets' lengths are uneven
RELEASE_PACKETS = 1 << 15       # packets whose bytes are drawn together from the adds held
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


def _gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
            at: np.ndarray | None = None):
    """The bytes of packets `at` (in that order; None: all, as given), a
    chunk at a time: each chunk's packets as the rows of a window view over
    `data` as wide as its longest (where some are much longer than most,
    rows of PIECE bytes, a long packet taking several), copied row by row
    and trimmed to their lengths (a third of the work of an index of every
    byte)."""
    for lo in range(0, len(starts) if at is None else len(at), GATHER_PACKETS):
        pick = slice(lo, lo + GATHER_PACKETS) if at is None else at[lo:lo + GATHER_PACKETS]
        ln, st = lengths[pick], starts[pick]
        if not len(ln):
            continue
        width = int(ln.max())
        if width > PIECE and width * len(ln) > 2 * int(ln.sum()):
            # Lengths too uneven for rows as wide as the longest: the long
            # packets as several rows of PIECE bytes, one after the other.
            count = (ln + PIECE - 1) // PIECE
            owner = np.repeat(np.arange(len(ln)), count)
            part = np.arange(len(owner)) - np.repeat(np.cumsum(count) - count, count)
            st = st[owner] + part * PIECE
            ln = np.minimum(ln[owner] - part * PIECE, PIECE)
            width = PIECE
        windows = len(data) - width + 1
        if windows <= 0 or width * len(ln) > 4 * int(ln.sum()):
            # Fewer bytes than a row, or lengths too uneven for rows.
            yield _gather_bytes(data, st, ln).tobytes()
            continue
        pos = np.arange(width)
        near_end = np.flatnonzero(st >= windows)
        if len(near_end):
            # A packet in the last row's width: its row begins earlier.
            back = st[near_end] - (windows - 1)
            st = st.copy()
            st[near_end] = windows - 1
        rows = np.lib.stride_tricks.as_strided(data, shape=(windows, width), strides=(1, 1),
                                               writeable=False)[st]
        keep = pos < ln[:, None]
        if len(near_end):
            keep[near_end] = (pos >= back[:, None]) & (pos < (back + ln[near_end])[:, None])
        yield rows[keep].tobytes()


def _gather_bytes(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The same by an index of every byte (4 bytes a byte)."""
    index_type = np.int32 if len(data) < 1 << 31 else np.int64
    ln, st = lengths.astype(index_type), starts.astype(index_type)
    index = np.repeat(st - (np.cumsum(ln) - ln), ln)
    index += np.arange(len(index), dtype=index_type)
    return data[index]


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
        data = np.frombuffer(b"".join(_gather(self.data, st, ln)), np.uint8)
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
        for lo in range(0, len(order), GATHER_PACKETS):
            for i in order[lo:lo + GATHER_PACKETS].tolist():
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
            data = np.frombuffer(b"".join(_gather(data, starts, lengths, keep)), np.uint8)
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
        starts[i] in data[head[i]]), in that order. Each add gives only the
        span of its bytes that these packets lie in (an add's packets come
        nearly in their stamps' order), so that what is copied follows
        what is written, not what is held."""
        starts = starts.astype(np.int64)
        spans, base = [], 0
        for h in np.unique(head).tolist():
            mine = np.flatnonzero(head == h)
            st, ln = starts[mine], lengths[mine]
            lo, hi, need = int(st.min()), int((st + ln).max()), int(ln.sum())
            if hi - lo <= 2 * need + 4096:
                spans.append(data[h][lo:hi])
                starts[mine] = st - lo + base
                base += hi - lo
            else:                           # scattered: only its own bytes
                spans.append(_gather_bytes(data[h], st, ln))
                starts[mine] = np.cumsum(ln) - ln + base
                base += need
        whole = spans[0] if len(spans) == 1 else np.concatenate(spans)
        if (starts[1:] == starts[:-1] + lengths[:-1]).all():
            self.out.write(whole[starts[0]:starts[-1] + lengths[-1]].tobytes())
        else:
            for chunk in _gather(whole, starts, lengths):
                self.out.write(chunk)
