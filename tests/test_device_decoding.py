"""The GPU/NPU side without eBPF: the API table, names found in
userspace (with an injected /proc), and a recording of device events
exported to JSON Lines and reported through the CLI."""

import json
import os

import numpy as np
import pytest

from mmtrace.agent.ingest.device_names import DeviceNames
from mmtrace.agent.recording.file_format import RecordingWriter
from mmtrace.bpf import device


def test_api_table_is_consistent():
    table = device.default_table()
    assert len({api.id for api in table.apis}) == len(table.apis)
    assert len({api.symbol for api in table.apis}) == len(table.apis)
    assert device.DEV_EVENT.itemsize % 8 == 0
    names = {api.symbol: api.name for api in table.apis}
    assert names["cudaLaunchKernel_ptsz"] == "cudaLaunchKernel"
    assert names["cuMemcpyHtoDAsync_v2_ptsz"] == "cuMemcpyHtoDAsync"
    assert names["cudaMemcpy_ptds"] == "cudaMemcpy"
    assert names["aclopExecuteV2"] == "aclopExecuteV2"
    aclnn = next(api for api in table.apis if api.pattern)
    assert aclnn.matches("aclnnAdd") and aclnn.matches("aclnnFlashAttentionScore")
    assert not aclnn.matches("aclnnAddGetWorkspaceSize") and not aclnn.matches("aclnn")
    # Every per-launch API is a launch; nothing else is detached in the adaptive mode.
    assert {api.kind for api in table.apis if api.per_launch} == {"launch"}
    assert not [api for api in table.apis if api.kind == "launch" and not api.per_launch]


def test_generated_programs_name_every_decoder():
    table = device.default_table()
    multi = table.generated_programs(multi=True)
    single = table.generated_programs(multi=False)
    for api in table.apis:
        assert f"int {api.multi_entry_fn}(" in multi
        assert f"int {api.entry_fn}(" in single
        if api.return_impl:
            assert f"int {api.multi_return_fn}(" in multi
            assert f"int {api.return_fn}(" in single


class FakeResolver:
    def __init__(self, names):
        self.names = names
        self.calls = 0

    def resolve_many(self, pid, addrs, namer=None):
        self.calls += 1
        return [self.names.get((pid, int(a))) for a in addrs]


def launch_events(n, pid=42, handle=0x1000):
    ev = np.zeros(n, device.DEV_EVENT)
    ev["api"] = 1       # cudaLaunchKernel
    ev["pid"] = pid
    ev["handle"] = handle
    return ev


def test_host_stub_names_are_resolved_once_per_address():
    resolver = FakeResolver({(42, 0x1000): "vector_add(float*)"})
    names = DeviceNames(device.default_infos(), resolver=resolver)
    assert names.process(launch_events(5)) == [[42, 0x1000, "vector_add(float*)"]]
    assert names.process(launch_events(5)) == []
    assert resolver.calls == 1
    names.process(launch_events(1, handle=0x2000))
    assert names.counters["unresolved"] == 1


def test_what_is_kept_of_a_process_goes_when_it_exits_and_the_cache_stays_bounded(tmp_path):
    resolver = FakeResolver({(42, 0x1000): "vector_add(float*)", (43, 0x1000): "other(int)"})
    (tmp_path / "42").mkdir()
    (tmp_path / "43").mkdir()
    names = DeviceNames(device.default_infos(), resolver=resolver, proc_root=tmp_path,
                        max_cached=3)
    names.process(launch_events(2, pid=42))
    names.process(launch_events(2, pid=43))
    (tmp_path / "42").rmdir()
    names.forget_exited()
    assert list(names._seen) == [43]
    assert names.process(launch_events(1, pid=42)) == [[42, 0x1000, "vector_add(float*)"]]
    assert names.process(launch_events(1, pid=43)) == []           # kept: still running
    for addr in (0x2000, 0x3000, 0x4000):                         # over max_cached
        names.process(launch_events(1, pid=43, handle=addr))
    assert names._seen_count <= 3 and list(names._seen) == [43]


