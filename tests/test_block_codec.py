"""block_codec: a block of records packed and unpacked byte for byte,
whatever the records hold; constant and near-random byte positions kept
apart from the ones LZ4 is given."""

import numpy as np
import pytest
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


def test_each_codec_packs_and_each_block_unpacks_by_its_own():
    """LZ4 where the package is installed, zlib where it is not (a host with
    only what bench/gpu_bundle brings: compiled packages are the host's
    own): both byte for byte, zlib smaller (it codes the planes' entropy),
    and each block unpacked by the codec that packed it."""
    records = ping_pong(20_000)
    assert block_codec.lz4_block is not None, "lz4 missing: the suite must test LZ4 itself"
    with_lz4 = block_codec.pack(records.copy())
    with_zlib = block_codec.pack(records.copy(), lz4=False)
    assert (with_lz4.lz4, with_zlib.lz4) == (True, False)
    assert with_zlib.nbytes < with_lz4.nbytes
    for packed in (with_lz4, with_zlib):
        assert block_codec.unpack(packed, RUNQ_EVENT).tobytes() == records.tobytes()


def test_without_lz4_the_rings_pack_with_zlib_at_zlibs_threshold_and_the_daemon_says_so(
        monkeypatch, tmp_path, caplog):
    from mmtrace.agent.config import settings as config_mod
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.ingest.packed_ring import PackedRing
    assert block_codec.runq_raw_bits() == block_codec.RAW_BITS
    monkeypatch.setattr(block_codec, "lz4_block", None)
    monkeypatch.setattr(block_codec, "codec_missing", "the lz4 package cannot be imported (x)")
    assert block_codec.runq_raw_bits() == block_codec.ZLIB_RUNQ_RAW_BITS
    records = ping_pong(5_000)
    ring = PackedRing(RUNQ_EVENT, 10_000, 10**12, block_records=1_000)
    ring.push(records.copy())
    assert ring._blocks and not any(b.packed.lz4 for b in ring._blocks)
    assert ring.window().tobytes() == records.tobytes()
    with pytest.raises(ValueError, match="LZ4 asked for"):
        block_codec.pack(records, lz4=True)
    # The daemon's start says it once, with the reason.
    daemon = Daemon(config_mod.DaemonConfig(state_dir=tmp_path / "state",
                                            socket=tmp_path / "s.sock"))
    monkeypatch.setattr(daemon, "_start_exporters", lambda: None)
    monkeypatch.setattr(daemon.probes, "start", lambda *a: None)
    try:
        with caplog.at_level("WARNING", logger="mmtrace.daemon"):
            daemon.start()
    finally:
        daemon.close()
    said = [r.getMessage() for r in caplog.records if "lz4" in r.getMessage()]
    assert len(said) == 1 and "cannot be imported (x)" in said[0] and "zlib" in said[0]
