"""The GPU stream on real eBPF: NVIDIA's real libcudart.so.12 (no driver
here: every call returns an error, the probes still see its arguments) and
a stand-in libcuda.so.1 built from the exact CUDA 12 prototypes. Each call
must arrive exactly once with every field decoded; names, losses and the
adaptive per-launch mode are checked through the real loader and ring."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from gpu_fixtures import (DeviceSession, api_names, build_program, natives,  # noqa: F401
                          run_json)

pytestmark = pytest.mark.bpf

CUDA_ERROR_INSUFFICIENT_DRIVER = 35
NO_DIRECTION = 0xFF


def fields(ev) -> dict:
    keys = ("op_id", "handle", "stream_handle", "bytes", "shared_mem_bytes", "direction",
            "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z")
    return {k: int(ev[k]) for k in keys}


def launch(op_id, handle, stream, grid, block, smem):
    return {"op_id": op_id, "handle": handle, "stream_handle": stream, "bytes": 0,
            "shared_mem_bytes": smem, "direction": NO_DIRECTION,
            "grid_x": grid[0], "grid_y": grid[1], "grid_z": grid[2],
            "block_x": block[0], "block_y": block[1], "block_z": block[2]}


def plain(op_id=0, handle=0, stream=0, nbytes=0, direction=NO_DIRECTION):
    return {"op_id": op_id, "handle": handle, "stream_handle": stream, "bytes": nbytes,
            "shared_mem_bytes": 0, "direction": direction, "grid_x": 0, "grid_y": 0,
            "grid_z": 0, "block_x": 0, "block_y": 0, "block_z": 0}


@pytest.fixture(scope="module")
def cudart_session(natives):
    session = DeviceSession([natives.cudart])
    yield session
    session.close()


def test_real_cudart_each_call_once_with_every_field(cudart_session, natives):
    states = {(s.symbol, s.point): s.state for s in cudart_session.states}
    for symbol in ("cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
                   "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize"):
        assert states[(symbol, "entry")] == "attached", symbol
    before = cudart_session.counters()
    out = cudart_session.run([natives.cudart_calls, 1000])
    ev = cudart_session.events(out["pid"])
    assert api_names(ev) == [
        "cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC", "cudaGraphLaunch",
        *["cudaMemcpyAsync"] * 5, "cudaMemcpy", "cudaStreamSynchronize"]
    expected = [
        launch(1, out["vector_add"], 0x1234, (3, 4, 5), (6, 7, 8), 1024),
        launch(2, out["softmax"], 0x2345, (9, 10, 11), (12, 13, 14), 2048),
        launch(3, out["gelu"], 0x3456, (15, 16, 17), (18, 19, 20), 4096),
        plain(4, handle=0x4567, stream=0x5678),
        *[plain(5 + k, stream=0x6000 + k, nbytes=100 + k, direction=k) for k in range(5)],
        plain(10, nbytes=777, direction=1),
        plain(0, stream=0x3456),
    ]
    assert [fields(e) for e in ev] == expected
    assert set(ev["pid"].tolist()) == {out["pid"]} and set(ev["tid"].tolist()) == {out["pid"]}
    assert set(ev["comm"].tolist()) == {b"cudart_calls"}
    assert set(ev["device"].tolist()) == {-1}       # cudaSetDevice never succeeded
    # Every call's return code: copies, graph launches and syncs by a
    # uretprobe; launches by a uprobe session, the first of a process
    # always, and each one after while its calls fail (all do, no driver).
    timed = (ev["flags"] & 1) != 0
    assert timed.all()
    assert ev["ret"].tolist() == [CUDA_ERROR_INSUFFICIENT_DRIVER] * len(ev)
    assert (ev["duration_ns"] > 0).all()
    assert (np.diff(ev["ts_ns"].astype(np.int64)) > 0).all()
    # Kernel names from the host stubs, demangled, while the process lived.
    names = {addr: name for pid, addr, name in cudart_session.op_names if pid == out["pid"]}
    assert names == {out["vector_add"]: "vector_add(float const*, float const*, float*, int)",
                     out["softmax"]: "kernel::softmax(float*, int)",
                     out["gelu"]: "gelu(float*)"}
    after = cudart_session.counters()
    for loss in ("ringbuf_full_dev", "call_map_full", "user_read_failed",
                 "return_without_entry", "call_abandoned"):
        assert after[loss] == before[loss], loss


@pytest.fixture(scope="module")
def driver_session(natives):
    session = DeviceSession([natives.driver])
    yield session
    session.close()


def test_driver_standin_exact_with_function_names(driver_session, natives):
    from mmtrace.agent.recording.device_view import decode
    before = driver_session.counters()
    out = run_json([natives.driver_calls])
    driver_session.drain()
    ev = driver_session.events(out["pid"])
    assert api_names(ev) == [
        "cuModuleGetFunction", "cuModuleGetFunction", "cuLaunchKernel", "cuLaunchKernel_ptsz",
        "cuLaunchKernelEx", "cuLaunchCooperativeKernel", "cuGraphLaunch",
        "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyAsync",
        "cuStreamSynchronize", "cuCtxSynchronize"]
    add, norm = out["add"], out["norm"]
    assert [fields(e) for e in ev[2:]] == [
        launch(1, add, 0x7001, (21, 22, 23), (24, 25, 26), 512),
        launch(2, norm, 0x7002, (31, 32, 33), (34, 35, 36), 768),
        launch(3, add, 0x7003, (41, 42, 43), (44, 45, 46), 1536),
        launch(4, norm, 0x7001, (51, 52, 53), (54, 55, 56), 256),
        plain(5, handle=0x8001, stream=0x7001),
        plain(6, stream=0x7001, nbytes=4096, direction=1),
        plain(7, stream=0x7002, nbytes=8192, direction=2),
        plain(8, stream=0x7003, nbytes=16384, direction=4),
        plain(0, stream=0x7001),
        plain(0),
    ]
    assert ev["handle"][:2].tolist() == [add, norm]
    assert ev["name"][0] == b"triton_poi_fused_add_0"
    long_name = ("triton_red_fused_native_layer_norm_backward_per_row_reduction_kernel_"
                 "0123456789")
    assert ev["name"][1] == long_name[:63].encode()
    assert ev["flags"][1] & 2            # DEV_NAME_TRUNCATED
    # The stand-in's syncs sleep 2 ms and 3 ms.
    assert ev["duration_ns"][-2] >= 2_000_000 and ev["duration_ns"][-1] >= 3_000_000
    after = driver_session.counters()
    assert after["name_truncated"] - before["name_truncated"] == 1
    rows = decode(ev, driver_session.context())
    assert rows.op_name[rows.kind == "launch"].tolist() == [
        "triton_poi_fused_add_0", long_name[:63] + "\u2026",
        "triton_poi_fused_add_0", long_name[:63] + "\u2026"]
    assert rows.api.tolist()[:4] == ["cuLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                     "cuLaunchCooperativeKernel"]


def test_process_killed_inside_a_call_is_counted(driver_session, natives):
    before = driver_session.counters()
    proc = subprocess.Popen([str(natives.driver_calls), "hang"], stdout=subprocess.PIPE,
                            text=True)
    out = json.loads(proc.stdout.readline())
    time.sleep(0.2)     # inside cuStreamSynchronize(0xdead) now
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if driver_session.counters()["call_abandoned"] > before["call_abandoned"]:
            break
        time.sleep(0.05)
    driver_session.drain()
    after = driver_session.counters()
    assert after["call_abandoned"] - before["call_abandoned"] == 1
    assert after["return_without_entry"] == before["return_without_entry"]
    ev = driver_session.events(out["pid"])
    # Every call that returned is there once; the abandoned one is not.
    assert api_names(ev).count("cuStreamSynchronize") == 1
    assert len(ev) == 12
    assert len(driver_session.loaded.bpf["calls_in_flight"].items()) == 0


def test_library_replaced_on_disk(natives, tmp_path):
    from mmtrace.agent.kernel.device_probes import DeviceProbes
    from mmtrace.agent.kernel.probed_file import target_from_path
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    lib = lib_dir / "libcuda.so.1"
    shutil.copy(natives.driver, lib)
    caller = build_program("cuda_driver_calls.c", tmp_path, [lib])
    session = DeviceSession([lib])
    try:
        first = target_from_path(str(lib))
        # Replace the file the way package managers do: a new inode renamed over it.
        fresh = lib_dir / ".libcuda.so.1.new"
        shutil.copy(natives.driver, fresh)
        os.rename(fresh, lib)
        # A target found before the replacement no longer matches the path.
        stale = session.device.add(type(first)(first.path, first.dev, first.inode + 10**9))
        assert stale and stale[-1].state == "failed"
        assert "replaced on disk" in stale[-1].reason
        out = run_json([caller])
        session.drain()
        assert len(session.events(out["pid"])) == 0     # the new inode is not probed yet
        added = session.device.add_path(str(lib))
        assert any(s.state == "attached" for s in added)
        out = run_json([caller])
        session.drain()
        assert len(session.events(out["pid"])) == 12
        summary = session.device.summary()
        assert summary["libraries"] == 2 and summary["library_failures"] == 1
        assert isinstance(session.device, DeviceProbes)
    finally:
        session.close()


def test_adaptive_mode_detaches_only_per_launch_probes(natives):
    session = DeviceSession([natives.cudart])
    loop = subprocess.Popen([str(natives.launch_loop)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        pid = int(loop.stdout.readline().split()[1])

        def phase(n=50):
            session.drain(0)
            start = len(session.events(pid))
            loop.stdin.write(f"run {n}\n")
            loop.stdin.flush()
            assert loop.stdout.readline().startswith("done")
            session.drain()
            names = api_names(session.events(pid)[start:])
            return {api: names.count(api) for api in
                    ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize")}

        everything = {"cudaLaunchKernel": 50, "cudaMemcpyAsync": 50, "cudaStreamSynchronize": 50}
        assert phase() == everything
        session.device.detach_launches()
        assert not session.device.launches_attached
        assert phase() == {**everything, "cudaLaunchKernel": 0}
        states = {(s["symbol"], s["point"]): s for s in session.device.states()}
        assert states[("cudaLaunchKernel", "entry")]["state"] == "detached"
        assert states[("cudaMemcpyAsync", "entry")]["state"] == "attached"
        # A window long beside one phase (milliseconds), then seen to end
        # on its own: launches off again, not sooner than the window.
        opened = time.monotonic()
        session.device.attach_launches(duration_s=3.0)
        assert phase() == everything
        def launch_probe_state():       # states() waits for a detach under way
            return {(s["symbol"], s["point"]): s["state"]
                    for s in session.device.states()}[("cudaLaunchKernel", "entry")]
        while session.device.launches_attached or launch_probe_state() != "detached":
            assert time.monotonic() - opened < 60, "the launch window never ended"
            time.sleep(0.05)
        assert time.monotonic() - opened >= 3.0
        assert phase() == {**everything, "cudaLaunchKernel": 0}
        # op_ids stay one sequence per process across the switches.
        ops = session.events(pid)["op_id"]
        ops = ops[ops > 0]
        assert (np.diff(ops.astype(np.int64)) == 1).all()
    finally:
        loop.stdin.close()
        loop.wait(timeout=10)
        session.close()


def test_record_and_export_jsonl_end_to_end(natives, tmp_path, mmtrace_cli):
    from mmtrace.exporters.files.jsonl import KEYS
    path = tmp_path / "gpu.mmtr"
    rec = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o", str(path),
                            "--lib", str(natives.cudart), "--lib", str(natives.driver)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The streams going live come first, and any warning about the
        # host's other processes (one that exits while it is looked at);
        # the first progress line comes once every stream is attached.
        seen = [rec.stdout.readline()]
        while seen[-1] and not seen[-1].startswith("recording "):
            seen.append(rec.stdout.readline())
        assert seen[-1].startswith("recording "), seen
        runtime = run_json([natives.cudart_calls, 300])
        driver = run_json([natives.driver_calls])
        time.sleep(0.3)
    finally:
        rec.send_signal(signal.SIGINT)
        rec.communicate(timeout=60)
    assert rec.returncode == 0
    export = mmtrace_cli("export", path, "--format", "jsonl", "-o", "-")
    assert export.returncode == 0, export.stderr
    lines = [json.loads(line) for line in export.stdout.splitlines()]
    assert all(list(obj) == list(KEYS) for obj in lines)
    gpu = [obj for obj in lines if obj["stream"] == "gpu"]
    mine = [obj for obj in gpu if obj["pid"] == runtime["pid"]]
    assert [(o["kind"], o["api"]) for o in mine] == [
        ("launch", "cudaLaunchKernel"), ("launch", "cudaLaunchKernel"),
        ("launch", "cudaLaunchKernelExC"), ("graph_launch", "cudaGraphLaunch"),
        *[("memcpy", "cudaMemcpyAsync")] * 5, ("memcpy", "cudaMemcpy"),
        ("sync", "cudaStreamSynchronize")]
    first = mine[0]
    assert first["op_name"] == "vector_add(float const*, float const*, float*, int)"
    assert (first["grid"], first["block"], first["shared_mem_bytes"]) == ([3, 4, 5], [6, 7, 8],
                                                                          1024)
    assert (first["handle"], first["stream_handle"], first["op_id"]) == (
        runtime["vector_add"], 0x1234, 1)
    # No driver: every runtime call failed, and says so (its return was probed).
    assert first["duration_ns"] > 0 and first["bytes"] is None
    assert {o["ret"] for o in mine} == {CUDA_ERROR_INSUFFICIENT_DRIVER}
    assert isinstance(first["sched_delay_ns"], int) and first["device"] is None
    assert [o["direction"] for o in mine[4:10]] == ["h2h", "h2d", "d2h", "d2d", "default",
                                                    "h2d"]
    sync = mine[-1]
    assert sync["stream_handle"] == 0x3456 and sync["duration_ns"] > 0
    # The runtime's submissions failed: nothing was queued, nothing retires
    # (its sync failed too, and covered nothing).
    assert sync["op_id"] is None
    assert [o["retired_ns"] for o in mine] == [None] * len(mine)
    # The stand-in driver's calls succeed: its stream sync retires what its
    # stream 0x7001 had queued, up to the copy; the device sync the rest.
    drv = [o for o in gpu if o["pid"] == driver["pid"]]
    stream_sync, device_sync = [o for o in drv if o["kind"] == "sync"][:2]
    on_7001 = [o for o in drv if o["kind"] != "sync" and o["stream_handle"] == 0x7001]
    assert stream_sync["op_id"] == on_7001[-1]["op_id"] and on_7001[-1]["kind"] == "memcpy"
    assert {o["retired_ns"] for o in on_7001} == {stream_sync["ts_ns"] + stream_sync["duration_ns"]}
    others = [o for o in drv if o["kind"] != "sync" and o["stream_handle"] != 0x7001]
    assert {o["retired_ns"] for o in others} == {device_sync["ts_ns"] + device_sync["duration_ns"]}
    assert [o["op_name"] for o in drv if o["kind"] == "launch"][0] == "triton_poi_fused_add_0"

    report = mmtrace_cli("report", path, "--json")
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    ops = {(o["stream"], o["api"], o["op_name"]): o["count"] for o in summary["ops"]}
    assert ops[("gpu", "cuLaunchKernel", "triton_poi_fused_add_0")] == 1
    # The runtime's calls failed: no work, counted apart by API and code.
    assert not any(api.startswith("cuda") for _, api, _ in ops)
    failed = {(f["api"], f["error"]): f["count"] for f in summary["failed_calls"]}
    insufficient = "cudaErrorInsufficientDriver (35)"
    assert failed[("cudaLaunchKernel", insufficient)] >= 2
    assert failed[("cudaMemcpyAsync", insufficient)] >= 5
    assert failed[("cudaStreamSynchronize", insufficient)] >= 1
    waits = {w["api"]: w for w in summary["sync_waits"]}
    assert waits["cuStreamSynchronize"]["count"] == 1
    assert waits["cuStreamSynchronize"]["p50_us"] >= 2000
    assert "cudaStreamSynchronize" not in waits
    copied = {(b["stream"], b["direction"]): b["bytes"] for b in summary["bytes_by_direction"]}
    assert copied[("gpu", "h2d")] == 4096       # the driver's copy; the runtime's failed
    # counted by "<stream>.<kind>", as the interface names them
    kinds = {o["kind"] for o in gpu}
    for kind in kinds:     # the calls that did not fail
        assert summary["events"].get(f"gpu.{kind}", 0) == sum(
            o["kind"] == kind and o["ret"] in (0, None) for o in gpu)
    assert {"gpu.launch", "gpu.memcpy", "gpu.sync", "gpu.graph_launch"} <= set(summary["events"])
    assert "dev.event" not in summary["events"]
    states = summary["device_probes"]["summary"]
    assert states["attached"] >= 20 and states["libraries"] >= 2
    # ...and the Perfetto trace, as the official schema reads it: each of
    # the runtime's launches carries its return code and outcome.
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace
    trace_path = tmp_path / "gpu.pftrace"
    exported = mmtrace_cli("export", path, "--format", "perfetto", "-o", trace_path)
    assert exported.returncode == 0, exported.stderr
    trace = Trace()
    trace.ParseFromString(trace_path.read_bytes())
    notes = [{a.name: getattr(a, a.WhichOneof("value")) for a in p.track_event.debug_annotations}
             for p in trace.packet if p.track_event.debug_annotations]
    launches = [n for n in notes if n.get("api") == "cudaLaunchKernel"
                and n["stream"] in ("0x1234", "0x2345")]
    assert len(launches) == 2
    assert all(n["return_code"] == CUDA_ERROR_INSUFFICIENT_DRIVER
               and n["outcome"] == "failed: cudaErrorInsufficientDriver (35)"
               and {"grid", "block", "sched_delay_ns"} <= set(n) for n in launches), launches


def test_record_traces_from_its_gpu_line_on_and_stops_at_its_duration(natives, tmp_path):
    """`gpu/npu stream live` is said once the probes are attached: every
    call a workload makes right after that line is in the file. And
    --duration bounds the file: it spans the duration asked for, from when
    the CPU stream went live, within half a second."""
    from mmtrace.agent.recording.file_format import read_recording
    path = tmp_path / "bounded.mmtr"
    rec = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o", str(path),
                            "--lib", str(natives.cudart), "--duration", "5"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        seen = [rec.stdout.readline()]
        while seen[-1] and not seen[-1].startswith("gpu/npu stream live"):
            seen.append(rec.stdout.readline())
        assert seen[-1].startswith("gpu/npu stream live"), seen
        runtime = run_json([natives.cudart_calls, 300])     # at once: no grace
        rec.communicate(timeout=60)
    finally:
        if rec.poll() is None:
            rec.kill()
            rec.wait()
    assert rec.returncode == 0
    loaded = read_recording(path)
    mine = loaded.events["dev.event"][loaded.events["dev.event"]["pid"] == runtime["pid"]]
    assert len(mine) == 11, len(mine)       # the calls of test_record_and_export_jsonl_end_to_end
    assert abs(loaded.footer["duration_s"] - 5.0) <= 0.5, loaded.footer["duration_s"]


def test_the_kernel_names_the_processes_whose_files_changed(cudart_session, natives, tmp_path):
    """exec, fork, a library mapped executable (dlopen) and exit are noted
    per process, and a Discoverer following them finds a library loaded
    late at its next poll, reading no other process (rescan_every never)."""
    from mmtrace.agent.discovery.discoverer import Discoverer
    from mmtrace.agent.kernel.probed_symbols import wanted
    from mmtrace.bpf.device import CHANGE_EXEC, CHANGE_EXIT, CHANGE_FORK, CHANGE_MAPPED
    take = cudart_session.device.process_changes()
    assert take is not None and take() is not None
    lib = tmp_path / "libcudart.so.12"              # a copy: its own inode
    shutil.copy(natives.cudart, lib)
    child = subprocess.Popen([sys.executable, "-c", "import ctypes, sys\n"
                              "print('ready', flush=True)\n"
                              "ctypes.CDLL(sys.stdin.readline().strip())\n"
                              "print('loaded', flush=True)\nsys.stdin.read()\n"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert take()[child.pid] & (CHANGE_FORK | CHANGE_EXEC) == CHANGE_FORK | CHANGE_EXEC
        discoverer = Discoverer(wanted, pids=[child.pid], search_paths=[], rescan_every=10**6)
        discoverer.follow(take)
        assert [t for t in discoverer.poll() if t.path == str(lib)] == []
        read = discoverer.counters["maps_read"]
        assert discoverer.poll() == [] and discoverer.counters["maps_read"] == read
        child.stdin.write(f"{lib}\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "loaded"
        found = [t for t in discoverer.poll() if t.path == str(lib)]
        assert [t.origin for t in found] == [f"maps:{child.pid}"]
        assert discoverer.counters["maps_read"] == read + 1
    finally:
        child.stdin.close()
        child.wait(timeout=10)
    changes = take()
    assert changes.get(child.pid, 0) & CHANGE_EXIT
    assert not changes.get(child.pid, 0) & CHANGE_MAPPED    # taken by the discoverer
    # A mapping is noted at its return, and only one the kernel made: a
    # static program (no loader mapping libraries) maps a file executable,
    # opened for reading, then for writing only (refused: EACCES).
    from native import compile_text
    mapper = compile_text(tmp_path / "map_exec", MAP_EXEC_C, "-static")
    notes = {}
    for mode in ("read", "write"):
        proc = subprocess.Popen([str(mapper), str(lib), mode], stdout=subprocess.PIPE, text=True)
        said = proc.communicate(timeout=10)[0].strip()
        assert said == ("mapped" if mode == "read" else "refused 13"), said
        notes[mode] = take().get(proc.pid, 0)
    assert notes["read"] & CHANGE_MAPPED and notes["read"] & CHANGE_EXIT
    assert not notes["write"] & CHANGE_MAPPED and notes["write"] & CHANGE_EXIT


MAP_EXEC_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
int main(int argc, char **argv)
{
    int fd = open(argv[1], strcmp(argv[2], "read") == 0 ? O_RDONLY : O_WRONLY);
    void *p = mmap(0, 4096, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED)
        printf("refused %d\n", errno);
    else
        printf("mapped\n");
    return 0;
}
"""


