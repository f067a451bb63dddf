"""A block of fixed-size records packed small, cheaply (PackedRing's seal).

Most of a run-queue record's 56 bytes are the same in every record of a
block (the high bytes of every id, the tail of the command, the process
of a scoped trace), and a few low bytes (of the timestamp's step and of
the delay) are close to random, where a compressor spends the most and
saves little. So a block is cut by byte position, as a byte shuffle would:
- positions whose byte is the same in every record are kept once;
- positions whose bytes vary a lot (order-0 entropy over `raw_bits` bits
  a byte) are kept as they are;
- the rest, near-constant, go through one LZ4 call (the lz4 package): a
  ring packs in 0.6-0.8 of the CPU it took with zlib at level 1, and a
  daemon packs every record it holds (bench/bench_block_codec.py,
  BENCHMARKS.md). Without the package, zlib (codec_missing says why).
A timestamp field is kept as zigzagged differences first, so that records
out of order (two CPUs sharing a ring) still give small numbers. Decoding
gives back every byte exactly.
"""

import zlib
from dataclasses import dataclass

import numpy as np

try:
    import lz4.block as lz4_block
    codec_missing: str | None = None
except ImportError as exc:  # a host with only what bench/gpu_bundle brings (compiled
    lz4_block = None        # packages are the host's own): zlib, slower, packs all the same
    codec_missing = f"the lz4 package cannot be imported ({exc})"

# Order-0 entropy (bits a byte) above which a position is kept as it is: a
# compressor leaves most of such bytes and spends the most on them. LZ4
# finds repeats cheaply in planes zlib was not worth running on: on the
# soak's mix, at 4 bits the run-queue ring holds 16 % fewer bytes than at
# 2.5 (fewer than zlib at 2.5), for 8 % more pack CPU, 0.63 of zlib's
# (bench_block_codec.py --raw-bits). With zlib the run-queue ring keeps
# its 2.5-bit positions raw (a ping-pong's delay byte cost zlib 15 ns a
# record for 0.7 B saved).
RAW_BITS = 4.0
ZLIB_RUNQ_RAW_BITS = 2.5
ENTROPY_SAMPLE = 1024   # records looked at to judge a position's entropy
FOLD = 64               # rows folded into one for _varying's reductions


@dataclass
class Packed:
    """A block's bytes: what position kept what."""
    count: int
    first_time: int         # the time field's first value (its steps start from it)
    first: bytes            # the first record's bytes (the constant positions' values)
    varying: np.ndarray     # byte positions that vary, in order (uint16)
    raw: np.ndarray         # bool per varying position: kept as is (else compressed)
    zipped: int             # bytes of `data` that are the other positions compressed
    # The compressed positions' bytes, then the raw ones', position after
    # position: bytes, or any buffer the holder moved them into (an mmap).
    data: object
    lz4: bool               # compressed by LZ4, else by zlib

    @property
    def nbytes(self) -> int:
        return len(self.first) + self.varying.nbytes + self.raw.nbytes + len(self.data)


def _zigzag_steps(times: np.ndarray):
    """In place: uint64 times (a field of the records, strided) become steps
    from the one before (the first: 0), as zigzagged signed numbers (a step
    back of 3 ns is 5, not 2^64 - 3). Few passes, no temporary but one."""
    field = times.view(np.int64)
    steps = np.empty(len(field), np.int64)
    steps[0] = 0
    np.subtract(field[1:], field[:-1], out=steps[1:])
    sign = steps >> 63
    steps <<= 1
    steps ^= sign
    field[:] = steps


def _times_from_steps(zz: np.ndarray, first: int) -> np.ndarray:
    steps = (zz >> np.uint64(1)).view(np.int64) ^ -(zz & np.uint64(1)).view(np.int64)
    steps[0] = np.uint64(first).view(np.int64)
    return np.cumsum(steps, dtype=np.int64).view(np.uint64)


def _entropy_bits(sample: np.ndarray) -> np.ndarray:
    """Order-0 entropy, in bits a byte, of each column of `sample` (n, k)
    (a column at a time: one count of every column at once needs a block
    of n x k words, which malloc maps afresh each time)."""
    n, k = sample.shape
    if not n:
        return np.zeros(k)
    counts = np.empty((k, 256), np.int64)
    for i in range(k):
        counts[i] = np.bincount(sample[:, i], minlength=256)
    p = counts / n
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, p * np.log2(p), 0.0)
    return -terms.sum(axis=1)


