"""Alignment of the GPU/NPU stream with syncs and with the CPU stream.

Unit tests pin the retirement rules on hand-made events; a property test
checks that the bounded live ring (Aligner) agrees with aligning all at
once; the eBPF test runs a launching thread under forced CPU contention
against the real libcudart and checks each launch's sched_delay_ns against
the run-queue delays the CPU stream recorded for that thread."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_fixtures import DeviceSession, natives  # noqa: F401
from mmtrace.agent.ingest.align import ALIGNED_EVENT, NONE, Aligner, ApiRoles, align
from mmtrace.bpf import device

INFOS = device.default_infos()
ROLES = ApiRoles.from_infos(INFOS)
API = {info.symbol: api_id for api_id, info in INFOS.items()}
RETURNED = device.FLAG_RETURNED


def events(*rows):
    """rows: (ts, symbol, op_id, stream, duration or None, handle, pid)"""
    out = np.zeros(len(rows), device.DEV_EVENT)
    for i, row in enumerate(rows):
        ts, symbol, op_id, stream, duration, handle, pid = (
            tuple(row) + (None, 0, 1)[len(row) - 4:])
        out[i]["ts_ns"] = ts
        out[i]["api"] = API[symbol]
        out[i]["op_id"] = op_id
        out[i]["stream_handle"] = stream
        out[i]["handle"] = handle
        out[i]["pid"] = pid
        if duration is not None:
            out[i]["duration_ns"] = duration
            out[i]["flags"] = RETURNED
    return out


def test_stream_sync_retires_exactly_the_earlier_submissions_on_its_stream():
    ev = events((100, "cudaLaunchKernel", 1, 5), (110, "cudaLaunchKernel", 2, 6),
                (120, "cudaMemcpyAsync", 3, 5), (130, "cudaStreamSynchronize", 0, 5, 40),
                (140, "cudaLaunchKernel", 4, 5), (300, "cudaStreamSynchronize", 0, 6, 5))
    out = align(ev, ROLES)
    assert out["retired_ns"].tolist() == [170, 305, 170, NONE, NONE, NONE]
    assert out["op_id"].tolist() == [1, 2, 3, 3, 4, 2]


def test_device_sync_retires_every_stream_of_its_process_only():
    ev = events((100, "cuLaunchKernel", 1, 5), (110, "cuLaunchKernel", 2, 6),
                (115, "cuLaunchKernel", 1, 5, None, 0, 2),      # another process
                (120, "cuCtxSynchronize", 0, 0, 30), (200, "cuLaunchKernel", 3, 6))
    out = align(ev, ROLES)
    assert out["retired_ns"].tolist() == [150, 150, NONE, NONE, NONE]
    assert out["op_id"][3] == 2


def test_the_first_covering_sync_to_return_sets_retired_ns():
    ev = events((100, "aclnn", 1, 7), (150, "aclrtSynchronizeStream", 0, 7, 50),
                (160, "aclrtSynchronizeDevice", 0, 0, 10))
    out = align(ev, ROLES)
    assert out["retired_ns"][0] == 170      # the device sync returned first
    assert out["op_id"][1:].tolist() == [1, 1]


def test_event_sync_retires_what_came_before_its_record_on_the_record_stream():
    ev = events((100, "cudaLaunchKernel", 1, 9), (110, "cudaEventRecord", 0, 9, None, 0xe1),
                (120, "cudaLaunchKernel", 2, 9),
                (130, "cudaEventSynchronize", 0, 0, 20, 0xe1),
                (140, "cudaEventSynchronize", 0, 0, 20, 0xe2))      # never recorded
    out = align(ev, ROLES)
    assert out["retired_ns"].tolist()[:3] == [150, NONE, NONE]
    assert out["stream_handle"][3] == 9 and out["op_id"][3] == 1
    assert out["flags"][3] & 16 and not out["flags"][4] & 16
    assert out["op_id"][4] == 0


def test_blocking_calls_are_retired_when_they_return():
    ev = events((100, "cudaMemcpy", 1, 0, 25), (200, "aclmdlExecute", 1, 0, 75, 7, 2))
    assert align(ev, ROLES)["retired_ns"].tolist() == [125, 275]


def test_unknown_api_ids_play_no_part():
    ev = events((100, "cudaLaunchKernel", 1, 5), (130, "cudaStreamSynchronize", 0, 5, 40))
    ev[1]["api"] = 999
    assert align(ev, ROLES)["retired_ns"].tolist() == [NONE, NONE]


def test_aligner_retires_submissions_of_earlier_batches():
    aligner = Aligner(ROLES, capacity=16)
    aligner.push(events((100, "cuLaunchKernel", 1, 5), (110, "cuLaunchKernel", 2, 5)))
    sync = aligner.push(events((120, "cuStreamSynchronize", 0, 5, 10)))
    assert sync["op_id"].tolist() == [2]
    assert aligner.window()["retired_ns"].tolist() == [130, 130, NONE]
    # what that push retired, for the submit-to-retire series
    assert aligner.last_retired["op_id"].tolist() == [1, 2]
    assert aligner.last_retired["retired_ns"].tolist() == [130, 130]
    aligner.push(events((200, "cudaMemcpy", 3, 0, 25), (210, "cuLaunchKernel", 4, 5)))
    assert aligner.last_retired["op_id"].tolist() == [3]     # blocking: its own return


def test_aligner_is_bounded_by_count_and_by_age():
    aligner = Aligner(ROLES, capacity=4, max_age_ns=1_000)
    for i in range(10):
        aligner.push(events((100 + i, "cuLaunchKernel", i + 1, 5)))
    assert len(aligner) == 4 and aligner.evicted == 6
    assert aligner.window()["op_id"].tolist() == [7, 8, 9, 10]
    aligner.push(events((5_000, "cuLaunchKernel", 11, 5)))
    assert aligner.window()["op_id"].tolist() == [11]
    assert aligner.evicted == 10
    assert aligner._ring.nbytes == 4 * ALIGNED_EVENT.itemsize    # fixed at creation


@st.composite
def workloads(draw):
    """Time-ordered events of two processes on three streams, op_ids in
    submission order per process, cut into arrival batches."""
    n = draw(st.integers(1, 60))
    kinds = draw(st.lists(st.sampled_from(
        ["cuLaunchKernel", "cuLaunchKernel", "cuMemcpyAsync", "cuStreamSynchronize",
         "cuCtxSynchronize", "cudaEventRecord", "cudaEventSynchronize"]), min_size=n, max_size=n))
    rows, next_op = [], {1: 1, 2: 1}
    for i, kind in enumerate(kinds):
        pid = draw(st.sampled_from([1, 2]))
        stream = draw(st.sampled_from([0, 5, 6]))
        ts = 1_000 + 10 * i
        op = 0
        if kind in ("cuLaunchKernel", "cuMemcpyAsync"):
            op, next_op[pid] = next_op[pid], next_op[pid] + 1
        # Syncs arrive when they return: shorter than the spacing keeps
        # arrival order the time order the batches are cut in.
        duration = draw(st.integers(1, 9)) if "Synchronize" in kind else None
        rows.append((ts, kind, op, stream, duration, draw(st.sampled_from([0xe1, 0xe2])), pid))
    cuts = sorted(set(draw(st.lists(st.integers(1, n), max_size=6))))
    return events(*rows), cuts


@settings(max_examples=200, deadline=None)
@given(workloads())
def test_aligner_agrees_with_aligning_everything_at_once(work):
    ev, cuts = work
    whole = align(ev, ROLES)
    aligner = Aligner(ROLES, capacity=1024)
    pushed = [aligner.push(part) for part in np.split(ev, cuts) if len(part)]
    live = np.concatenate(pushed)
    assert live["op_id"].tolist() == whole["op_id"].tolist()
    assert live["stream_handle"].tolist() == whole["stream_handle"].tolist()
    assert aligner.window()["retired_ns"].tolist() == whole["retired_ns"].tolist()


@pytest.mark.bpf
def test_contended_launches_carry_the_cpu_streams_delays_and_syncs_retire_them(natives):
    rounds, hog_ms, sync_every = 24, 5, 4
    cpu = max(0, len(__import__("os").sched_getaffinity(0)) - 1)
    session = DeviceSession([natives.cudart])
    try:
        out = session.run([natives.contended_launch, rounds, hog_ms, cpu, sync_every])
        session.drain()
        ev = session.events(out["pid"])
        runq = session.runq()
    finally:
        session.close()
    tid = out["launcher_tid"]
    mine = runq[runq["tid"] == tid]
    names = [INFOS[int(a)].symbol for a in ev["api"]]
    launches = ev[[n == "cudaLaunchKernel" for n in names]]
    syncs = ev[[n == "cudaStreamSynchronize" for n in names]]
    assert launches["grid_x"].tolist() == list(range(1, rounds + 2))
    assert len(syncs) == rounds // sync_every
    # Each launch carries the delay of its thread's latest switch-in before it.
    latest = np.searchsorted(mine["ts_ns"], launches["ts_ns"], side="right") - 1
    assert (latest >= 0).all()
    assert launches["sched_delay_ns"].tolist() == mine["delay_ns"][latest].tolist()
    # ...and that wait was the hog's spin: the contention really happened.
    assert np.median(launches["sched_delay_ns"][:rounds]) > 0.8 * hog_ms * 1e6
    # Each sync retires exactly the launches since the previous one.
    # (No driver here: every call failed, and failed calls align with
    # nothing. Their codes cleared, the same events are what a host with
    # a driver records.)
    assert set(ev["ret"].tolist()) == {35}
    ev["ret"] = 0
    aligned = align(ev, ROLES)
    aligned_launches = aligned[[n == "cudaLaunchKernel" for n in names]]
    ends = (syncs["ts_ns"] + syncs["duration_ns"]).astype(np.int64)
    expected = [int(ends[(i - 1) // sync_every]) for i in range(1, rounds + 1)] + [NONE]
    assert aligned_launches["retired_ns"].tolist() == expected
    sync_ops = aligned[[n == "cudaStreamSynchronize" for n in names]]["op_id"]
    assert sync_ops.tolist() == [int(launches["op_id"][k * sync_every - 1])
                                 for k in range(1, len(syncs) + 1)]
