"""The device stream's rings read as one (agent/kernel/device_ring.py):
the kernel's 144-byte call records widened into the recorded layout, each
with its thread's comm; the named records among them by time; the thread
records consumed. No eBPF: the rings are stood in for."""

import numpy as np
import pytest

from mmtrace.agent.kernel import device_ring
from mmtrace.agent.kernel.device_ring import DeviceRing, ThreadComms, copy_runs, widen
from mmtrace.bpf import device


class FakeRing:
    """A RingReader's read(): the batches given, one per call."""

    def __init__(self, dtype, batches=()):
        self.dtype = np.dtype(dtype)
        self.batches = list(batches)
        self.closed = False
        self.reads = 0

    def read(self, max_records=None):
        self.reads += 1
        return self.batches.pop(0) if self.batches else np.zeros(0, self.dtype)

    def fileno(self):
        return -1

    def pending_bytes(self):
        return sum(b.nbytes for b in self.batches)

    def close(self):
        self.closed = True


def calls(ts, tid=7, pid=5):
    out = np.zeros(len(ts), device.DEV_RECORD)
    out["ts_ns"] = ts
    out["tid"] = tid
    out["pid"] = pid
    out["kind"] = device.KIND_IDS["launch"]
    return out


def named(ts, kind, tid=7, pid=5, comm=b"", name=b""):
    out = np.zeros(len(ts), device.DEV_NAMED)
    out["ts_ns"] = ts
    out["tid"] = tid
    out["pid"] = pid
    out["kind"] = device.KIND_IDS[kind]
    out["comm"] = comm
    out["name"] = name
    return out


def test_records_are_the_recorded_layout_less_what_only_names_carry():
    assert device.DEV_RECORD.itemsize == 144 and device.DEV_NAMED.itemsize == 240
    assert set(device.DEV_EVENT.names) - set(device.DEV_RECORD.names) == {
        "name_addr", "alias", "comm", "name"}
    assert set(device.DEV_NAMED.names) == set(device.DEV_EVENT.names)
    # Two block copies widen a record: the fields before name_addr, and after alias.
    assert copy_runs(device.DEV_RECORD, device.DEV_EVENT) == [(0, 72, 0), (72, 144, 88)]


def test_widening_keeps_every_field_of_every_record():
    rng = np.random.default_rng(1)
    raw = rng.integers(0, 256, (50, device.DEV_RECORD.itemsize), dtype=np.uint8)
    records = raw.view(device.DEV_RECORD).reshape(-1)
    wide = widen(records)
    assert wide.dtype == device.DEV_EVENT
    for name in device.DEV_RECORD.names:
        assert np.array_equal(wide[name], records[name]), name
    for name in ("name_addr", "alias", "comm", "name"):
        assert not wide[name].any(), name


def test_each_call_gets_its_threads_comm_and_thread_records_are_consumed():
    events = FakeRing(device.DEV_RECORD, [calls([10, 20]), calls([30, 40], tid=8)])
    names = FakeRing(device.DEV_NAMED, [named([5], "thread", comm=b"decode"),
                                        named([25], "thread", tid=8, comm=b"vision")])
    ring = DeviceRing(events, names, ThreadComms(proc_root="/nonexistent"))
    first = ring.read()
    assert first.dtype == device.DEV_EVENT
    assert first["comm"].tolist() == [b"decode", b"decode"]
    assert set(first["kind"].tolist()) == {device.KIND_IDS["launch"]}
    second = ring.read()
    assert second["comm"].tolist() == [b"vision", b"vision"]
    assert (ring.records_read, ring.batches) == (4, 2)
    reads = events.reads + names.reads
    empty = ring.read()
    assert len(empty) == 0 and empty.dtype == device.DEV_EVENT
    # Nothing pending: no ring is read, nothing is decoded (a quiet daemon's wake).
    assert events.reads + names.reads == reads and (ring.records_read, ring.batches) == (4, 2)
    ring.close()
    assert events.closed and names.closed


def test_a_new_threads_comm_committed_after_the_names_were_read_still_names_its_calls():
    """The kernel commits a thread's comm record before its first event; the
    reader takes the names ring, then the events ring. A record committed in
    between is read again before the events are named: the thread may have
    exited by then, with no /proc to fall back on."""
    events = FakeRing(device.DEV_RECORD, [calls([10, 20])])
    names = FakeRing(device.DEV_NAMED, [named([], "thread"),
                                        named([5], "thread", comm=b"short_lived")])
    ring = DeviceRing(events, names, ThreadComms(proc_root="/nonexistent"))
    batch = ring.read()
    assert batch["comm"].tolist() == [b"short_lived", b"short_lived"]
    assert ring.comms.counters["comm_unknown"] == 0
    # Threads already known cost no second read.
    events.batches.append(calls([30]))
    reads = names.reads
    assert ring.read()["comm"].tolist() == [b"short_lived"] and names.reads == reads + 1


