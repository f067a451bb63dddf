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
its own kind (LATE_SEQUENCE), written sorted at the end.
"""

import numpy as np

from mmtrace.exporters.files.perfetto_fields import (
    SEQUENCE_ID, LATE_SEQUENCE, TP_SEQUENCE_ID, sequence_start)
from mmtrace.exporters.files.protowire import varint

REORDER_NS = 500_000_000
GATHER_PACKETS = 1 << 15        # packets gathered at once: the index is 8 bytes a byte
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


def _gather(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, at: np.ndarray):
    """The bytes of packets `at` (in that order), a chunk at a time."""
    for lo in range(0, len(at), GATHER_PACKETS):
        pick = at[lo:lo + GATHER_PACKETS]
        ln, st = lengths[pick], starts[pick]
        if not len(pick):
            continue
        index = np.repeat(st - (np.cumsum(ln) - ln), ln) + np.arange(int(ln.sum()))
        yield data[index].tobytes()


class PacketOrder:
    """Timed packets of the main sequence, written in time order."""

    def __init__(self, out, window_ns: int = REORDER_NS):
        self.out = out
        self.window_ns = window_ns
        self._ts = np.zeros(0, np.uint64)
        self._lengths = np.zeros(0, np.int64)
        self._data = np.zeros(0, np.uint8)
        self.written_to = 0                 # the latest timestamp written
        self.late: list[tuple[int, bytes]] = []

    def add(self, ts, lengths, blob: bytes):
        """Packets of `blob` (packet i is lengths[i] bytes, stamped ts[i])."""
        ts = np.asarray(ts, np.uint64)
        lengths = np.asarray(lengths, np.int64)
        if not len(ts):
            return
        data = np.frombuffer(blob, np.uint8)
        late = ts < np.uint64(self.written_to)
        if late.any():
            starts = np.cumsum(lengths) - lengths
            for i in np.flatnonzero(late).tolist():
                raw = bytes(data[starts[i]:starts[i] + lengths[i]])
                self.late.append((int(ts[i]), on_sequence(raw, LATE_SEQUENCE)))
            keep = np.flatnonzero(~late)
            data = np.frombuffer(b"".join(_gather(data, starts, lengths, keep)), np.uint8)
            ts, lengths = ts[keep], lengths[keep]
        self._ts = np.concatenate([self._ts, ts])
        self._lengths = np.concatenate([self._lengths, lengths])
        self._data = np.concatenate([self._data, data])

    def add_packets(self, ts, packets: list[bytes]):
        self.add(ts, [len(p) for p in packets], b"".join(packets))

    def passed(self, record_ts_ns: int):
        """Records stamped before `record_ts_ns` have all come: write what
        nothing to come can precede."""
        self._release(max(0, int(record_ts_ns) - self.window_ns))

    def finish(self):
        """Everything held, then the late packets on their own sequence."""
        self._release(None)
        if self.late:
            self.out.write(sequence_start(LATE_SEQUENCE))
            for _, packet in sorted(self.late, key=lambda item: item[0]):
                self.out.write(packet)
            self.late = []

    def _release(self, before_ns: int | None):
        if not len(self._ts):
            return
        order = np.argsort(self._ts, kind="stable")
        k = len(order) if before_ns is None else int(
            np.searchsorted(self._ts[order], np.uint64(before_ns), side="left"))
        if not k:
            return
        starts = np.cumsum(self._lengths) - self._lengths
        for chunk in _gather(self._data, starts, self._lengths, order[:k]):
            self.out.write(chunk)
        self.written_to = max(self.written_to, int(self._ts[order[k - 1]]))
        rest = order[k:]
        self._data = np.frombuffer(b"".join(_gather(self._data, starts, self._lengths, rest)),
                                   np.uint8)
        self._ts, self._lengths = self._ts[rest], self._lengths[rest]
