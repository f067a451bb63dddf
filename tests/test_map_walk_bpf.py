"""Reading the kernel's hash maps while the programs write them, on real
BPF maps: bcc reads a map a key after another (get_next_key from the last
key read), and when that key is deleted under the reader the kernel goes on
from the map's first key. What was read already comes again; each entry
must still count once. The calls in flight (agent/kernel/calls_in_flight.py:
`mmtrace_device_calls_stuck` read 2 for one hung sync while other threads
returned from their calls) and the allocations of exited processes
(bpf/device_memory.py forget_processes)."""

import ctypes as ct

import pytest

from mmtrace.agent.kernel import calls_in_flight
from mmtrace.bpf import device

pytestmark = pytest.mark.bpf

# The fields blocking_calls reads of bpf/device.h's dev_named_event.
PROGRAM = r"""
struct call { u64 ts_ns; u64 stream_handle; u32 pid; u32 tid; u32 device; u16 api;
              char comm[16]; };
BPF_HASH(calls_in_flight, u64, struct call, 64);
struct allocation_key { u32 pid; u32 pad; u64 ptr; };
BPF_HASH(allocations, struct allocation_key, u64, 64);
"""


class ReturnsWhileRead:
    """The real map, read by bcc's own lazy walk, where the second entry read
    goes (a call returns, a pointer is freed) before the walk asks for the
    next key."""

    def __init__(self, table):
        self.table = table

    def items(self):
        out = []
        for key, value in self.table.iteritems():
            out.append((type(key).from_buffer_copy(key), value))
            if len(out) == 2:
                del self.table[key]
        return out

    def keys(self):
        return [key for key, _ in self.items()]

    def __delitem__(self, key):
        del self.table[key]


@pytest.fixture
def program():
    from bcc import BPF
    bpf = BPF(text=PROGRAM)
    yield bpf
    bpf.cleanup()


@pytest.fixture
def table(program):
    return program["calls_in_flight"]


def _store(table, tid, api, ts_ns):
    leaf = table.Leaf()
    leaf.ts_ns, leaf.pid, leaf.tid, leaf.api, leaf.comm = ts_ns, 500, tid, api, b"worker"
    table[ct.c_uint64(tid << 8)] = leaf


def test_a_call_read_twice_while_another_returns_counts_once(table):
    infos = device.default_infos()
    sync = next(i for i, info in infos.items() if info.api == "aclrtSynchronizeStream")
    def two_syncs():
        for tid in (501, 502):
            _store(table, tid, sync, 1000 + tid)

    two_syncs()
    walk = ReturnsWhileRead(table).items()
    assert len(walk) == 3, "the kernel's walk did not start again from its first key"
    assert walk[0][0].value == walk[2][0].value
    two_syncs()
    calls = calls_in_flight.blocking_calls(ReturnsWhileRead(table), infos)
    assert sorted(c["tid"] for c in calls) == [501, 502]


def test_only_blocking_calls_are_read_with_their_thread_and_comm(table):
    infos = device.default_infos()
    sync = next(i for i, info in infos.items() if info.api == "aclrtSynchronizeStream")
    launch = next(i for i, info in infos.items() if info.api == "cudaLaunchKernel")
    for tid in range(600, 610):
        _store(table, tid, sync if tid % 2 else launch, tid)
    calls = calls_in_flight.blocking_calls(table, infos)
    assert sorted(c["tid"] for c in calls) == list(range(601, 610, 2))
    assert {c["comm"] for c in calls} == {"worker"}


def test_an_exited_process_allocations_each_counted_once(program):
    from mmtrace.bpf import device_memory
    table = program["allocations"]

    def allocations():
        for ptr in range(4):
            key = table.Key()
            key.pid, key.ptr = 700, 0x7000 + ptr
            table[key] = ct.c_uint64(1 << 20)

    allocations()
    assert len(ReturnsWhileRead(table).keys()) == 5     # the first key read twice
    allocations()
    assert device_memory.forget_processes(ReturnsWhileRead(table), [700]) == 4
    assert list(table.keys()) == []
