"""Fuzz the metrics' ingest: arbitrary device and run-queue records (as the
kernel's rings could carry after a layout slip, or a probe decoding
garbage) go through the daemon's aligner into the event counts, and a
scrape's view of them. Nothing may raise, and every counter only grows."""

import sys

import atheris
import numpy as np

with atheris.instrument_imports():
    from mmtrace.agent.ingest.align import ApiRoles, Aligner
    from mmtrace.agent.ingest.latency_series import Submitters
    from mmtrace.bpf import device as device_stream
    from mmtrace.bpf import sched as sched_stream
    from mmtrace.exporters.live.event_counts import EventCounts, top_k

INFOS = device_stream.default_infos()


def records(data: bytes, dtype) -> np.ndarray:
    usable = len(data) - len(data) % dtype.itemsize
    return np.frombuffer(data[:usable], dtype).copy()


def totals(snapshot) -> list[int]:
    return ([sum(snapshot.submissions.values()), sum(snapshot.memcpy_bytes.values())]
            + [int(h.counts.sum()) for h in snapshot.sync_wait.values()]
            + [int(h.counts.sum()) for h in snapshot.submit_to_retire.values()])


def test_one_input(data: bytes):
    fdp = atheris.FuzzedDataProvider(data)
    counts = EventCounts(INFOS, proc_root="/nonexistent")
    aligner = Aligner(ApiRoles.from_infos(INFOS), capacity=1024)
    submitters = Submitters()
    previous = totals(counts.snapshot())
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        dev = records(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8 * 232)), device_stream.DEV_EVENT)
        # API ids mostly real ones, so that the counting paths are reached
        if len(dev) and fdp.ConsumeBool():
            ids = np.array(sorted(INFOS), np.uint16)
            dev["api"] = ids[dev["api"] % len(ids)]
        submitters.learn(dev)
        aligned = aligner.push(dev)
        counts.on_device(aligned, aligner.last_retired)
        runq = records(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 8 * 48)), sched_stream.RUNQ_EVENT)
        counts.on_runq(runq, submitters)
        snapshot = counts.snapshot()
        now = totals(snapshot)
        assert all(b >= a for a, b in zip(previous, now)), (previous, now)
        previous = now
        for key, hist in top_k(snapshot.processes, 2, with_pid=fdp.ConsumeBool()):
            buckets = hist.cumulative()
            assert buckets[-1][0] == "+Inf" and buckets[-1][1] == int(hist.counts.sum())


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
