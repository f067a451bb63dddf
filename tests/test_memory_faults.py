"""The memory ledger, the leak and hang detectors and the fault verdicts on
records built here (the layouts bpf/device_memory.c writes): simulated
time, so that ten minutes of a balanced allocator cost a fraction of a
second. The same detectors run on real eBPF in test_memory_hangs_bpf.py."""

import json

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf import device_memory as dm
from mmtrace.detectors.device_faults import merge
from mmtrace.detectors.device_hang import DeviceHang
from mmtrace.detectors.memory_leak import MemoryLeak

from mmtrace.agent.ingest.memory_ledger import MemoryLedger

MIB = 1 << 20
CUDA_MALLOC, CUDA_FREE, CUDA_SYNC, ACL_SYNC = 26, 29, 13, 111


def records(rows) -> np.ndarray:
    """(kind, api, pid, ts_ns, ptr, bytes, ret[, flags]) -> returned device records."""
    out = np.zeros(len(rows), device_stream.DEV_EVENT)
    for i, (kind, api, pid, ts, ptr, size, ret, *flags) in enumerate(rows):
        out[i]["kind"], out[i]["api"], out[i]["pid"], out[i]["ts_ns"] = kind, api, pid, ts
        out[i]["handle"], out[i]["bytes"], out[i]["ret"] = ptr, size, ret
        out[i]["flags"] = device_stream.FLAG_RETURNED | (flags[0] if flags else 0)
    return out