def test_a_cudakernel_handle_takes_the_name_of_its_host_function():
    """nvcc 13's <<<>>>: __cudaGetKernel(&handle, host function) once, then
    launches with the handle (a driver's opaque cudaKernel_t)."""
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    infos = device.default_infos()
    get_kernel = next(i for i, info in infos.items() if info.symbol == "__cudaGetKernel")
    ev = np.zeros(3, device.DEV_EVENT)
    ev["pid"] = 42
    ev["ts_ns"] = [1, 2, 3]
    ev["api"] = [get_kernel, 1, 1]
    ev["kind"] = [device.KIND_IDS["function_name"], device.KIND_IDS["launch"],
                  device.KIND_IDS["launch"]]
    ev["flags"][0] = device.FLAG_RETURNED
    ev["handle"] = [0x7F0000C0FFEE, 0x7F0000C0FFEE, 0x7F0000BAD000]
    ev["alias"][0] = 0x1000
    names = DeviceNames(infos, resolver=FakeResolver({(42, 0x1000): "vision::patch(int)"}))
    rows = decode(ev, DeviceContext.from_meta([{"op_names": names.process(ev)}]))
    assert list(rows.op_name) == ["vision::patch(int)", None]
    # The handle __cudaGetKernel made is not looked up as an address.
    assert names.counters == {"resolved": 1, "unresolved": 1}


def test_unreadable_strings_are_counted_not_fatal(tmp_path):
    ev = np.zeros(2, device.DEV_EVENT)
    ev["api"] = 101     # aclopExecuteV2
    ev["flags"] = device.FLAG_READ_FAILED
    ev["name_addr"] = 0x7000
    ev["pid"] = [1111, 2222]
    (tmp_path / "2222").mkdir()
    (tmp_path / "2222" / "mem").mkdir()     # opening a folder as mem fails
    names = DeviceNames(device.default_infos(), resolver=FakeResolver({}), proc_root=tmp_path)
    names.process(ev)
    assert names.counters["string_process_gone"] == 1
    assert names.counters["string_unreadable"] == 1
    assert ev["name"].tolist() == [b"", b""]


def test_strings_are_read_from_process_memory(tmp_path):
    mem = tmp_path / "3333" / "mem"
    mem.parent.mkdir()
    with open(mem, "wb") as f:
        f.seek(0x7000)
        f.write(b"MatMulV2\0garbage")
    ev = np.zeros(1, device.DEV_EVENT)
    ev["api"] = 101
    ev["flags"] = device.FLAG_READ_FAILED
    ev["name_addr"] = 0x7000
    ev["pid"] = 3333
    DeviceNames(device.default_infos(), resolver=FakeResolver({}), proc_root=tmp_path).process(ev)
    assert ev["name"][0] == b"MatMulV2"
    assert ev["flags"][0] & device.FLAG_NAME_FROM_USERSPACE


def recording_with_device_events(path):
    ev = np.zeros(4, device.DEV_EVENT)
    rows = [  # ts, api, op_id, stream, duration, handle
        (1_000, 1, 1, 0x10, 0, 0x1000), (2_000, 9, 2, 0x10, 0, 0),
        (3_000, 13, 0, 0x10, 500, 0), (4_000, 104, 1, 0, 900, 7)]
    for i, (ts, api, op, stream, dur, handle) in enumerate(rows):
        ev[i]["ts_ns"], ev[i]["api"], ev[i]["op_id"] = ts, api, op
        ev[i]["stream_handle"], ev[i]["handle"] = stream, handle
        ev[i]["duration_ns"], ev[i]["flags"] = dur, 1 if dur else 0
        ev[i]["pid"] = ev[i]["tid"] = 42 if api != 104 else 43
        ev[i]["device"] = -1
        ev[i]["comm"] = b"server"
        ev[i]["direction"] = 0xFF if api != 9 else 1
        ev[i]["bytes"] = 4096 if api == 9 else 0
        ev[i]["grid_x"], ev[i]["block_x"] = (8, 256) if api == 1 else (0, 0)
    writer = RecordingWriter(path, {"dev.event": device.DEV_EVENT})
    writer.write_meta({"apis": device.default_table().to_json()})
    writer.write_events("dev.event", ev)
    writer.write_meta({"op_names": [[42, 0x1000, "vector_add(float*)"]]})
    writer.close({"duration_s": 1.0})


