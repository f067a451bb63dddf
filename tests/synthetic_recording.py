"""Synthetic recordings of any size, written through the real writer: the
run-queue and GPU streams of a busy inference host, drained every 25 ms as
`mmtrace record` drains them. For the memory tests and bench/."""

import numpy as np

from mmtrace.agent.recording.file_format import RecordingWriter
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT

SCHEMAS = {"cpu.runq": RUNQ_EVENT, "dev.event": device_stream.DEV_EVENT}
DRAIN_NS = 25_000_000
LAUNCH, MEMCPY_ASYNC, STREAM_SYNC = 1, 9, 13     # cudaLaunchKernel, cudaMemcpyAsync, ...Sync
DISORDER_NS = 3_700
KERNELS = [0x1000 + 0x40 * k for k in range(16)]


def _drain_template(rng, runq_per_drain: int, launches: int):
    """One drain's records, stamped from 0; each later drain shifts them."""
    runq = np.zeros(runq_per_drain, RUNQ_EVENT)
    runq["ts_ns"] = np.sort(rng.integers(DISORDER_NS, DRAIN_NS, runq_per_drain))
    # Two CPUs share a ring: a record is committed after records stamped
    # up to a few µs after it (the order `record` reads them in).
    late = rng.random(runq_per_drain) < 0.02
    runq["ts_ns"][late] -= rng.integers(0, DISORDER_NS, int(late.sum())).astype(np.uint64)
    runq["delay_ns"] = rng.lognormal(np.log(8e3), 1.2, runq_per_drain).astype(np.uint64)
    runq["pid"] = rng.integers(0, 12, runq_per_drain) + 1000
    runq["tid"] = runq["pid"] * 10 + rng.integers(0, 8, runq_per_drain)
    runq["cpu"] = rng.integers(0, 64, runq_per_drain)
    runq["comm"] = np.array([b"python3", b"vision-enc", b"decoder", b"nccl-comm"])[
        runq["tid"] % 4]
    dev = []
    for pid in (1000, 1001):        # two server processes, four launch threads each
        per = launches + 2
        ev = np.zeros(per, device_stream.DEV_EVENT)
        ev["ts_ns"] = np.linspace(0, DRAIN_NS - 2_000_000, per).astype(np.uint64)
        ev["pid"], ev["tid"] = pid, pid * 10 + np.arange(per) % 4
        ev["api"][:launches] = LAUNCH
        ev["handle"][:launches] = rng.choice(KERNELS, launches)
        ev["grid_x"][:launches], ev["block_x"][:launches] = 128, 256
        ev["api"][launches] = MEMCPY_ASYNC
        ev["bytes"][launches], ev["direction"][launches] = 1 << 20, 1
        ev["api"][-1] = STREAM_SYNC
        ev["duration_ns"][-1], ev["flags"][-1] = 1_500_000, device_stream.FLAG_RETURNED
        ev["tid"][-1] = ev["tid"][0]
        ev["stream_handle"] = 0x10
        ev["direction"][ev["api"] != MEMCPY_ASYNC] = device_stream.NO_DIRECTION
        ev["device"] = pid - 1000
        ev["sched_delay_ns"] = rng.integers(0, 50_000, per)
        ev["comm"] = b"server"
        dev.append(ev)
    dev = np.concatenate(dev)
    return runq, dev[np.argsort(dev["ts_ns"], kind="stable")]


def write_synthetic(path, target_bytes: int, runq_per_drain: int = 2000, launches: int = 16,
                    seed: int = 1) -> dict:
    """Write about `target_bytes`; returns the events written by schema."""
    rng = np.random.default_rng(seed)
    runq, dev = _drain_template(rng, runq_per_drain, launches)
    submissions = np.isin(dev["api"], [LAUNCH, MEMCPY_ASYNC])
    per_process = {pid: np.flatnonzero(submissions & (dev["pid"] == pid)) for pid in (1000, 1001)}
    writer = RecordingWriter(path, SCHEMAS, info={"hostname": "synthetic"})
    writer.write_meta({"apis": device_stream.default_table().to_json(),
                       "op_names": [[pid, k, f"gemm_kernel_{i}(float const*, float*)"]
                                    for pid in (1000, 1001) for i, k in enumerate(KERNELS)]})
    counts = {"cpu.runq": 0, "dev.event": 0}
    start = 1_000_000_000_000
    drain = 0
    while writer.bytes_written < target_bytes:
        base = np.uint64(start + drain * DRAIN_NS)
        r = runq.copy()
        r["ts_ns"] += base
        d = dev.copy()
        d["ts_ns"] += base
        for rows in per_process.values():
            d["op_id"][rows] = drain * len(rows) + 1 + np.arange(len(rows))
        writer.write_events("cpu.runq", r)
        writer.write_events("dev.event", d)
        counts["cpu.runq"] += len(r)
        counts["dev.event"] += len(d)
        drain += 1
    writer.close({"duration_s": drain * DRAIN_NS / 1e9, "lost_events": 0,
                  "events": sum(counts.values())})
    return counts