def allocator(pid, seconds, every_ms, balanced, start_ns=0, size=MIB):
    """Batches of a second: an allocation each `every_ms`, the one before
    freed when `balanced`."""
    ptr, previous = 0x1000, None
    for s in range(seconds):
        rows = []
        for k in range(1000 // every_ms):
            ts = start_ns + s * 10**9 + k * every_ms * 10**6
            ptr += size
            rows.append((dm.ALLOC, CUDA_MALLOC, pid, ts, ptr, size, 0))
            if balanced and previous:
                rows.append((dm.FREE, CUDA_FREE, pid, ts + 1000, previous, size, 0))
            previous = ptr
        yield records(rows), start_ns + (s + 1) * 10**9


def test_a_balanced_allocator_raises_no_alarm_over_ten_minutes():
    ledger, leak = MemoryLedger(), MemoryLeak(grow_s=60, min_growth_bytes=64 * MIB)
    found = []
    for batch, now in allocator(7, 600, 10, balanced=True):
        ledger.feed(batch)
        found += leak.check(ledger, now)
        held = ledger.outstanding()[("gpu", 0)]
        found += leak.observe_used(0, (1 << 30) + held, held, now)
    assert found == []
    assert ledger.outstanding() == {("gpu", 0): MIB}
    assert ledger.totals()["allocs"]["gpu"] == 60_000 == ledger.totals()["frees"]["gpu"] + 1


def test_a_steady_leak_fires_once_after_grow_s_and_a_free_resolves_it():
    ledger, leak = MemoryLedger(), MemoryLeak(grow_s=2, min_growth_bytes=64 * MIB)
    fired = []
    for batch, now in allocator(9, 5, 10, balanced=False):
        ledger.feed(batch)
        fired += [(a["state"], now) for a in leak.check(ledger, now)]
    assert fired == [("firing", 3 * 10**9)]        # 2 s of growth from the first allocation
    ledger.feed(records([(dm.FREE, CUDA_FREE, 9, 6 * 10**9, 0x1000 + MIB, MIB, 0)]))
    (resolved,) = leak.check(ledger, 6 * 10**9)
    assert resolved["state"] == "resolved" and resolved["pid"] == 9
    newest = {"bytes": MIB, "stream": "gpu", "device": 0, "api": "cudaMalloc"}
    assert ledger.largest(9, 2) == [
        dict(newest, ptr=0x1000 + 500 * MIB, ts_ns=4_990_000_000),
        dict(newest, ptr=0x1000 + 499 * MIB, ts_ns=4_980_000_000)]


def test_failed_and_untracked_allocations_hold_nothing():
    ledger = MemoryLedger()
    ledger.feed(records([(dm.ALLOC, CUDA_MALLOC, 3, 1, 0, 4096, 35),
                         (dm.ALLOC, CUDA_MALLOC, 3, 2, 0x10, 4096, 0, dm.FLAG_ALLOC_UNTRACKED),
                         (dm.FREE, CUDA_FREE, 3, 3, 0x99, 0, 0, dm.FLAG_FREE_UNMATCHED)]))
    summary = ledger.summary(3)
    assert summary["outstanding_bytes"] == 0 and summary["holdings"] == []
    assert summary["failed"] == [{"api": "cudaMalloc", "ret": 35, "count": 1}]
    assert ledger.unmatched_frees == 1


def test_unaccounted_memory_fires_on_growth_and_not_on_an_exit_dip():
    leak = MemoryLeak(grow_s=2, min_growth_bytes=64 * MIB)
    s = 10**9
    # A process holding 500 MiB exits: NVML drops before the ledger forgets it.
    dip = [(t, (1 << 30) + 500 * MIB, 500 * MIB) for t in range(0, 5)] + \
        [(5, 1 << 30, 500 * MIB), (6, 1 << 30, 0)] + [(t, 1 << 30, 0) for t in range(7, 20)]
    assert [a for t, used, held in dip for a in leak.observe_used(0, used, held, t * s)] == []
    growth = [(t, (1 << 30) + (t - 20) * 100 * MIB, 0) for t in range(20, 30)]
    fired = [a for t, used, held in growth for a in leak.observe_used(0, used, held, t * s)]
    assert [(a["state"], a["evidence"]["device"], a["pid"]) for a in fired] == [
        ("firing", 0, None)]
    assert fired[0]["ts_ns"] - fired[0]["evidence"]["since_ns"] >= 2 * s
    # An NPU's (npu-smi's HBM in use) is judged apart, under its own name.
    npu = [a for t, used, held in growth
           for a in leak.observe_used(0, used, held, t * s, stream="npu")]
    assert [(a["series"], a["evidence"]["stream"]) for a in npu] == [
        ("memory_unaccounted{npu=0}", "npu")]


def test_a_hang_fires_once_past_its_threshold_and_resolves_when_the_call_returns():
    hang = DeviceHang(after_s=1.0)
    call = {"pid": 5, "tid": 6, "comm": "w", "api_id": ACL_SYNC, "api": "aclrtSynchronizeStream",
            "stream": "npu", "stream_handle": 0x77, "device": 1, "ts_ns": 10**9}
    assert hang.check([call], int(1.9e9)) == []
    (fired,) = hang.check([call], int(2.0e9))
    assert fired["state"] == "firing" and fired["evidence"]["verdict"] == "npu_hang"
    assert fired["evidence"]["waited_s"] == 1.0
    assert hang.check([call], int(3e9)) == []
    (resolved,) = hang.check([], int(4e9))
    assert resolved["state"] == "resolved" and resolved["evidence"]["waited_s"] == 3.0


def test_the_chain_joins_a_hang_with_growth_on_another_device_in_its_window():
    hang = {"detector": "device_hang", "state": "firing", "ts_ns": 5 * 10**9, "pid": 5,
            "evidence": {"pid": 5, "tid": 6, "comm": "w", "api": "aclrtSynchronizeStream",
                         "stream": "npu", "stream_handle": 0x77, "device": 1,
                         "since_ns": 3 * 10**9, "waited_s": 2.0, "verdict": "npu_hang"}}
    grew = {"detector": "memory_leak", "state": "firing", "ts_ns": 6 * 10**9, "pid": None,
            "evidence": {"kind": "unaccounted", "stream": "gpu", "device": 0,
                         "unaccounted_bytes": 900 * MIB, "grown_bytes": 800 * MIB,
                         "growth_bytes_per_s": 200 * MIB, "since_ns": 2 * 10**9,
                         "verdict": "memory_leak"}}
    before = dict(grew, ts_ns=10**9, evidence=dict(grew["evidence"], since_ns=0))
    window = {"start_ns": 0, "end_ns": 7 * 10**9}
    (p,) = merge({"processes": [], "window": window}, [hang, grew])["processes"]
    assert p["verdict"] == "npu_hang" and p["pid"] == 5
    assert p["chain"][0].startswith("pid 5 (w) tid 6: aclrtSynchronizeStream on NPU 1 "
                                    "stream 0x77 had not returned after 2.0 s")
    assert "GPU 0: 900 MiB in use that no live traced process holds" in p["chain"][1]
    assert any("nvidia-smi --gpu-reset -i 0" in f for f in p["fixes"])
    assert any("npu-smi set -t reset -d 1" in f for f in p["fixes"])
    # The memory no process holds is said for its GPU too.
    answer = merge({"processes": [], "window": window}, [grew])
    assert answer["processes"] == []
    (gpu,) = answer["devices"]
    assert (gpu["stream"], gpu["device"], gpu["verdict"]) == ("gpu", 0, "memory_leak")
    from mmtrace.exporters.terminal.explain_view import format_text
    text = format_text(answer)
    assert "GPU 0: MEMORY_LEAK" in text and "nvidia-smi --gpu-reset -i 0" in text
    # Growth that ended before the hang began is no part of its chain.
    (alone,) = merge({"processes": [], "window": window}, [hang, before])["processes"]
    assert len(alone["chain"]) == 1


def test_a_recording_carries_allocations_to_report_and_perfetto_counters(tmp_path):
    """Allocation records in a recording: report finds the leak offline,
    and the Perfetto export draws what the process holds."""
    from click.testing import CliRunner
    from test_perfetto import decoded
    from mmtrace.agent.cli import cli
    from mmtrace.agent.recording import file_format
    from mmtrace.exporters.files import perfetto_fields as proto
    path = tmp_path / "leak.mmtr"
    w = file_format.RecordingWriter(path, {"dev.event": device_stream.DEV_EVENT})
    w.write_meta({"apis": device_stream.default_table().to_json(),
                  "config": {"memory": {"grow_s": 2.0, "min_growth_mib": 64.0}}})
    for batch, _ in allocator(11, 4, 10, balanced=False, start_ns=10**9):
        w.write_events("dev.event", batch)
    w.write_events("dev.event", records([(dm.FREE, CUDA_FREE, 11, 6 * 10**9, 0x1000 + MIB,
                                          MIB, 0)]))
    w.close({})
    report = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert report.exit_code == 0, report.output
    leaks = [a for a in json.loads(report.output)["anomalies"] if a["detector"] == "memory_leak"]
    assert [(a["state"], a["pid"]) for a in leaks] == [("firing", 11), ("resolved", 11)]
    (held,) = json.loads(report.output)["device_memory"]["processes"]
    assert (held["pid"], held["outstanding_bytes"]) == (11, 399 * MIB)
    text = CliRunner().invoke(cli, ["report", str(path)])
    assert "gpu0                 11      399.0      400        1  -" in text.output, text.output
    out = tmp_path / "leak.pftrace"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "perfetto", "-o", str(out)])
    assert result.exit_code == 0, result.output
    tracks, events = decoded(out.read_bytes())
    (uuid,) = [u for u, d in tracks.items() if d.get(proto.TD_NAME) == [b"device memory held"]]
    values = [e[proto.TE_COUNTER_VALUE][0] for _, e in events
              if e.get(proto.TE_TRACK_UUID) == [uuid]]
    assert values[:2] == [MIB, 2 * MIB] and values[-1] == 399 * MIB and len(values) == 401


