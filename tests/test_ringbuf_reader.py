"""RingReader over a ring laid out by hand in a memfd (no eBPF): committed
records are taken in order, a busy one stops the batch, discarded ones are
skipped and their space handed back, a record of the wrong size is refused."""

import mmap
import os
import struct

import numpy as np
import pytest

from mmtrace.agent.kernel.ringbuf import BUSY_BIT, DISCARD_BIT, HEADER_SIZE, RingLayoutError, \
    RingReader
from mmtrace.bpf.sched import RUNQ_EVENT

SIZE = 1 << 16
PAGE = mmap.PAGESIZE
STRIDE = HEADER_SIZE + RUNQ_EVENT.itemsize


class FakeRing:
    """The consumer page, the producer page and the data area, as the
    kernel maps a BPF ring buffer (the data once: these tests do not wrap)."""

    def __init__(self):
        self.fd = os.memfd_create("ring")
        os.ftruncate(self.fd, 2 * PAGE + 2 * SIZE)
        self.map = mmap.mmap(self.fd, 2 * PAGE + 2 * SIZE)
        self.producer = 0

    def put(self, ts_ns: int, length: int = RUNQ_EVENT.itemsize, flags: int = 0):
        record = np.zeros(1, RUNQ_EVENT)
        record["ts_ns"] = ts_ns
        at = 2 * PAGE + self.producer
        self.map[at:at + HEADER_SIZE] = struct.pack("<II", length | flags, 0)
        self.map[at + HEADER_SIZE:at + STRIDE] = record.tobytes()
        self.producer += STRIDE
        self.map[PAGE:PAGE + 8] = struct.pack("<Q", self.producer)

    def set_flags(self, index: int, flags: int):
        at = 2 * PAGE + index * STRIDE
        self.map[at:at + 4] = struct.pack("<I", RUNQ_EVENT.itemsize | flags)

    @property
    def consumer(self) -> int:
        return struct.unpack("<Q", self.map[:8])[0]

    def reader(self) -> RingReader:
        return RingReader(self.fd, SIZE, RUNQ_EVENT)


def test_committed_records_in_order_and_their_space_handed_back():
    ring = FakeRing()
    reader = ring.reader()
    assert len(reader.read()) == 0
    for ts in range(1, 6):
        ring.put(ts)
    got = reader.read()
    assert got["ts_ns"].tolist() == [1, 2, 3, 4, 5]
    assert ring.consumer == 5 * STRIDE
    assert len(reader.read()) == 0


def test_a_busy_record_ends_the_batch_and_a_discarded_one_is_skipped():
    ring = FakeRing()
    reader = ring.reader()
    for ts in range(1, 7):
        ring.put(ts)
    ring.set_flags(1, DISCARD_BIT)
    ring.set_flags(4, BUSY_BIT)
    got = reader.read()
    assert got["ts_ns"].tolist() == [1, 3, 4]
    assert ring.consumer == 4 * STRIDE          # the discarded record's space too
    assert len(reader.read()) == 0              # still busy
    ring.set_flags(4, 0)
    assert reader.read()["ts_ns"].tolist() == [5, 6]
    ring.put(7, flags=BUSY_BIT)
    assert len(reader.read()) == 0


def test_a_record_of_another_size_is_refused_with_its_size():
    ring = FakeRing()
    reader = ring.reader()
    ring.put(1)
    ring.put(2, length=RUNQ_EVENT.itemsize - 8, flags=DISCARD_BIT)
    with pytest.raises(RingLayoutError, match=rf"ring record 1 of this batch is "
                                              rf"{RUNQ_EVENT.itemsize - 8} bytes, "
                                              rf"expected {RUNQ_EVENT.itemsize}"):
        reader.read()
    assert ring.consumer == 0


def test_filled_is_the_share_written_and_not_yet_read():
    ring = FakeRing()
    reader = ring.reader()
    assert reader.filled() == 0.0
    for ts in range(1, 9):
        ring.put(ts)
    assert reader.filled() == 8 * STRIDE / SIZE
    reader.read(max_records=3)
    assert reader.filled() == 5 * STRIDE / SIZE
    reader.read()
    assert reader.filled() == 0.0