def _varying(columns: np.ndarray) -> np.ndarray:
    """Which bytes of the rows of `columns` (n, w; C-contiguous) differ
    anywhere: where a column's OR and AND over the rows differ. The rows
    are folded FOLD at a time into rows of FOLD x w words, so that each
    reduction runs over long rows (a reduction down a short row, or down
    one strided column, is a loop of a few words a step); the FOLD
    results are then folded into one."""
    n, w = columns.shape
    whole = n - n % FOLD
    high = np.zeros(w, columns.dtype)
    low = np.full(w, ~columns.dtype.type(0), columns.dtype)
    if whole:
        folded = columns[:whole].reshape(whole // FOLD, FOLD * w)
        high = np.bitwise_or.reduce(np.bitwise_or.reduce(folded, axis=0).reshape(FOLD, w),
                                    axis=0)
        low = np.bitwise_and.reduce(np.bitwise_and.reduce(folded, axis=0).reshape(FOLD, w),
                                    axis=0)
    if whole < n:
        high |= np.bitwise_or.reduce(columns[whole:], axis=0)
        low &= np.bitwise_and.reduce(columns[whole:], axis=0)
    return (high ^ low).view(np.uint8) != 0


def _use_lz4(lz4: bool | None) -> bool:
    """`lz4` as asked; None: LZ4 where the package is installed."""
    return lz4_block is not None if lz4 is None else lz4


def runq_raw_bits(lz4: bool | None = None) -> float:
    """The run-queue ring's raw_bits with LZ4 (`lz4`; None: the codec at hand)."""
    return RAW_BITS if _use_lz4(lz4) else ZLIB_RUNQ_RAW_BITS


def pack(records: np.ndarray, time_field: str | None = "ts_ns", *, in_place: bool = False,
         raw_bits: float = RAW_BITS, judged: np.ndarray | None = None,
         lz4: bool | None = None) -> Packed:
    """`records` (one dtype, any order) packed; `time_field` (uint64) is
    kept as steps. The records are not changed, unless `in_place` (and they
    are contiguous): then their time field is left as the steps. Which
    positions are kept raw (over `raw_bits` bits a byte) is judged from
    about ENTROPY_SAMPLE records spread over the block. `judged` (int8 by
    byte position of the record: 1 raw, 0 zipped, -1 not yet judged) holds
    the verdicts of earlier blocks of the same stream: the positions it has
    judged take them, the others are judged here and written into it. Only
    where and how bytes are held depends on it, never what comes back.
    `lz4`: compress with LZ4 (True) or zlib (False); None: LZ4 if installed."""
    use_lz4 = _use_lz4(lz4)
    if use_lz4 and lz4_block is None:
        raise ValueError(f"LZ4 asked for, but {codec_missing}")
    n = len(records)
    work = records if in_place and records.flags.c_contiguous else \
        np.ascontiguousarray(records).copy()
    first_time = 0
    if time_field is not None and n:
        first_time = int(work[time_field][0])
        _zigzag_steps(work[time_field])
    rows = work.view(np.uint8).reshape(n, records.dtype.itemsize)
    first = rows[0].tobytes() if n else b""
    if not n:
        return Packed(0, 0, first, np.zeros(0, np.uint16), np.zeros(0, bool), 0, b"", use_lz4)
    # Eight byte positions a word where the record size allows.
    columns = rows.view(np.uint64) if records.dtype.itemsize % 8 == 0 else rows
    varying = np.flatnonzero(_varying(columns)).astype(np.uint16)
    if judged is None:
        judged = np.full(records.dtype.itemsize, -1, np.int8)
    verdicts = judged[varying]
    unknown = np.flatnonzero(verdicts < 0)
    if len(unknown):
        every = -(-n // ENTROPY_SAMPLE)     # at most ENTROPY_SAMPLE records, spread over the block
        verdicts[unknown] = _entropy_bits(rows[::every][:, varying[unknown]]) > raw_bits
        judged[varying[unknown]] = verdicts[unknown]
    raw = verdicts > 0
    zipped = b""
    if (~raw).any():
        zipped = _compress(np.ascontiguousarray(rows[:, varying[~raw]].T), use_lz4)
    data = zipped
    if raw.any():
        data += np.ascontiguousarray(rows[:, varying[raw]].T).tobytes()
    return Packed(n, first_time, first, varying, raw, len(zipped), data, use_lz4)


def _compress(planes: np.ndarray, use_lz4: bool) -> bytes:
    if use_lz4:
        return lz4_block.compress(planes, store_size=False)
    return zlib.compress(planes, 1)


def _decompress(data, size: int, use_lz4: bool) -> bytes:
    """The `size` bytes that _compress was given, by the codec that packed them."""
    if use_lz4:
        return lz4_block.decompress(data, uncompressed_size=size)
    return zlib.decompress(data, bufsize=size)


def unpack(packed: Packed, dtype: np.dtype, time_field: str | None = "ts_ns") -> np.ndarray:
    """The records `pack` was given (a writable copy)."""
    dtype = np.dtype(dtype)
    n = packed.count
    rows = np.empty((n, dtype.itemsize), np.uint8)
    rows[:] = np.frombuffer(packed.first, np.uint8) if n else 0
    data = memoryview(packed.data)
    raw, varying = packed.raw, packed.varying
    if (~raw).any():
        planes = np.frombuffer(_decompress(data[:packed.zipped], n * int((~raw).sum()),
                                           packed.lz4), np.uint8)
        rows[:, varying[~raw]] = planes.reshape(-1, n).T
    if raw.any():
        rows[:, varying[raw]] = np.frombuffer(data[packed.zipped:], np.uint8).reshape(-1, n).T
    records = rows.view(dtype).reshape(-1)
    if time_field is not None and n:
        records[time_field] = _times_from_steps(records[time_field], packed.first_time)
    return records
