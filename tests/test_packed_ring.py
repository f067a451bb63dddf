"""PackedRing: the run-queue stream's flight-recorder reach held compressed,
returning what an EventRing of the same limits returns."""

import mmap
import weakref

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.ingest.packed_ring import OWN_PAGES_BYTES, PackedRing
from mmtrace.bpf.sched import RUNQ_EVENT

COMMS = [b"python3", b"vision-encoder", b"decoder", b"kworker/0:1"]


def runq_like(first_ts_ns: int, n: int, step_ns: int, seed: int = 0) -> np.ndarray:
    """Records shaped like a busy host's: a few hundred threads, varied delays."""
    rng = np.random.default_rng(seed)
    batch = np.zeros(n, RUNQ_EVENT)
    batch["ts_ns"] = first_ts_ns + step_ns * np.arange(n) + rng.integers(0, step_ns, n)
    batch["delay_ns"] = rng.lognormal(9, 2, n).astype(np.uint64)
    batch["tid"] = rng.integers(1000, 1300, n)
    batch["pid"] = batch["tid"] // 10 * 10
    batch["cpu"] = rng.integers(0, 8, n)
    batch["prev_tid"] = rng.integers(1000, 1300, n)
    batch["comm"] = np.array(COMMS)[batch["tid"] % len(COMMS)]
    return batch


def test_holds_the_age_limit_compressed_and_reads_back_exactly():
    age = 10 * 10**9
    packed = PackedRing(RUNQ_EVENT, 1 << 20, age)
    plain = EventRing(RUNQ_EVENT, 1 << 20, age)
    for i in range(300):                             # 30 s at 20 000 records a second
        batch = runq_like(i * 10**8, 2000, 50_000, seed=i)
        packed.push(batch)
        plain.push(batch)
    got, want = packed.window(), plain.window()
    assert len(got) == len(want) > 190_000
    assert got.tobytes() == want.tobytes()
    # Random delays and threads: about 18 B a record with LZ4, 13 with zlib
    # (real streams: 5-9 B). Under 22.4 B: at least 60 % of the raw 56 B
    # saved, with room for either codec.
    assert packed.nbytes * 2.5 < len(want) * RUNQ_EVENT.itemsize
    since = 25 * 10**9
    assert packed.window(since).tobytes() == plain.window(since).tobytes()
    # A block at a time, as a flight recording writes them.
    unpacked = []
    unpack = packed._unpack
    packed._unpack = lambda block: unpacked.append(block) or unpack(block)
    lazy = packed.pieces()
    next(lazy)
    assert len(unpacked) == 1                       # decompressed as taken, not all at once
    pieces = list(packed.pieces())
    assert len(pieces) > 30 and max(len(p) for p in pieces) <= packed.block_records
    assert np.concatenate(pieces).tobytes() == want.tobytes()
    assert packed.evicted > 0
    assert len(packed) - len(got) < packed.block_records   # at most a block beyond the age


def test_a_busy_streams_blocks_are_held_off_the_heap_and_a_quiet_ones_are_not():
    # Blocks live for the whole reach, the batches around them for a tick:
    # in malloc's heap the two interleave and hold pages a trim cannot free.
    busy = PackedRing(RUNQ_EVENT, 1 << 20, 10**9)
    quiet = PackedRing(RUNQ_EVENT, 1 << 20, 10**9)
    for i in range(20):
        busy.push(runq_like(i * 10**8, 2000, 50_000, seed=i))
        quiet.push(runq_like(i * 10**8, 5, 10**7, seed=i))
    big = [b.data for b in busy._blocks]
    small = [b.data for b in quiet._blocks]
    assert big and all(isinstance(d, mmap.mmap) and len(d) >= OWN_PAGES_BYTES for d in big)
    assert small and all(isinstance(d, bytes) and len(d) < OWN_PAGES_BYTES for d in small)
    held = [weakref.ref(d) for d in big]
    del big
    for _ in range(20):     # evicted blocks give their pages back
        busy.push(runq_like(busy._newest_ns + 10**8, 2000, 50_000))
    assert [ref() for ref in held] == [None] * len(held)
    assert busy.window().tobytes() == np.concatenate(list(busy.pieces())).tobytes()