def test_a_burst_of_50000_launches_back_to_back_is_recorded_whole(natives, tmp_path):
    """50 000 cudaLaunchKernel calls back to back on the real libcudart (at
    the rate the uprobe trap allows, about 1 M/s here) under `mmtrace
    record`: every one is in the file, each once (op_id 1..50 000), with
    its thread's comm, and nothing is counted lost. The device ring holds
    55 188 launch records (8 MiB), so the burst fits even where the drain
    does not run during it; what a smaller ring or a slower drain would
    miss is counted (ringbuf_full_dev), never silently gone."""
    from mmtrace.agent.recording.file_format import read_recording
    from mmtrace.bpf import counters, device
    burst = 50_000
    loop = subprocess.Popen([str(natives.launch_loop), "launch-only"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    path = tmp_path / "burst.mmtr"
    rec = None
    try:
        pid = int(loop.stdout.readline().split()[1])
        rec = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o", str(path),
                                "--pid", str(pid), "--lib", str(natives.cudart)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = [rec.stdout.readline()]
        while seen[-1] and not seen[-1].startswith("gpu/npu stream live"):
            seen.append(rec.stdout.readline())
        assert seen[-1].startswith("gpu/npu stream live"), seen
        loop.stdin.write(f"run {burst}\n")
        loop.stdin.flush()
        took = float(loop.stdout.readline().split()[1])
        time.sleep(0.2)
    finally:
        loop.stdin.close()
        loop.wait(timeout=30)
        if rec is not None:
            rec.send_signal(signal.SIGINT)
            rec.communicate(timeout=60)
    assert rec.returncode == 0
    recording = read_recording(path)
    dev = recording.events["dev.event"]
    mine = dev[(dev["pid"] == pid) & (dev["kind"] == device.KIND_IDS["launch"])]
    lost = {name: n for name, n in recording.footer["counters"].items()
            if name in counters.LOSS_COUNTERS and counters.stream_of(name) == "dev" and n}
    assert len(mine) + sum(lost.values()) == burst, (len(mine), lost)
    assert lost == {} and len(mine) == burst, (len(mine), lost, f"{burst / took:,.0f}/s")
    assert np.array_equal(np.sort(mine["op_id"]), np.arange(1, burst + 1, dtype=np.uint64))
    assert set(mine["comm"].tolist()) == {b"launch_loop"}
    # ...sent by the kernel once, not read from /proc
    named = recording.footer["name_resolution"]
    assert named["threads_sent"] >= 1 and "comm_from_proc" not in named, named
    assert set(mine["api"].tolist()) == {1}         # cudaLaunchKernel
    assert set(mine["grid_x"].tolist()) == {64} and set(mine["block_x"].tolist()) == {256}
    assert set(mine["stream_handle"].tolist()) == {0x100}
    # No driver: every launch failed, and its return code says so.
    assert set(mine["ret"].tolist()) <= {0, CUDA_ERROR_INSUFFICIENT_DRIVER}


def test_launches_go_in_one_cache_line_and_read_back_whole(natives):
    """With no return probed, a cudaLaunchKernel goes in a 64-byte record
    (struct dev_launch) once its CPU has sent its call site whole: the
    first launch on each CPU is whole, the rest compact. Read back, every
    launch has all it had: op ids 1..N, its pid and comm (its thread's),
    its outer caller (its call site's), shape and stream."""
    from mmtrace.bpf import device
    n = 3000
    loop = subprocess.Popen([str(natives.launch_loop), "launch-only"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    session = None
    try:
        pid = int(loop.stdout.readline().split()[1])
        session = DeviceSession([natives.cudart], pids=(pid,), launch_return_every=0)
        (ring,) = [r for r in session.loaded.rings if r.stream == "dev"]
        loop.stdin.write(f"run {n}\n")
        loop.stdin.flush()
        assert loop.stdout.readline().startswith("done")
        session.drain()
        compact, whole = ring.reader.launches.records_read, ring.reader.events.records_read
    finally:
        loop.stdin.close()
        loop.wait(timeout=10)
        if session is not None:
            session.close()
    ev = session.events(pid)
    assert len(ev) == n and compact + whole == n
    assert 1 <= whole <= 2 * (os.cpu_count() or 1), (whole, compact)
    assert np.array_equal(ev["op_id"], np.arange(1, n + 1))
    assert set(ev["pid"].tolist()) == {pid} and set(ev["tid"].tolist()) == {pid}
    assert set(ev["comm"].tolist()) == {b"launch_loop"}
    assert set(ev["kind"].tolist()) == {device.KIND_IDS["launch"]}
    assert set(ev["flags"].tolist()) == {0} and set(ev["device"].tolist()) == {-1}
    assert set(ev["direction"].tolist()) == {device.NO_DIRECTION}
    assert set(zip(ev["grid_x"].tolist(), ev["grid_y"].tolist(), ev["grid_z"].tolist(),
                   ev["block_x"].tolist(), ev["block_y"].tolist(),
                   ev["block_z"].tolist())) == {(64, 1, 1, 256, 1, 1)}
    assert set(ev["stream_handle"].tolist()) == {0x100}
    assert set(ev["shared_mem_bytes"].tolist()) == {0}
    assert len(set(ev["return_ip"].tolist())) == 1 and ev["return_ip"][0] != 0
    assert len(set(ev["outer_return_ip"].tolist())) == 1
    assert session.loaded.thread_comms().get("outer_caller_unknown", 0) == 0


def test_the_device_ring_wakes_its_reader_once_a_batch_is_in_not_per_record(natives):
    """What `record` and the daemon sleep on: the device ring's descriptor,
    edge-triggered, signalled by each CPU at every period-th record (an
    eighth to a quarter of the ring), never per record. A 64 KiB ring, and
    one traced process: one launch wakes nobody; CPUs x period launches
    must (at least one CPU reached its period), and fit the ring. Then
    runs of 300 (the ring holds 431) until the records have wrapped around
    its end, one of them across it: each read whole, in order, intact."""
    from mmtrace.agent.ingest.wakeups import Waiter
    from mmtrace.agent.kernel.probes import wakeup_period
    from mmtrace.bpf import device
    pages = 16
    period = wakeup_period(pages, device.DEV_RECORD.itemsize)
    burst = period * (os.cpu_count() or 1)
    assert burst + 1 <= pages * 4096 // (device.DEV_RECORD.itemsize + 8)
    loop = subprocess.Popen([str(natives.launch_loop), "launch-only"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    session = waiter = None
    try:
        pid = int(loop.stdout.readline().split()[1])
        session = DeviceSession([natives.cudart], pids=(pid,), dev_ringbuf_pages=pages)
        (ring,) = [r for r in session.loaded.rings if r.stream == "dev"]
        waiter = Waiter()
        for fd in ring.filenos():
            waiter.watch(fd, edge=True)

        def run(n):
            loop.stdin.write(f"run {n}\n")
            loop.stdin.flush()
            assert loop.stdout.readline().startswith("done")

        run(1)
        assert not waiter.wait(0.3)             # a record in the ring, and no signal
        assert len(ring.reader.read()) == 1
        run(burst)
        assert waiter.wait(5.0)
        assert set(waiter.ready) <= set(ring.filenos())
        assert len(ring.reader.read()) == burst
        seen = 1 + burst
        for _ in range(3):                      # 152-byte records in 65 536 bytes
            run(300)
            batch = ring.reader.read()
            assert np.array_equal(batch["op_id"], np.arange(seen + 1, seen + 301))
            assert set(batch["grid_x"].tolist()) == {64} and set(batch["comm"].tolist()) == {
                b"launch_loop"}
            seen += 300
        assert seen * (device.DEV_RECORD.itemsize + 8) > 2 * pages * 4096
    finally:
        loop.stdin.close()
        loop.wait(timeout=10)
        if waiter is not None:
            waiter.close()
        if session is not None:
            session.close()