def test_a_gpu_with_a_stuck_call_is_drained_from_the_device_weights():
    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.memory_watch import MemoryWatch
    watch = MemoryWatch(DaemonConfig(), device_stream.default_infos())
    weights = {"0": 0.9, "1": 0.8}
    assert watch.drained(weights) == weights and watch.drained(None) is None
    watch.stuck = [{"stream": "gpu", "device": 1}, {"stream": "npu", "device": 0}]
    assert watch.drained(weights) == {"0": 0.9, "1": 0.0}


def test_metrics_say_what_is_held_per_device_and_zero_where_nothing_is():
    from collections import Counter
    from prometheus_client import CollectorRegistry, generate_latest
    from mmtrace.exporters.devices.device_state import DeviceState
    from mmtrace.exporters.live import prometheus
    from mmtrace.exporters.live.event_counts import EventCounts
    memory = {"outstanding": {("gpu", 0): 5 * MIB}, "stuck": {"gpu": 0, "npu": 1},
              "totals": {"allocs": Counter(gpu=7), "frees": Counter(gpu=2), "failed": Counter()}}
    snapshot = prometheus.DaemonSnapshot(
        counts=EventCounts(device_stream.default_infos()).snapshot(), device_memory=memory,
        gpus=[DeviceState(i, "g", f"0000:0{i}:00.0", 0, 0, 0, 80 << 30, 40, 100, 0, 0)
              for i in (0, 1)], npus=None)
    registry = CollectorRegistry()
    registry.register(prometheus.DaemonCollector(lambda: snapshot))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith(("mmtrace_device_memory", "mmtrace_device_calls_stuck",
                                 "mmtrace_device_allocations", "mmtrace_device_frees"))]
    assert lines == [
        'mmtrace_device_memory_outstanding_bytes{device="0",stream="gpu"} 5.24288e+06',
        'mmtrace_device_memory_outstanding_bytes{device="1",stream="gpu"} 0.0',
        'mmtrace_device_allocations_total{stream="gpu"} 7.0',
        'mmtrace_device_frees_total{stream="gpu"} 2.0',
        'mmtrace_device_calls_stuck{stream="gpu"} 0.0',
        'mmtrace_device_calls_stuck{stream="npu"} 1.0']


def test_explain_answers_from_the_faults_where_the_window_holds_no_events():
    """Live, a hung launcher may make no call in the window asked for."""
    from mmtrace.agent.recording.explain import explain_split
    from mmtrace.detectors.time_split import TimeSplit
    from mmtrace.agent.recording.explain import device_roles
    hang = {"detector": "device_hang", "state": "firing", "ts_ns": 5 * 10**9, "pid": 5,
            "series": "device_hang{pid=5,tid=6}",
            "evidence": {"pid": 5, "tid": 6, "comm": "w", "api": "cudaStreamSynchronize",
                         "stream": "gpu", "stream_handle": 0x77, "device": 0,
                         "since_ns": 3 * 10**9, "waited_s": 2.0, "verdict": "gpu_hang"}}
    split = TimeSplit(device_roles(device_stream.default_infos()))
    answer = explain_split(split, (6 * 10**9, 9 * 10**9), [5], [hang])
    (p,) = answer["processes"]
    assert p["verdict"] == "gpu_hang" and "nvidia-smi --gpu-reset -i 0" in " ".join(p["fixes"])
    resolved = dict(hang, state="resolved", ts_ns=7 * 10**9)
    assert explain_split(split, (8 * 10**9, 9 * 10**9), None, [hang, resolved])["processes"] == []