def test_export_jsonl_has_every_spec_field(tmp_path, mmtrace_cli):
    from mmtrace.exporters.files.jsonl import KEYS
    path = tmp_path / "dev.mmtr"
    recording_with_device_events(path)
    result = mmtrace_cli("export", path, "--format", "jsonl", "-o", "-")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [list(obj) for obj in lines] == [list(KEYS)] * 4
    launch, copy, sync, model = lines
    assert launch == {
        "ts_ns": 1000, "stream": "gpu", "kind": "launch", "pid": 42, "tid": 42,
        "comm": "server", "api": "cudaLaunchKernel", "op_id": 1,
        "op_name": "vector_add(float*)", "handle": 0x1000, "stream_handle": 0x10,
        "grid": [8, 0, 0], "block": [256, 0, 0], "shared_mem_bytes": 0, "bytes": None,
        "direction": None, "duration_ns": None, "sched_delay_ns": 0, "retired_ns": 3500,
        "device": None, "ret": None}
    assert (copy["kind"], copy["bytes"], copy["direction"], copy["retired_ns"]) == (
        "memcpy", 4096, "h2d", 3500)
    assert (sync["kind"], sync["op_id"], sync["duration_ns"], sync["retired_ns"], sync["ret"]) == (
        "sync", 2, 500, None, 0)
    assert (model["stream"], model["kind"], model["handle"], model["retired_ns"]) == (
        "npu", "model_exec", 7, 4900)


def test_report_lists_ops_sync_waits_and_bytes(tmp_path, mmtrace_cli):
    path = tmp_path / "dev.mmtr"
    recording_with_device_events(path)
    result = mmtrace_cli("report", path, "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert {"stream": "gpu", "kind": "launch", "api": "cudaLaunchKernel",
            "op_name": "vector_add(float*)", "count": 1} in summary["ops"]
    assert summary["sync_waits"] == [{"stream": "gpu", "api": "cudaStreamSynchronize",
                                      "count": 1, "total_ms": 0.001, "p50_us": 0.5,
                                      "p99_us": 0.5, "max_us": 0.5}]
    assert summary["bytes_by_direction"] == [{"stream": "gpu", "direction": "h2d",
                                              "count": 1, "bytes": 4096}]
    text = mmtrace_cli("report", path)
    assert "cudaStreamSynchronize" in text.stdout and "vector_add(float*)" in text.stdout


def test_chrome_export_places_device_calls_on_their_threads(tmp_path, mmtrace_cli):
    path = tmp_path / "dev.mmtr"
    recording_with_device_events(path)
    out = tmp_path / "trace.json"
    result = mmtrace_cli("export", path, "--format", "chrome", "-o", out)
    assert result.returncode == 0, result.stderr
    events = json.loads(out.read_text())["traceEvents"]
    sync = next(e for e in events if e["name"] == "cudaStreamSynchronize")
    assert (sync["ph"], sync["dur"], sync["tid"]) == ("X", 0.5, 42)
    assert next(e for e in events if e["name"] == "vector_add(float*)")["ph"] == "i"


def test_failure_keys_group_failed_calls_as_their_api_and_error_do():
    """DeviceRows.failure_keys: among failed calls, the rows of one key
    show one (api, error): by API id and code, and by op too for aclnn
    launches (one id, named by their op). Here every id's name is its own,
    so one (api, error) is one key too."""
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    infos = device.default_infos()
    ids = [next(i for i, info in infos.items() if info.symbol == symbol)
           for symbol in ("cudaLaunchKernel", "aclnn", "aclrtMemcpyAsync", "cudaMemcpy")]
    rng = np.random.default_rng(7)
    n = 3000
    ev = np.zeros(n, device.DEV_EVENT)
    ev["ts_ns"] = np.arange(n) * 1000
    ev["api"] = rng.choice(ids, n)
    for api in ids:
        ev["kind"][ev["api"] == api] = device.KIND_IDS[infos[api].kind]
    ev["pid"] = ev["tid"] = 9
    ev["flags"] = device.FLAG_RETURNED
    ev["ret"] = rng.choice([0, 0, 1, 2, 700, 561000], n)
    ev["symbol_id"] = rng.integers(1, 5, n)
    rows = decode(ev, DeviceContext.from_meta([{"symbol_names": {
        "1": "aclnnAdd", "2": "aclnnMul", "3": "aclnnMatmul"}}]))
    failed = np.flatnonzero(rows.failed)
    keys = rows.failure_keys[failed].tolist()
    shown = list(zip(rows.api[failed], rows.error[failed]))
    assert len(set(shown)) > len(ids)         # aclnn's ops apart, several codes
    by_key, by_shown = {}, {}
    for key, pair in zip(keys, shown):
        by_key.setdefault(key, set()).add(pair)
        by_shown.setdefault(pair, set()).add(key)
    assert all(len(v) == 1 for v in by_key.values())
    assert all(len(v) == 1 for v in by_shown.values())
