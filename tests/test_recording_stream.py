"""Recordings read as a stream: the replay's time order, the streamed
device alignment, the batch encoders against the per-event ones, mutated
files through every reader (property-based), and memory that does not grow
with the file."""

import io
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from perfetto_slices import recording_slices
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.recording.device_replay import DeviceReplay
from mmtrace.agent.recording.device_view import DeviceContext, decode
from mmtrace.agent.ingest.record_arrays import take
from mmtrace.agent.recording.replay import Step, replay
from mmtrace.agent.recording.report import summarize
from mmtrace.agent.recording.time_order import ordered_steps
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT
from mmtrace.exporters.files import chrome
from mmtrace.exporters.files import jsonl
from mmtrace.exporters.files import perfetto, perfetto_device, perfetto_events
from mmtrace.exporters.files.protowire import varint
from mmtrace.exporters.files.rowtext import Rows, decimal_lengths, lines, varint_lengths
import peak_rss
from synthetic_recording import write_synthetic
from test_align import workloads
from test_recording import runq_records

CTX = DeviceContext(device_stream.default_infos())


def split(rows: Rows) -> list[bytes]:
    """Each row's bytes on its own."""
    made = lines(rows)
    return [made.data[s:e] for s, e in zip(made.starts_of(np.arange(len(made))).tolist(),
                                           made.ends.tolist())]


# ------------------------------------------------------------ time order

@st.composite
def late_streams(draw):
    """Per schema: stamps in arrival order, each at most `lag` behind the
    newest before it, cut into pieces."""
    lag = 50
    out = {}
    for name in draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3,
                              unique=True)):
        steps = draw(st.lists(st.integers(0, 30), min_size=0, max_size=80))
        late = draw(st.lists(st.integers(0, lag), min_size=len(steps), max_size=len(steps)))
        newest = np.cumsum(steps)
        ts = np.maximum(newest - np.array(late, dtype=np.int64), 0).astype(np.uint64)
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(ts))), max_size=8))))
        records = np.zeros(len(ts), [("ts_ns", "<u8"), ("seq", "<u4")])
        records["ts_ns"], records["seq"] = ts, np.arange(len(ts))
        out[name] = [p for p in np.split(records, cuts)]
    return out, lag


@settings(max_examples=200, deadline=None)
@given(late_streams(), st.sampled_from([16, 1 << 20]))
def test_steps_come_out_in_time_order_and_lose_nothing(streams, step_bytes):
    sources, lag = streams
    dtypes = {name: np.dtype([("ts_ns", "<u8"), ("seq", "<u4")]) for name in sources}
    steps = list(ordered_steps({n: iter(p) for n, p in sources.items()}, dtypes, lag_ns=lag,
                               step_bytes=step_bytes))
    stamps = []
    for name, pieces in sources.items():
        got = [s[name] for s in steps if name in s]
        got = np.concatenate(got) if got else np.zeros(0, dtypes[name])
        assert sorted(got["seq"].tolist()) == list(range(sum(len(p) for p in pieces)))
    for step in steps:
        stamps.append(np.sort(np.concatenate([r["ts_ns"] for r in step.values()])))
    flat = np.concatenate(stamps) if stamps else np.zeros(0)
    assert (np.diff(flat.astype(np.int64)) >= 0).all()


