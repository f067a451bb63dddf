"""A block of fixed-size records packed small, cheaply (PackedRing's seal).

zlib costs about the same per byte it is given, whatever the byte; most of
a run-queue record's 48 bytes are the same in every record of a block
(the high bytes of every id, the tail of the command, the process of a
scoped trace), and a few low bytes (of the timestamp's step and of the
delay) are close to random, where zlib spends the most and saves nothing.
So a block is cut by byte position, as a byte shuffle would:
- positions whose byte is the same in every record are kept once;
- positions whose bytes are close to random (order-0 entropy over
  RAW_BITS bits a byte) are kept as they are;
- the rest go through one zlib call.
A timestamp field is kept as zigzagged differences first, so that records
out of order (two CPUs sharing a ring) still give small numbers. Decoding
gives back every byte exactly. On a ping-pong's run-queue records this is
about 4x less CPU than zlib on the whole shuffled block, for about the
same size (BENCHMARKS.md).
"""

import zlib
from dataclasses import dataclass

import numpy as np

RAW_BITS = 3.0      # order-0 entropy a byte above which zlib would save little


@dataclass
class Packed:
    """A block's bytes: what position kept what."""
    count: int
    first_time: int         # the time field's first value (its steps start from it)
    first: bytes            # the first record's bytes (the constant positions' values)
    varying: np.ndarray     # byte positions that vary, in order (uint16)
    raw: np.ndarray         # bool per varying position: kept as is (else zipped)
    zipped: int             # bytes of `data` that are zlib of the other positions
    # The zipped positions' bytes (zlib), then the raw ones', position after
    # position: bytes, or any buffer the holder moved them into (an mmap).
    data: object

    @property
    def nbytes(self) -> int:
        return len(self.first) + self.varying.nbytes + self.raw.nbytes + len(self.data)


def _zigzag_steps(ts: np.ndarray) -> np.ndarray:
    """Steps from the first of uint64 times, each from the one before, as
    zigzagged signed numbers (a step back of 3 ns is 5, not 2^64 - 3)."""
    times = ts.view(np.int64)
    steps = np.diff(times, prepend=times[:1])
    return ((steps << 1) ^ (steps >> 63)).view(np.uint64)


def _times_from_steps(zz: np.ndarray, first: int) -> np.ndarray:
    steps = (zz >> np.uint64(1)).view(np.int64) ^ -(zz & np.uint64(1)).view(np.int64)
    steps[0] = np.uint64(first).view(np.int64)
    return np.cumsum(steps, dtype=np.int64).view(np.uint64)


def _entropy_bits(planes: np.ndarray, every: int = 8) -> np.ndarray:
    """Order-0 entropy, in bits a byte, of each row of `planes` (k, n),
    estimated from every `every`-th byte (enough to tell near-random bytes)."""
    sample = planes[:, ::every]
    n = sample.shape[1]
    out = np.empty(len(planes))
    for i, plane in enumerate(sample):
        p = np.bincount(plane, minlength=256)
        p = p[p > 0] / n
        out[i] = -(p * np.log2(p)).sum()
    return out


def _varying(words: np.ndarray) -> np.ndarray:
    """Which bytes of the rows of `words` (n, w) differ anywhere: where the
    rows' OR and AND differ. Halving, so every step is one contiguous pass."""
    low = high = words
    while len(high) > 1:
        half = len(high) // 2
        odd_high, odd_low = (high[-1], low[-1]) if len(high) % 2 else (None, None)
        high = high[:half] | high[half:2 * half]
        low = low[:half] & low[half:2 * half]
        if odd_high is not None:
            high[0] |= odd_high
            low[0] &= odd_low
    return (high[0] ^ low[0]).view(np.uint8) != 0


def pack(records: np.ndarray, time_field: str | None = "ts_ns", level: int = 1, *,
         in_place: bool = False) -> Packed:
    """`records` (one dtype, any order) packed; `time_field` (uint64) is
    kept as steps. The records are not changed, unless `in_place` (and they
    are contiguous): then their time field is left as the steps."""
    n = len(records)
    work = records if in_place and records.flags.c_contiguous else np.ascontiguousarray(records).copy()
    first_time = 0
    if time_field is not None and n:
        first_time = int(work[time_field][0])
        work[time_field] = _zigzag_steps(work[time_field])
    rows = work.view(np.uint8).reshape(n, records.dtype.itemsize)
    first = rows[0].tobytes() if n else b""
    if n:
        # Eight byte positions a word where the record size allows.
        words = rows.view(np.uint64) if records.dtype.itemsize % 8 == 0 else rows
        varying = np.flatnonzero(_varying(words)).astype(np.uint16)
    else:
        varying = np.zeros(0, np.uint16)
    planes = np.ascontiguousarray(rows[:, varying].T) if len(varying) else \
        np.zeros((0, n), np.uint8)
    raw = _entropy_bits(planes) > RAW_BITS if len(varying) else np.zeros(0, bool)
    zipped = zlib.compress(planes[~raw], level) if (~raw).any() else b""
    data = zipped + planes[raw].tobytes() if raw.any() else zipped
    return Packed(n, first_time, first, varying, raw, len(zipped), data)


def unpack(packed: Packed, dtype: np.dtype, time_field: str | None = "ts_ns") -> np.ndarray:
    """The records `pack` was given (a writable copy)."""
    dtype = np.dtype(dtype)
    n = packed.count
    rows = np.empty((n, dtype.itemsize), np.uint8)
    rows[:] = np.frombuffer(packed.first, np.uint8) if n else 0
    if len(packed.varying):
        planes = np.empty((len(packed.varying), n), np.uint8)
        data = memoryview(packed.data)
        if packed.zipped:
            planes[~packed.raw] = np.frombuffer(zlib.decompress(data[:packed.zipped]),
                                                np.uint8).reshape(-1, n)
        if packed.raw.any():
            planes[packed.raw] = np.frombuffer(data[packed.zipped:], np.uint8).reshape(-1, n)
        rows[:, packed.varying] = planes.T
    records = rows.view(dtype).reshape(-1)
    if time_field is not None and n:
        records[time_field] = _times_from_steps(records[time_field], packed.first_time)
    return records