def test_a_rename_applies_from_its_record_on():
    comms = ThreadComms(proc_root="/nonexistent")
    comms.learn(named([1], "thread", comm=b"python3"))
    comms.learn(named([3], "thread", comm=b"pt_main_thread"))
    batch = widen(calls([4, 5]))
    comms.fill(batch)
    assert batch["comm"].tolist() == [b"pt_main_thread"] * 2


def test_calls_read_with_a_rename_keep_the_comm_they_were_made_under():
    # One drain holds a thread's calls before and after two renames (an
    # exec, a prctl): each call has the comm in force at its time.
    events = FakeRing(device.DEV_RECORD, [calls([10, 20]), calls([30, 40, 50, 60])])
    names = FakeRing(device.DEV_NAMED, [named([5], "thread", comm=b"python"),
                                        named([35, 55], "thread", comm=b"x")])
    names.batches[1]["comm"] = [b"trainer", b"pt_main"]
    ring = DeviceRing(events, names, ThreadComms(proc_root="/nonexistent"))
    assert ring.read()["comm"].tolist() == [b"python"] * 2
    assert ring.read()["comm"].tolist() == [b"python", b"trainer", b"trainer", b"pt_main"]


def test_a_thread_whose_comm_never_came_is_read_from_proc_once(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "comm").write_bytes(b"a-very-long-thread-name\n")
    comms = ThreadComms(proc_root=tmp_path)
    batch = widen(np.concatenate([calls([1, 2], tid=42), calls([3], tid=43)]))
    comms.fill(batch)
    comms.fill(batch)
    assert batch["comm"].tolist() == [b"a-very-long-thr"] * 2 + [b""]
    assert (comms.counters["comm_from_proc"], comms.counters["comm_unknown"]) == (1, 1)


def test_the_comm_table_stays_bounded():
    comms = ThreadComms(proc_root="/nonexistent", max_threads=100)
    threads = named(np.arange(1000), "thread", comm=b"t")
    threads["tid"] = np.arange(1000)
    comms.learn(threads)
    assert len(comms._comm) == 100
    assert comms.get(999) == b"t" and comms.get(0) == b""


def test_named_records_come_among_the_calls_in_time_order():
    events = FakeRing(device.DEV_RECORD, [calls([10, 20, 30, 40])])
    names = FakeRing(device.DEV_NAMED, [np.concatenate([
        named([35], "launch", name=b"Add"), named([1], "thread", comm=b"npu"),
        named([15], "function_name", name=b"vector_add")])])
    batch = DeviceRing(events, names, ThreadComms(proc_root="/nonexistent")).read()
    assert batch["ts_ns"].tolist() == [10, 15, 20, 30, 35, 40]
    assert batch["name"].tolist() == [b"", b"vector_add", b"", b"", b"Add", b""]
    assert batch["comm"].tolist()[0] == b"npu"
    # a named record keeps the comm it carries
    assert batch["comm"].tolist()[1] == b""


def test_rings_of_other_layouts_are_refused():
    with pytest.raises(TypeError):
        DeviceRing(FakeRing(device.DEV_EVENT), FakeRing(device.DEV_NAMED))
    with pytest.raises(TypeError, match="DEV_LAUNCH"):
        DeviceRing(FakeRing(device.DEV_RECORD), FakeRing(device.DEV_NAMED),
                   launches=FakeRing(device.DEV_RECORD))
    assert device_ring.THREAD == 8


def compact(ts, op_low, handle=0xA0, ret=0x400, tid=7):
    out = np.zeros(len(ts), device.DEV_LAUNCH)
    out["ts_ns"] = ts
    out["op_id"] = op_low
    out["handle"] = handle
    out["return_ip"] = ret
    out["tid"] = tid
    out["device"] = -1
    out["grid_x"] = 64
    return out


CUDA_LAUNCH_KERNEL = next(api.id for api in device.default_table().apis
                          if api.symbol == "cudaLaunchKernel")


