"""block_codec: a block of records packed and unpacked byte for byte,
whatever the records hold; constant and near-random byte positions kept
apart from the ones LZ4 is given."""

import numpy as np
from hypothesis import given, settings, strategies as st

from mmtrace.agent.ingest import block_codec
from mmtrace.bpf.sched import RUNQ_EVENT

ODD = np.dtype([("ts_ns", "<u8"), ("code", "<i2"), ("name", "S5")])     # 15 bytes


def ping_pong(n: int) -> np.ndarray:
    """Two threads of one process waking each other: most bytes constant."""
    rng = np.random.default_rng(7)
    r = np.zeros(n, RUNQ_EVENT)
    r["ts_ns"] = 10**12 + np.cumsum(rng.integers(2_000, 60_000, n)).astype(np.uint64)
    r["delay_ns"] = rng.integers(500, 20_000, n)
    r["pid"] = 4242
    r["tid"] = 4242 + np.arange(n) % 2
    r["prev_tid"] = 4243 - np.arange(n) % 2
    r["cpu"] = rng.integers(0, 2, n)
    r["comm"] = b"pw"
    return r


def test_a_ping_pong_keeps_its_constant_bytes_once_and_its_noise_raw():
    records = ping_pong(20_000)
    packed = block_codec.pack(records)
    # pid, comm and the high bytes of every id and number are not held per record
    assert len(packed.varying) <= 12
    # the low bytes of the time steps and of the delays are near random: kept as they are
    assert packed.raw.sum() >= 2
    assert packed.nbytes < 6 * len(records)
    assert block_codec.unpack(packed, RUNQ_EVENT).tobytes() == records.tobytes()


def test_times_out_of_order_and_at_the_ends_of_the_range_come_back():
    records = ping_pong(1000)
    records["ts_ns"][::7] -= np.uint64(3_700)           # two CPUs sharing one ring
    records["ts_ns"][500] = np.uint64(2**64 - 1)
    records["ts_ns"][501] = 0
    before = records.copy()
    packed = block_codec.pack(records)
    assert records.tobytes() == before.tobytes()        # not changed
    assert block_codec.unpack(packed, RUNQ_EVENT).tobytes() == before.tobytes()


def test_in_place_leaves_the_records_as_scratch_and_unpacks_the_same():
    records = ping_pong(300)
    want = records.tobytes()
    packed = block_codec.pack(records, in_place=True)
    assert block_codec.unpack(packed, RUNQ_EVENT).tobytes() == want


@settings(max_examples=120, deadline=None)
@given(st.binary(min_size=0, max_size=15 * 300), st.sampled_from(["ts_ns", None]),
       st.booleans())
def test_any_bytes_of_any_record_size_come_back(data, time_field, constant_tail):
    n = len(data) // ODD.itemsize
    records = np.frombuffer(data[:n * ODD.itemsize], ODD).copy()
    if constant_tail and n:
        records["name"] = b"abc"
    packed = block_codec.pack(records, time_field)
    got = block_codec.unpack(packed, ODD, time_field)
    assert got.flags.writeable and got.tobytes() == records.tobytes()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**32))
def test_random_run_queue_blocks_come_back(n, seed):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, n * RUNQ_EVENT.itemsize, dtype=np.uint8)
    records = raw.view(RUNQ_EVENT).copy()
    records["pid"][: n // 2] = 7                       # some positions constant in part
    packed = block_codec.pack(records)
    assert block_codec.unpack(packed, RUNQ_EVENT).tobytes() == records.tobytes()


def test_a_byte_that_differs_in_one_record_anywhere_is_kept_varying():
    """_varying folds the rows 64 at a time and reduces the rest apart: a
    difference in any one record, in the folded rows or the tail, is seen."""
    for n in (1, 63, 64, 65, 200):
        for where in {0, n // 2, n - 1}:
            records = np.zeros(n, RUNQ_EVENT)
            records["comm"] = b"same"
            records["cpu"][where] = 3
            packed = block_codec.pack(records, None)
            assert (len(packed.varying) > 0) == (n > 1), (n, where)
            assert block_codec.unpack(packed, RUNQ_EVENT, None).tobytes() == records.tobytes()


def test_without_the_lz4_package_blocks_pack_with_zlib_and_come_back(monkeypatch):
    """A host with only what bench/gpu_bundle brings may lack lz4 (compiled
    packages are the host's own): the rings pack with zlib there, byte for
    byte as well, and smaller (zlib codes the planes' entropy)."""
    records = ping_pong(20_000)
    with_lz4 = block_codec.pack(records.copy())
    assert block_codec.lz4_block is not None, "lz4 missing: the suite must test LZ4 itself"
    monkeypatch.setattr(block_codec, "lz4_block", None)
    with_zlib = block_codec.pack(records.copy())
    assert (with_lz4.lz4, with_zlib.lz4) == (True, False)
    assert block_codec.unpack(with_zlib, RUNQ_EVENT).tobytes() == records.tobytes()
    assert with_zlib.nbytes < with_lz4.nbytes