def test_capacity_drops_the_oldest_records_and_counts_them():
    ring = PackedRing(RUNQ_EVENT, capacity=10_000, max_age_ns=10**15, block_records=1000)
    for i in range(30):
        assert ring.push(runq_like(i * 10**6, 999, 1, seed=i)) == i * 999
    assert len(ring) == 10_000 and ring.evicted == 30 * 999 - 10_000
    held = ring.window()
    assert len(held) == 10_000
    assert held.tobytes() == concat_batches(999, 30)[-10_000:].tobytes()


def concat_batches(n, count):
    return np.concatenate([runq_like(i * 10**6, n, 1, seed=i) for i in range(count)])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=25), st.integers(1, 2000),
       st.integers(1, 500), st.data())
def test_records_keep_their_numbers_and_late_updates_land(sizes, capacity, block, data):
    packed = PackedRing(RUNQ_EVENT, capacity, 10**18, block_records=block)
    plain = EventRing(RUNQ_EVENT, capacity, 10**18)
    ts = 0
    for i, n in enumerate(sizes):
        batch = runq_like(ts, n, 1000, seed=i)
        ts = int(batch["ts_ns"].max()) + 1
        assert packed.push(batch) == plain.push(batch)
        # Set a field of records pushed earlier: held, evicted, hot or sealed.
        seq = np.array(data.draw(st.lists(st.integers(0, packed.end - 1), max_size=8)),
                       dtype=np.int64)
        values = np.arange(len(seq), dtype=np.uint64) + 1000 * i
        packed.update(seq, "delay_ns", values)
        plain.update(seq, "delay_ns", values)
        assert (len(packed), packed.evicted) == (len(plain), plain.evicted)
        assert packed.window().tobytes() == plain.window().tobytes()


def test_an_idle_ring_seals_a_block_a_quarter_second_and_an_empty_one_reads_empty():
    ring = PackedRing(RUNQ_EVENT, 1 << 20, 30 * 10**9)
    assert len(ring.window()) == 0 and len(ring.window(5)) == 0
    for i in range(50):                              # 5 s of 10 records per 100 ms
        ring.push(runq_like(i * 10**8, 10, 1000, seed=i))
    assert len(ring._blocks) == 12                # 4 pushes (0.3 s) a block
    assert len(ring.window()) == 500


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3 * 10**9), st.integers(1, 400)), min_size=1,
                max_size=30),
       st.integers(1, 5 * 10**9), st.integers(1, 3000), st.integers(0, 4 * 10**9))
def test_window_matches_an_event_ring_of_the_same_age(steps, age, block, since):
    packed = PackedRing(RUNQ_EVENT, 1 << 20, age, block_records=block, block_ns=10**9)
    plain = EventRing(RUNQ_EVENT, 1 << 20, age)
    ts = 0
    for i, (gap, n) in enumerate(steps):
        ts += gap
        batch = runq_like(ts, n, 1000, seed=i)
        ts = int(batch["ts_ns"].max())
        packed.push(batch)
        plain.push(batch)
    newest = ts
    want = plain.window()
    want = want[want["ts_ns"].astype(np.int64) >= newest - age]   # EventRing keeps late arrivals
    assert packed.window().tobytes() == want.tobytes()
    recent = want[want["ts_ns"].astype(np.int64) >= since]
    assert packed.window(since).tobytes() == recent.tobytes()


def test_a_position_is_judged_once_every_few_blocks_and_every_record_reads_back(monkeypatch):
    """A position's entropy is counted once every REJUDGE_BLOCKS blocks
    (and when it first varies); the blocks between take its verdict, and
    every record comes back."""
    from mmtrace.agent.ingest import block_codec, packed_ring
    judged = []
    entropy = block_codec._entropy_bits
    monkeypatch.setattr(block_codec, "_entropy_bits",
                        lambda sample: judged.append(sample.shape[1]) or entropy(sample))
    rng = np.random.default_rng(5)
    dtype = np.dtype([("ts_ns", "<u8"), ("noise", "<u4"), ("few", "u1"), ("late", "u1")])
    ring = PackedRing(dtype, 1 << 20, 10**12, block_records=1000, block_ns=10**12)
    pushed = []
    blocks = 3 * packed_ring.REJUDGE_BLOCKS
    for k in range(blocks):
        batch = np.zeros(1000, dtype)
        batch["ts_ns"] = 10**9 * k + np.arange(1000) * 1000
        batch["noise"] = rng.integers(0, 2**32, 1000)
        batch["few"] = rng.integers(0, 2, 1000)
        if k >= 3:              # a position that starts to vary
            batch["late"] = rng.integers(0, 256, 1000)
        ring.push(batch)
        pushed.append(batch)
    assert len(ring._blocks) == blocks
    # the first block of each round judges every varying position, the
    # fourth the one that started to vary, the rest none
    assert len(judged) == 3 + 1
    raws = [b.packed.raw for b in ring._blocks]
    assert all((r == raws[-1]).all() for r in raws[3:])
    assert ring.window().tobytes() == np.concatenate(pushed).tobytes()