def cross_cpu_pieces(n_pieces=200, per=1000, seed=3):
    """Pieces as a ring two CPUs share hands them out: in commit order, 2 %
    of the records stamped up to 3.7 µs before records read ahead of them,
    also across the cut between two pieces."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype([("ts_ns", "<u8"), ("seq", "<u4")])
    ts = np.arange(n_pieces * per, dtype=np.int64) * 1000 + 10_000
    late = rng.random(len(ts)) < 0.02
    ts[late] -= rng.integers(0, 3_700, int(late.sum()))
    records = np.zeros(len(ts), dtype)
    records["ts_ns"], records["seq"] = ts, np.arange(len(ts))
    return dtype, np.split(records, n_pieces)


def test_disorder_within_pieces_is_sorted_once_not_with_all_that_is_held(monkeypatch):
    # Each record goes through a sort at most twice: on its own piece when it
    # comes out of order, and in the merge of the runs it is handed out with.
    dtype, pieces = cross_cpu_pieces()
    sorted_items = []
    argsort = np.argsort

    def counted(a, *args, **kwargs):
        sorted_items.append(len(a))
        return argsort(a, *args, **kwargs)

    monkeypatch.setattr(np, "argsort", counted)
    steps = list(ordered_steps({"a": iter(pieces)}, {"a": dtype}, lag_ns=50_000_000,
                               step_bytes=64_000))
    monkeypatch.undo()
    out = np.concatenate([s["a"] for s in steps])
    assert sorted(out["seq"].tolist()) == list(range(200_000))
    assert (np.diff(out["ts_ns"].astype(np.int64)) >= 0).all()
    assert sum(sorted_items) <= 2 * 200_000, sum(sorted_items)


@pytest.mark.parametrize("order", ["reversed", "shuffled", "alternating"])
def test_runs_stay_few_whatever_order_the_pieces_come_in(order):
    # A crafted file: one record per piece, in reverse or random order; or
    # pieces [t] and [t, far later] with t falling, each of which joins the
    # run the one before began. Every piece would hold a run of its own;
    # past MAX_RUNS the smallest are merged, and the whole comes out sorted.
    from mmtrace.agent.recording.time_order import MAX_RUNS, _Lane
    n = 20_000
    dtype = np.dtype([("ts_ns", "<u8"), ("seq", "<u4")])
    if order == "alternating":
        t = 10**9 - np.arange(n // 2, dtype=np.uint64)
        stamps = np.stack([t, t, 2 * 10**9 + np.arange(n // 2, dtype=np.uint64)], 1)
        cuts = np.cumsum(np.tile([1, 2], n // 2))[:-1]
        n = len(stamps.ravel())
        stamps = stamps.ravel()
    else:
        stamps = np.arange(n, dtype=np.uint64)[::-1] if order == "reversed" else \
            np.random.default_rng(9).permutation(n).astype(np.uint64)
        cuts = np.arange(1, n)
    records = np.zeros(n, dtype)
    records["ts_ns"], records["seq"] = stamps, np.arange(n)
    pieces = np.split(records, cuts)
    lane = _Lane(iter(pieces), dtype)
    most = 0
    for _ in pieces:
        lane.pull(10**12)
        most = max(most, len(lane.runs))
    assert most <= MAX_RUNS + 1, most
    out = lane.release(None)
    assert out["ts_ns"].tolist() == sorted(stamps.tolist())
    assert sorted(out["seq"].tolist()) == list(range(n))


def test_memory_bounds_what_a_stream_of_late_records_holds_back():
    # Every piece of "late" carries a record from the start: its horizon never
    # moves, and only the bound on held bytes lets anything out before the end.
    # Steps of a tenth of a piece (100 records): at one byte a step, 89 000
    # steps of one record took 9-30 s here and showed nothing more.
    dtype = np.dtype([("ts_ns", "<u8")])
    late = [np.concatenate([[0], np.arange(i * 1000, (i + 1) * 1000)]).astype(np.uint64)
            .view(dtype) for i in range(50)]
    busy = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint64).view(dtype) for i in range(50)]
    read = {"bytes": 0, "late": 0, "busy": 0}

    def pieces(name, source):
        for piece in source:
            read["bytes"] += piece.nbytes
            read[name] += 1
            yield piece

    sizes, held, before_late_ends = [], [], 0
    for step in ordered_steps({"late": pieces("late", late), "busy": pieces("busy", busy)},
                              {"late": dtype, "busy": dtype}, lag_ns=0, max_bytes=80_000,
                              step_bytes=800):
        held.append(read["bytes"] - sum(sizes))
        before_late_ends += read["late"] < len(late)
        sizes.append(sum(r.nbytes for r in step.values()))
    assert sum(sizes) == 50 * 1001 * 8 + 50 * 1000 * 8
    assert len(sizes) > 5 and max(sizes) <= 80_000 + 2 * 8008
    # What was read and not yet handed out stays within the bound (and a
    # piece or two), and steps come out while "late" is still being read.
    assert max(held) <= 80_000 + 2 * 8008, max(held)
    assert before_late_ends > 5


# ---------------------------------------------------- streamed alignment

@settings(max_examples=150, deadline=None)
@given(workloads())
def test_streamed_device_rows_agree_with_decoding_everything(work):
    ev, cuts = work
    whole = decode(ev, CTX)
    stream = DeviceReplay(CTX, max_held=1 << 16)
    parts = [stream.push(take(p, np.argsort(p["ts_ns"], kind="stable")))
             for p in np.split(ev, cuts) if len(p)]
    parts.append(stream.finish())
    parts = [p for p in parts if p is not None and len(p)]
    events = np.concatenate([p.events for p in parts]) if parts else whole.events[:0]
    assert events.tobytes() == whole.events.tobytes()
    for column in ("stream", "kind", "api", "op_name", "direction"):
        got = [x for p in parts for x in getattr(p, column).tolist()]
        assert got == getattr(whole, column).tolist()


def test_a_submission_never_synced_is_handed_out_when_too_much_waits():
    ev = np.zeros(100, device_stream.DEV_EVENT)
    ev["ts_ns"] = np.arange(100) * 10
    ev["api"] = 1           # cudaLaunchKernel, never synced
    ev["op_id"] = np.arange(1, 101)
    ev["pid"] = 7
    stream = DeviceReplay(CTX, max_held=16)
    out = [stream.push(ev[i:i + 10]) for i in range(0, 100, 10)]
    held_back = 100 - sum(len(p) for p in out if p is not None)
    assert held_back <= 16
    assert stream.forced_out >= 100 - 16
    rest = stream.finish()
    assert held_back == (len(rest) if rest is not None else 0)


# ------------------------------------------------------- batch encoders

big = st.integers(0, (1 << 64) - 1)


# Every length's edges, in one column: the lengths are counted only over
# the steps between a column's least and greatest value.
EDGES = sorted({0, (1 << 64) - 1} | {e + d for k in range(1, 20) for e in (10 ** k, 1 << 7 * k)
                                     for d in (-1, 0) if e + d < 1 << 64})


@given(st.lists(big, min_size=1, max_size=50))
@example(EDGES)
@example([5, 5, 5])
@example([10 ** 19])
def test_batch_numbers_match_python(values):
    v = np.array(values, np.uint64)
    assert Rows(len(v)).varint(v).const(b";").bytes() == b"".join(
        varint(x) + b";" for x in values)
    # A varint column as the exports use it: rows taken in another order,
    # and kept only where present (Rows.where).
    back = np.arange(len(v))[::-1]
    assert Rows(len(v)).varint(v).const(b";").take(back).bytes() == b"".join(
        varint(x) + b";" for x in values[::-1])
    present = v % np.uint64(3) != 0
    assert Rows(len(v)).const(b"<").where(present, Rows(len(v)).varint(v)).bytes() == b"".join(
        b"<" + (varint(x) if x % 3 else b"") for x in values)
    assert Rows(len(v), text=True).decimal(v).const(b",\n").bytes() == b"".join(
        b"%d,\n" % x for x in values)
    assert [decimal_lengths(x) for x in v] == [len(b"%d" % x) for x in values]    # one value
    assert [varint_lengths(x) for x in v] == [len(varint(x)) for x in values]
    small = v % np.uint64(1 << 53)
    assert Rows(len(v)).fixed3(small).bytes() == b"".join(
        b"%d.%03d" % (x // 1000, x % 1000) for x in small.tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([None, "alpha", "beta", "cudaLaunchKernel"]),
                          st.sampled_from(["gpu", "npu"])), max_size=60),
       st.booleans())
@example([("alpha", "gpu"), ("beta", "gpu"), ("alpha", "npu")] * 3, True)
def test_codes_of_object_columns_are_those_of_their_values_whatever_objects_hold_them(
        pairs, copies):
    from mmtrace.exporters.files.rowtext import FEW_ROWS, codes, object_codes, row_codes
    # `copies`: equal values held by distinct objects, as a decoder may give.
    own = (lambda v: None if v is None else v[:1] + v[1:]) if copies else (lambda v: v)
    first = np.array([own(a) for a, _ in pairs] or [], object)
    second = np.array([own(b) for _, b in pairs] or [], object)
    # Short columns are hashed row by row; long ones (the same rows again
    # and again) by the objects they hold.
    for times in (1, -(-FEW_ROWS // max(len(pairs), 1))):
        left, right = np.tile(first, times), np.tile(second, times)
        expected_codes, expected = codes(list(zip(left.tolist(), right.tolist())))
        found, distinct = row_codes(left, right)
        assert distinct == expected and found.tolist() == expected_codes.tolist()
        one_codes, one = codes(left.tolist())
        found, distinct = object_codes(left)
        assert distinct == one and found.tolist() == one_codes.tolist()


def test_codes_of_many_distinct_objects_survive_hash_collisions():
    from mmtrace.exporters.files.rowtext import object_codes
    from mmtrace.exporters.files.rowtext import _firsts, _addresses
    values = np.array([f"kernel_{i % 5000}" for i in range(20000)], object)
    assert _firsts(_addresses(values)[:, None]) is None     # 20 000 objects share slots
    found, distinct = object_codes(values)
    assert distinct == [f"kernel_{i}" for i in range(5000)]
    assert found.tolist() == [i % 5000 for i in range(20000)]


@st.composite
def runq_batches(draw):
    n = draw(st.integers(1, 40))
    r = np.zeros(n, RUNQ_EVENT)
    r["ts_ns"] = np.sort(np.array(draw(st.lists(st.integers(0, 1 << 62), min_size=n,
                                                max_size=n)), np.uint64))
    r["delay_ns"] = draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
    r["pid"] = draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n))
    r["tid"] = draw(st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n))
    r["cpu"] = draw(st.lists(st.integers(0, 4096), min_size=n, max_size=n))
    r["comm"] = draw(st.lists(st.binary(max_size=16), min_size=n, max_size=n))
    return r


def _lines(tag: bytes):
    return lambda keys: Rows(len(keys), text=True).const(tag).decimal(keys).const(b"\n")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 30), min_size=1, max_size=60),
       st.lists(st.integers(0, 30), max_size=60),
       st.integers(1, 7))
@example([5, 5, 5], [5, 5, 4, 5, 6], 1)
def test_merged_rows_come_in_key_order_records_first_on_ties(mine, theirs, batch):
    from mmtrace.exporters.files.rowtext import NO_LINES, lines, write_merged
    mine, theirs = np.sort(np.array(mine, np.uint64)), np.sort(np.array(theirs, np.uint64))
    out = io.BytesIO()
    others = lines(_lines(b"o")(theirs)) if len(theirs) else NO_LINES
    write_merged(out, _lines(b"r"), mine, mine, others, theirs, batch=batch)
    expected = sorted([(k, 0, b"r%d\n" % k) for k in mine.tolist()]
                      + [(k, 1, b"o%d\n" % k) for k in theirs.tolist()])
    assert out.getvalue() == b"".join(line for _, _, line in expected)


def test_long_fixed_pieces_past_nine_never_stand_as_a_newline():
    # Eleven pieces, each over a twelfth of the row, stand in: the stand-in
    # bytes skip tab, newline and carriage return.
    piece = b"%02d-a-long-fixed-text-piece-that-stands-in-for-many-bytes\n"
    rows = Rows(2, text=True)
    for k in range(11):
        rows.const(piece % k).decimal(np.array([k, k + 1]))
    assert len(rows._matrix()[1]) == 11
    expected = b"".join(b"".join(piece % k + b"%d" % (k + i) for k in range(11))
                        for i in range(2))
    assert rows.bytes() == expected


def test_optional_text_writes_over_no_array_of_the_callers_and_takes_an_empty_value():
    present = np.array([True, False])
    mine = np.frombuffer(b"abcdabcd", np.uint8).reshape(2, 4).copy()
    rows = Rows(2, text=True).optional(present, Rows(2, text=True).fixed(mine, np.ones(2, bool)))
    assert rows.const(b";").bytes() == b"abcd;null;"
    assert mine.tobytes() == b"abcdabcd"
    empty = Rows(2, text=True).optional(present, Rows(2, text=True).const(b"")).const(b";")
    assert empty.bytes() == b";null;"


def test_fixed_pieces_stand_in_only_where_they_are_a_share_of_the_row():
    values = np.array([7, 12345])
    short = Rows(2, text=True).const(b"x" * 20).decimal(values).const(b"y" * 400)
    assert [len(p) for _, p in short._matrix()[1]] == [400]     # 20 < (420 + digits) / 12
    assert short.bytes() == b"".join(b"x" * 20 + b"%d" % v + b"y" * 400 for v in values)
    taken = short.take(np.array([1, 1, 0]))
    assert taken.bytes() == b"".join(b"x" * 20 + b"%d" % v + b"y" * 400
                                     for v in (12345, 12345, 7))


@settings(max_examples=200, deadline=None)
@given(runq_batches())
def test_runq_lines_say_what_the_records_say(runq):
    out = io.BytesIO()
    assert jsonl.write_step(Step({"cpu.runq": runq}), out) == len(runq)
    lines = [json.loads(line) for line in out.getvalue().decode().splitlines()]
    assert [list(x) for x in lines] == [list(jsonl.KEYS)] * len(runq)
    for line, rec in zip(lines, runq):
        assert (line["ts_ns"], line["pid"], line["tid"], line["duration_ns"]) == (
            int(rec["ts_ns"]), int(rec["pid"]), int(rec["tid"]), int(rec["delay_ns"]))
        assert line["comm"] == rec["comm"].decode(errors="replace")
        assert line["stream"] == "cpu" and line["kind"] == "runq" and line["api"] is None


@settings(max_examples=100, deadline=None)
@given(runq_batches())
def test_runq_slices_in_batch_are_the_per_slice_bytes(runq):
    runq["delay_ns"] = np.minimum(runq["delay_ns"], runq["ts_ns"])
    one_by_one, batch = io.BytesIO(), io.BytesIO()
    perfetto_events.write_perfetto(recording_slices({"cpu.runq": runq}), one_by_one)
    perfetto.write_recording([Step({"cpu.runq": runq})], batch)
    assert batch.getvalue() == one_by_one.getvalue()


@settings(max_examples=100, deadline=None)
@given(runq_batches())
def test_chrome_trace_is_json_with_exact_microseconds(runq):
    out = io.BytesIO()
    chrome.write_chrome([Step({"cpu.runq": runq[: len(runq) // 2]}),
                         Step({"cpu.runq": runq[len(runq) // 2:]})], out)
    events = json.loads(out.getvalue())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(runq)
    names = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M"}
    assert names == set(zip(runq["pid"].tolist(), runq["tid"].tolist()))


# -------------------------------------------------------- mutated files

def sample_file(path):
    w = recording.RecordingWriter(path, {"cpu.runq": RUNQ_EVENT,
                                         "dev.event": device_stream.DEV_EVENT})
    w.write_meta({"apis": device_stream.default_table().to_json(),
                  "config": {"p99": {"window_s": 0.001}}})
    w.write_events("cpu.runq", runq_records(30))
    dev = np.zeros(6, device_stream.DEV_EVENT)
    dev["ts_ns"] = 1_000_000 + np.arange(6) * 3000
    dev["api"] = [1, 1, 9, 13, 1, 13]
    dev["op_id"] = [1, 2, 3, 0, 4, 0]
    dev["flags"] = [0, 0, 0, 1, 0, 1]
    dev["duration_ns"] = [0, 0, 0, 500, 0, 400]
    dev["pid"], dev["tid"], dev["comm"] = 42, 100, b"worker"
    w.write_events("dev.event", dev)
    w.write_meta({"op_names": [[42, 0, "k()"]]})
    w.write_events("cpu.runq", runq_records(30, start=30))
    w.close({"duration_s": 0.5, "lost_events": 1})
    return path


def rechecksum(data: bytearray) -> bytearray:
    """Make every checksum hold again, wherever the structure still parses,
    so that odd content reaches the checks behind the checksums."""
    if len(data) < 16:
        return data
    body = struct.unpack_from("<I", data, 12)[0]
    end = 16 + body
    if end + 4 > len(data):
        return data
    struct.pack_into("<I", data, end, zlib.crc32(bytes(data[:end])))
    offset = end + 4
    while offset + recording._CHUNK.size <= len(data):
        magic, kind, _, schema, count, length, _ = recording._CHUNK.unpack_from(data, offset)
        start = offset + recording._CHUNK.size
        if start + length > len(data):
            break
        fields = (magic, kind, 0, schema, count, length)
        crc = zlib.crc32(bytes(data[start:start + length]),
                         zlib.crc32(recording._CHUNK.pack(*fields, 0)))
        recording._CHUNK.pack_into(data, offset, *fields, crc)
        offset = start + length
    return data


mutation = st.one_of(
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("set"), st.floats(0, 1, exclude_max=True), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1, exclude_max=True), st.binary(max_size=40)),
    st.tuples(st.just("delete"), st.floats(0, 1, exclude_max=True), st.integers(1, 64)),
    st.tuples(st.just("cut"), st.floats(0, 1, exclude_max=True), st.just(0)),
)


def mutate(data: bytes, ops) -> bytearray:
    data = bytearray(data)
    for op, where, arg in ops:
        at = int(where * len(data)) if data else 0
        if op == "flip" and data:
            data[at] ^= 1 << arg
        elif op == "set" and data:
            data[at] = arg
        elif op == "insert":
            data[at:at] = arg
        elif op == "delete":
            del data[at:at + arg]
        elif op == "cut":
            del data[at:]
    return data


def read_everything(path):
    """Everything a command does with a recording; RecordingError is the
    one documented failure."""
    try:
        with recording.RecordingReader(path) as rec:
            summarize(rec)
            for write in (jsonl.write_jsonl, chrome.write_chrome, perfetto.write_recording):
                write(replay(rec), io.BytesIO())
    except recording.RecordingError as exc:
        assert str(exc).startswith(str(path))
        return False
    return True


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(mutation, min_size=1, max_size=5), fix=st.booleans())
def test_mutated_recordings_read_or_fail_with_one_error(tmp_path, ops, fix):
    data = mutate(sample_file(tmp_path / "a.mmtr").read_bytes(), ops)
    if fix:
        data = rechecksum(data)
    path = tmp_path / "m.mmtr"
    path.write_bytes(bytes(data))
    read_everything(path)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["duration_s", "lost_events", "p99", "config", "window_s", "apis",
                         "op_names", "symbol_names", "modalities", "counters", "entropy",
                         "tau", "request_series", "x"]), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(meta=json_values, footer=json_values)
def test_any_json_in_meta_and_footer_reads_or_fails_with_one_error(tmp_path, meta, footer):
    import crafted_recording as craft
    path = tmp_path / "j.mmtr"
    path.write_bytes(craft.header() + craft.meta(json.dumps(meta).encode())
                     + craft.events(runq_records(5)) + craft.end(json.dumps(footer).encode()))
    read_everything(path)


# ----------------------------------------------------- bounded memory

MEMORY_COMMANDS = [["report", "--json"], ["export", "--format", "jsonl"],
                   ["export", "--format", "chrome"], ["export", "--format", "perfetto"]]


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory) -> dict:
    """peak_rss.measure of each command over a 20 MB and a 400 MB
    recording, by (command, file name). Two run at a time, the large ones
    first: ru_maxrss is each process's own (none of them uses threads), so
    the one beside it moves it not, and the four large runs take half as
    long."""
    files = tmp_path_factory.mktemp("sizes")
    write_synthetic(files / "small.mmtr", 20 << 20)
    write_synthetic(files / "large.mmtr", 400 << 20)
    runs = {}
    for name in ("large.mmtr", "small.mmtr"):
        for command in MEMORY_COMMANDS:
            args = [command[0], files / name, *command[1:]]
            if command[0] == "export":
                args += ["-o", os.devnull]
            runs[(tuple(command), name)] = peak_rss.mmtrace(*args)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(runs, pool.map(peak_rss.measure, runs.values())))


@pytest.mark.slow
@pytest.mark.parametrize("command", MEMORY_COMMANDS)
def test_memory_does_not_grow_with_the_recording(memory_runs, command):
    peaks = []
    for name in ("small.mmtr", "large.mmtr"):
        result = memory_runs[(tuple(command), name)]
        assert result["exit"] == 0, result["stderr"]
        peaks.append(result["peak_rss_mb"])
    small, large = peaks
    # 20 times the file, a few MB more at most (allocator noise, bigger tables).
    assert large - small < 24, f"{command}: {small:.0f} MB for 20 MB, {large:.0f} MB for 400 MB"
    assert large < 100


def test_detector_state_is_bounded_whatever_the_recording_names(tmp_path):
    from mmtrace.agent.recording import offline_detectors as offline
    n = offline.MAX_SERIES + 500
    runq = np.zeros(n, RUNQ_EVENT)
    runq["ts_ns"] = 10**9 + np.arange(n)
    runq["pid"] = runq["tid"] = np.arange(n) + 1
    runq["delay_ns"] = 1000
    dev = np.zeros(n, device_stream.DEV_EVENT)
    dev["ts_ns"] = 10**9 + np.arange(n)
    dev["pid"] = dev["tid"] = np.arange(n) + 1
    dev["kind"] = device_stream.KIND_IDS["launch"]
    dev["api"] = 1
    w = recording.RecordingWriter(tmp_path / "many.mmtr", {"cpu.runq": RUNQ_EVENT,
                                                           "dev.event": device_stream.DEV_EVENT})
    w.write_events("cpu.runq", runq)
    w.write_events("dev.event", dev)
    w.close({})
    with recording.RecordingReader(tmp_path / "many.mmtr") as rec:
        detectors = offline.Detectors(rec)
        for step in replay(rec):
            detectors.feed(step)
        detectors.finish()
    p99 = detectors.parts[0]
    assert len(p99.detector._names) == offline.MAX_SERIES
    assert p99.skipped_series >= 500


@settings(max_examples=100, deadline=None)
@given(workloads(), st.integers(1, 8))
def test_device_packets_in_batch_are_the_per_slice_bytes(work, batch):
    ev, _ = work
    ev["bytes"] = np.arange(len(ev)) * 1000 + 1     # copies add up in the counters
    rows = decode(ev, CTX)
    one_by_one = [b"".join(perfetto_events.item_packets(item) for item in items)
                  for items in perfetto_events.device_items(rows, {})]
    assert perfetto_device.device_packets(rows) == one_by_one
    # Flows and copy totals carry across batches (a flow may end batches later).
    encoder = perfetto_device.DeviceEncoder()
    assert [p for part in rows.batches(batch) for p in encoder.packets(part)] == one_by_one


def reference_device_lines(rows) -> list[bytes]:
    """The lines as the per-event encoder wrote them (before the batch one)."""
    def null(value):
        return "null" if value is None else str(value)

    def q(value):
        if value is None:
            return "null"
        return json.dumps(value.decode(errors="replace") if isinstance(value, bytes) else value)

    ds = device_stream
    out = []
    for i, e in enumerate(rows.events):
        f, kind, flags = rows.fields[i], rows.kind[i], int(e["flags"])
        stream_handle = int(e["stream_handle"]) if ds.STREAM in f else None
        if kind == "sync" and ds.HANDLE in f and not flags & 16:
            stream_handle = None
        retired = int(e["retired_ns"]) if kind != "sync" else -1
        grid = [int(e["grid_x"]), int(e["grid_y"]), int(e["grid_z"])]
        block = [int(e["block_x"]), int(e["block_y"]), int(e["block_z"])]
        out.append((
            f'{{"ts_ns":{e["ts_ns"]},"stream":"{rows.stream[i]}","kind":"{kind}",'
            f'"pid":{e["pid"]},"tid":{e["tid"]},"comm":{q(e["comm"])},'
            f'"api":{q(rows.api[i])},"op_id":{null(int(e["op_id"]) or None)},'
            f'"op_name":{q(rows.op_name[i])},'
            f'"handle":{null(int(e["handle"]) if ds.HANDLE in f else None)},'
            f'"stream_handle":{null(stream_handle)},'
            f'"grid":{json.dumps(grid) if ds.GRID in f else "null"},'
            f'"block":{json.dumps(block) if ds.BLOCK in f else "null"},'
            f'"shared_mem_bytes":'
            f'{null(int(e["shared_mem_bytes"]) if ds.SHARED_MEM in f else None)},'
            f'"bytes":{null(int(e["bytes"]) if ds.BYTES in f else None)},'
            f'"direction":{q(rows.direction[i])},'
            f'"duration_ns":{null(int(e["duration_ns"]) if flags & 1 else None)},'
            f'"sched_delay_ns":{e["sched_delay_ns"]},'
            f'"retired_ns":{null(retired if retired >= 0 else None)},'
            f'"device":{null(int(e["device"]) if e["device"] >= 0 else None)},'
            f'"ret":{null(int(e["ret"]) if flags & 1 else None)}}}\n').encode())
    return out


@settings(max_examples=100, deadline=None)
@given(workloads(), st.lists(st.integers(-2, 1 << 40), min_size=3, max_size=3),
       st.binary(max_size=16))
def test_device_lines_in_batch_are_the_per_event_lines(work, numbers, comm):
    ev, _ = work
    ev["grid_x"], ev["block_y"] = 7, 1024
    ev["device"] = numbers[0] if numbers[0] < 1 << 31 else -1
    ev["bytes"], ev["sched_delay_ns"] = max(numbers[1], 0), max(numbers[2], 0)
    ev["comm"] = comm
    ev["ret"] = max(min(numbers[0] - 2, (1 << 31) - 1), -1 << 31)   # negative ones too
    rows = decode(ev, CTX)
    assert split(jsonl.device_rows(rows)) == reference_device_lines(rows)


def reference_chrome_events(rows) -> list[dict]:
    """The events as the per-event encoder made them (before the batch one)."""
    out = []
    for i, e in enumerate(rows.events):
        args = {"api": rows.api[i], "op_id": int(e["op_id"]) or None,
                "stream_handle": int(e["stream_handle"]),
                "sched_delay_us": int(e["sched_delay_ns"]) / 1e3}
        if rows.direction[i] is not None:
            args.update(bytes=int(e["bytes"]), direction=rows.direction[i])
        if e["retired_ns"] >= 0:
            args["retired_us"] = int(e["retired_ns"]) / 1e3
        if e["flags"] & 1:
            args["ret"] = int(e["ret"])
            if e["ret"] != 0:
                args["error"] = rows.error[i]
        event = {"name": rows.op_name[i] or rows.api[i], "pid": int(e["pid"]),
                 "cat": f"{rows.stream[i]}.{rows.kind[i]}", "tid": int(e["tid"]),
                 "ts": int(e["ts_ns"]) / 1e3, "args": args}
        if e["flags"] & 1:
            event.update(ph="X", dur=int(e["duration_ns"]) / 1e3)
        else:
            event.update(ph="i", s="t")
        out.append(event)
    return out


@settings(max_examples=100, deadline=None)
@given(workloads())
def test_chrome_device_events_in_batch_say_what_the_per_event_ones_said(work):
    ev, _ = work
    ev["ret"] = np.arange(len(ev)) % 3 * 35 - 35       # -35, 0, 35: failed and not
    rows = decode(ev, CTX)
    got = [json.loads(row[1:]) for row in split(chrome.device_rows(rows))]
    assert got == reference_chrome_events(rows)


@pytest.mark.parametrize("late_s", [0.5, 3.0])
def test_a_late_sync_is_exported_once_and_in_order_within_the_lag(tmp_path, late_s):
    from click.testing import CliRunner
    from mmtrace.agent.cli import cli
    second = 10**9
    launches = np.zeros(40, device_stream.DEV_EVENT)
    launches["ts_ns"] = second + np.arange(40) * (second // 10)
    launches["api"], launches["op_id"] = 1, np.arange(1, 41)
    launches["pid"] = launches["tid"] = 9
    sync = np.zeros(1, device_stream.DEV_EVENT)
    sync["ts_ns"], sync["api"], sync["flags"] = second + int(0.05 * second), 13, 1
    sync["duration_ns"] = int(late_s * second)
    sync["pid"] = sync["tid"] = 9
    runq = runq_records(50)
    runq["ts_ns"] = second + np.arange(50) * (second // 10)
    w = recording.RecordingWriter(tmp_path / "late.mmtr", {"cpu.runq": RUNQ_EVENT,
                                                           "dev.event": device_stream.DEV_EVENT})
    cut = int(late_s * 10) + 1          # the sync returns, and is written, this much later
    for lo in range(0, 40, 5):
        w.write_events("dev.event", launches[lo:lo + 5])
        w.write_events("cpu.runq", runq[lo:lo + 5])
        if lo + 5 >= cut and sync is not None:
            w.write_events("dev.event", sync)
            sync = None
    w.write_events("cpu.runq", runq[40:])
    w.close({})
    result = CliRunner().invoke(cli, ["export", str(tmp_path / "late.mmtr"), "--format", "jsonl",
                                      "-o", "-"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert sorted((x["kind"], x["ts_ns"]) for x in lines) == sorted(
        [("launch", int(t)) for t in launches["ts_ns"]] + [("runq", int(t)) for t in runq["ts_ns"]]
        + [("sync", second + int(0.05 * second))])
    stamps = [x["ts_ns"] for x in lines]
    if late_s < 1:
        assert stamps == sorted(stamps)
    synced = next(x for x in lines if x["kind"] == "sync")
    assert synced["op_id"] == 1         # it covers the one launch before it


def test_steps_are_as_big_as_asked_while_records_keep_coming():
    dtype = np.dtype([("ts_ns", "<u8")])
    pieces = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.uint64).view(dtype)
              for i in range(200)]
    steps = list(ordered_steps({"a": iter(pieces)}, {"a": dtype}, lag_ns=5000,
                               step_bytes=64_000))
    sizes = [s["a"].nbytes for s in steps]
    assert sum(sizes) == 200 * 8000
    assert min(sizes[:-1]) >= 64_000 and len(steps) <= 200 * 8000 // 64_000 + 1