def whole_launch(ts, op_id, handle=0xA0, ret=0x400, outer=0x900, tid=7, pid=5,
                 api=CUDA_LAUNCH_KERNEL):
    out = calls(ts, tid=tid, pid=pid)
    out["api"] = api
    out["op_id"] = op_id
    out["handle"] = handle
    out["return_ip"] = ret
    out["outer_return_ip"] = outer
    out["direction"] = device.NO_DIRECTION
    out["device"] = -1
    out["grid_x"] = 64
    return out


def test_compact_launches_read_back_with_what_their_thread_and_call_site_said():
    # The thread record gives the pid, the whole launch the call site's
    # outer caller and the process's op ids; compact launches among them
    # come back in time order, widened.
    assert device.DEV_LAUNCH.itemsize == 64
    events = FakeRing(device.DEV_RECORD, [whole_launch([10], 1)])
    names = FakeRing(device.DEV_NAMED, [named([5], "thread", comm=b"decode")])
    launches = FakeRing(device.DEV_LAUNCH, [compact([20, 15, 30], [2, 3, 4])])
    batch = DeviceRing(events, names, ThreadComms(proc_root="/nonexistent"),
                       launches=launches).read()
    assert batch["ts_ns"].tolist() == [10, 15, 20, 30]
    assert batch["op_id"].tolist() == [1, 3, 2, 4]
    assert set(batch["pid"].tolist()) == {5} and set(batch["comm"].tolist()) == {b"decode"}
    assert set(batch["outer_return_ip"].tolist()) == {0x900}
    assert set(batch["kind"].tolist()) == {device.KIND_IDS["launch"]}
    assert set(batch["direction"].tolist()) == {device.NO_DIRECTION}
    assert set(batch["device"].tolist()) == {-1} and set(batch["grid_x"].tolist()) == {64}


def test_op_ids_past_two_to_the_32_keep_counting():
    from mmtrace.agent.kernel.launch_records import LaunchFacts
    facts = LaunchFacts()
    start = (1 << 32) - 2
    facts.learn(widen(whole_launch([1], start)))
    low = np.arange(start + 1, start + 5, dtype=np.uint64) % (1 << 32)
    wide = facts.widen(compact([2, 3, 4, 5], low), np.full(4, 5, np.uint32))
    assert wide["op_id"].tolist() == list(range(start + 1, start + 5))
    # the next batch goes on from there
    wide = facts.widen(compact([6], [3]), np.full(1, 5, np.uint32))
    assert wide["op_id"].tolist() == [(1 << 32) + 3]


def test_a_handle_launched_from_two_call_sites_gets_each_sites_outer_caller():
    from mmtrace.agent.kernel.launch_records import LaunchFacts
    facts = LaunchFacts()
    facts.learn(widen(np.concatenate([whole_launch([1], 1, ret=0x400, outer=0x900),
                                      whole_launch([2], 2, ret=0x500, outer=0x990)])))
    rows = compact([3, 4, 5], [3, 4, 5], ret=0x400)
    rows["return_ip"][1] = 0x500
    rows["return_ip"][2] = 0x600             # a site never sent whole
    wide = facts.widen(rows, np.full(3, 5, np.uint32))
    assert wide["outer_return_ip"].tolist() == [0x900, 0x990, 0]
    assert facts.counters["outer_caller_unknown"] == 1


def test_only_launches_that_read_their_callers_teach_call_sites():
    # An aclnn op's launch is timed now and then, and then carries a return
    # address; its handle is an executor made for each call. Those sites no
    # compact launch asks for, and they are not kept (they grew the table by
    # about 400 a minute in the soak).
    from mmtrace.agent.kernel.launch_records import LaunchFacts
    aclnn = next(api for api in device.default_table().apis if api.stream == "npu"
                 and api.kind == "launch")
    assert not aclnn.reads_callers
    facts = LaunchFacts()
    n = 500
    facts.learn(widen(whole_launch(np.arange(n), np.arange(1, n + 1),
                                   handle=np.arange(0x1000, 0x1000 + n), api=aclnn.id)))
    assert facts.known_sites == 0
    facts.learn(widen(whole_launch([n + 1], n + 1)))
    assert facts.known_sites == 1


def test_a_compact_launch_whose_thread_record_was_missed_takes_its_pid_from_proc(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text("Name:\tx\nTgid:\t40\nPid:\t42\n")
    comms = ThreadComms(proc_root=tmp_path)
    assert comms.pids(np.array([42, 42, 43], np.uint32)).tolist() == [40, 40, 0]
    assert (comms.counters["pid_from_proc"], comms.counters["pid_unknown"]) == (1, 1)