def _every_third_thread(records: np.ndarray) -> np.ndarray:
    return records[records["tid"] % 3 == 0]


def _joined(parts) -> bytes:
    return b"".join(p.tobytes() for p in parts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 3)), min_size=1, max_size=25),
       st.integers(200, 3000), st.integers(1, 500), st.integers(0, 2 * 10**8), st.data())
def test_kept_extracts_are_what_the_window_gives_however_records_change(
        steps, capacity, block, since, data):
    """A sealed block's extract is kept between asks (top's status asks
    every half second): it must still be what the window gives after
    pushes, capacity evictions and values set in sealed blocks."""
    packed = PackedRing(RUNQ_EVENT, capacity, 2 * 10**8, block_records=block, block_ns=5 * 10**7)
    ts = 0
    for i, (n, asks) in enumerate(steps):
        batch = runq_like(ts, n, 100_000, seed=i)
        ts = int(batch["ts_ns"].max()) + 1
        packed.push(batch)
        seq = np.array(data.draw(st.lists(st.integers(0, packed.end - 1), max_size=6)),
                       dtype=np.int64)
        packed.update(seq, "tid", np.full(len(seq), 3 * (i + 400), np.uint32))
        for _ in range(asks):
            want = _every_third_thread(packed.window(since))
            got = _joined(packed.extracts(since, "thirds", _every_third_thread))
            assert got == want.tobytes()


def test_a_second_ask_extracts_only_the_hot_block_and_a_new_key_extracts_again():
    ring = PackedRing(RUNQ_EVENT, 1 << 20, 30 * 10**9, block_ns=10**9)
    for i in range(60):                               # 6 s: 5 sealed blocks and a hot one
        ring.push(runq_like(i * 10**8, 100, 10**6, seed=i))
    calls = []

    def counted(records):
        calls.append(len(records))
        return _every_third_thread(records)

    since = 2 * 10**9
    first = _joined(ring.extracts(since, "k", counted))
    asked = len(calls)
    assert asked >= 4
    assert _joined(ring.extracts(since, "k", counted)) == first
    assert len(calls) == asked + 1                    # the hot block alone
    assert _joined(ring.extracts(since, "other", counted)) == first
    assert len(calls) == 2 * asked + 1                # another key: every block again
    # A block that leaves the window lets go of what it kept.
    list(ring.extracts(5 * 10**9, "k", counted))
    assert all(b.kept is None for b in ring._blocks if b.last_ns < 5 * 10**9)


def test_a_piece_inside_the_window_is_handed_on_uncopied_and_one_across_it_is_cut_exactly():
    from mmtrace.agent.ingest.record_arrays import stamped_from
    batch = runq_like(10**9, 500, 1000, seed=3)
    assert stamped_from(batch, 0) is batch                  # all inside: no copy
    assert stamped_from(batch, -5) is batch                 # a window reaching before 0
    cut = int(batch["ts_ns"][250])
    part = stamped_from(batch, cut)
    want = batch[batch["ts_ns"].astype(np.int64) >= cut]
    assert part is not batch and part.tobytes() == want.tobytes()
    assert len(stamped_from(batch, 1 << 62)) == 0
    late = batch.copy()
    late["ts_ns"][7] = 1 << 63                              # past int64: never in a window
    kept = stamped_from(late, 0)
    assert len(kept) == len(late) - 1 and (kept["ts_ns"] != np.uint64(1 << 63)).all()
    swapped = np.zeros(3, [("ts_ns", ">u8")])
    with pytest.raises(TypeError, match="native 8-byte integers"):
        stamped_from(swapped, 0)        # its stamps would be read byte-swapped


def test_a_kept_extract_handed_out_whole_cannot_be_written():
    ring = PackedRing(RUNQ_EVENT, 1 << 20, 10**12, block_records=100, block_ns=10**12)
    ring.push(runq_like(10**9, 300, 1000))
    (first, *_) = ring.extracts(0, "all", lambda records: records)
    assert not first.flags.writeable
    with pytest.raises(ValueError):
        first["delay_ns"][:] = 0
