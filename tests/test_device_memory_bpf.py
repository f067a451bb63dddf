"""Allocation probes on real eBPF. The callee libraries are stand-ins built
with gcc from the public prototypes (cuda_runtime_api.h, cuda.h,
acl/acl_rt.h: tests/native/*_standin.c), whose allocations hand out
addresses from a simulated range, and NVIDIA's real libcudart.so.12 from
PyPI, which without a driver fails every call: its allocations must count
as failed, never as memory held."""

import json
import os
import subprocess
import time

import numpy as np
import pytest

from gpu_fixtures import DeviceSession, api_names, build_library, build_program, cudart_path
from test_socket_storm import wait_for

pytestmark = pytest.mark.bpf

MIB = 1 << 20


@pytest.fixture(scope="module")
def memory_natives(tmp_path_factory):
    if cudart_path() is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    out = tmp_path_factory.mktemp("memory-natives")
    standin = out / "standin"
    standin.mkdir()
    libs = [build_library("cudart_standin.c", standin, "libcudart.so.12"),
            build_library("cuda_driver_standin.c", standin, "libcuda.so.1"),
            build_library("ascendcl_standin.c", standin, "libascendcl.so")]
    calls = build_program("device_memory_calls.c", standin, libs)
    real = out / "real"
    real.mkdir()
    # Its own copies of the other stand-ins: their folder's rpath must not
    # lead to the stand-in runtime.
    others = [build_library("cuda_driver_standin.c", real, "libcuda.so.1"),
              build_library("ascendcl_standin.c", real, "libascendcl.so")]
    real_calls = build_program("device_memory_calls.c", real, [cudart_path(), *others])
    # A runtime whose allocations call the driver's, as NVIDIA's does.
    nested = out / "nested"
    nested.mkdir()
    driver = build_library("cuda_driver_standin.c", nested, "libcuda.so.1")
    nested_libs = [build_library("cudart_standin.c", nested, "libcudart.so.12",
                                 ["-DMMTRACE_STANDIN_NESTED", "-Wl,--no-as-needed", str(driver),
                                  f"-Wl,-rpath,{nested}"]),
                   driver, build_library("ascendcl_standin.c", nested, "libascendcl.so")]
    nested_calls = build_program("device_memory_calls.c", nested, nested_libs)
    return {"libs": libs, "calls": calls, "real_calls": real_calls,
            "nested_libs": nested_libs, "nested_calls": nested_calls}


@pytest.fixture(scope="module")
def session(memory_natives):
    s = DeviceSession([*memory_natives["libs"], cudart_path(),
                       *memory_natives["nested_libs"][:2]])
    yield s
    s.close()


def test_each_allocation_and_free_once_with_size_pointer_stream_and_code(
        session, memory_natives):
    from mmtrace.bpf import device_memory as dm
    out = session.run([memory_natives["calls"], "calls", 500])
    ev = session.events(out["pid"])
    ev = ev[np.isin(ev["kind"], [dm.ALLOC, dm.FREE])]
    assert api_names(ev) == ["cudaMalloc", "cudaMallocAsync", "cuMemAlloc_v2",
                             "cuMemAllocAsync", "aclrtMalloc", "cudaFree", "cudaFreeAsync",
                             "cuMemFree_v2", "cuMemFreeAsync", "aclrtFree", "cudaFree",
                             "cudaFree"]
    pointers = [out[k] for k in ("rt", "rt_async", "drv", "drv_async", "acl")]
    sizes = [1000, 2 * MIB, 3 * MIB, 4 * MIB, 5 * MIB]
    assert ev["handle"].tolist() == pointers + pointers + [1, 0x4242000]
    # A free carries what its allocation held; a refused or unknown one, nothing.
    assert ev["bytes"].tolist() == sizes + sizes + [0, 0]
    assert ev["stream_handle"].tolist() == [0, 0x5100, 0, 0x5200, 0, 0, 0x5300, 0, 0x5400,
                                            0, 0, 0]
    assert ev["ret"].tolist() == [0] * 10 + [1, 0]
    assert dm.held(ev).tolist() == [True] * 5 + [False] * 7
    assert dm.released(ev).tolist() == [False] * 5 + [True] * 5 + [False, False]
    assert (ev["flags"][-1] & dm.FLAG_FREE_UNMATCHED) != 0
    counters = dm.read_counters(session.loaded.device_table(dm.COUNTERS_MAP))
    assert counters["allocation_map_full"] == 0 and counters["free_unmatched"] >= 1
    # Every allocation was freed: the kernel keeps none of this process's.
    live = session.loaded.device_table(dm.ALLOCATIONS_MAP)
    assert [k for k in live.keys() if k.pid == out["pid"]] == []


def test_real_libcudart_without_a_driver_counts_failed_never_held(session, memory_natives):
    from mmtrace.bpf import device_memory as dm
    out = session.run([memory_natives["real_calls"], "runtime", 300])
    assert out["alloc_rc"] != 0
    ev = session.events(out["pid"])
    allocs = ev[ev["kind"] == dm.ALLOC]
    assert api_names(allocs) == ["cudaMalloc"]
    assert allocs["ret"].tolist() == [out["alloc_rc"]] and allocs["bytes"].tolist() == [4096]
    assert dm.failed_allocations(allocs).all() and not dm.held(allocs).any()
    assert allocs["handle"].tolist() == [0]


def test_a_runtime_allocation_made_through_the_driver_counts_once(session, memory_natives):
    from mmtrace.bpf import device_memory as dm
    table = session.loaded.device_table(dm.COUNTERS_MAP)
    nested_before = dm.read_counters(table)["nested_calls"]
    out = session.run([memory_natives["nested_calls"], "runtime", 300])
    assert (out["alloc_rc"], out["free_rc"]) == (0, 0)
    ev = session.events(out["pid"])
    ev = ev[np.isin(ev["kind"], [dm.ALLOC, dm.FREE])]
    assert api_names(ev) == ["cudaMalloc", "cudaFree"]     # the driver's inner calls: not again
    assert ev["bytes"].tolist() == [4096, 4096] and ev["handle"][0] == ev["handle"][1] != 0
    assert dm.read_counters(table)["nested_calls"] - nested_before == 2


def test_a_sync_that_never_returns_is_read_from_the_calls_in_flight(session, memory_natives):
    """What record writes at its end and the daemon reads every check_s."""
    from mmtrace.agent.kernel import calls_in_flight
    from mmtrace.bpf import device
    table = session.loaded.device_table(calls_in_flight.MAP)
    infos = device.default_infos()
    proc = subprocess.Popen([str(memory_natives["calls"]), "npu_hang", "60000"],
                            stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, MMTRACE_STANDIN_SYNC_FOREVER="1"))
    try:
        pid = json.loads(proc.stdout.readline())["pid"]
        mine = lambda: [c for c in calls_in_flight.blocking_calls(table, infos)  # noqa: E731
                        if c["pid"] == pid]
        (call,) = wait_for(mine, 10, "the sync in the calls in flight")
        assert (call["api"], call["stream"], call["stream_handle"], call["device"]) == (
            "aclrtSynchronizeStream", "npu", 0x7700, 1)
        assert call["tid"] != pid and call["comm"] == "device_memory_c"
        assert 0 < time.monotonic_ns() - call["ts_ns"] < 10e9
    finally:
        proc.kill()
        proc.wait()
    # The thread is freed: its call leaves the map (sched_process_free).
    wait_for(lambda: not mine(), 10, "the freed thread's call to leave the map")
