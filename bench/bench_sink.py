"""The daemon's run-queue sink in process, without eBPF: CPU per event of
ThreadProcesses.fill and Streams.batch (the ring of the recent past, the
metrics' counts, the P99 series), and what the ring holds per record.

Run-queue batches of 5 000 events (a quarter second at the rated 20 000
a second, as the daemon drains them), shaped two ways, both with the
disorder of two CPUs sharing one ring (a switch-in stamped up to 4 us
before the one ahead of it):
- ping-pong: one process, two threads waking each other on two CPUs (what
  bench_pipeline.py paces);
- host: 300 threads of 40 processes with varied commands and delays.
With --submitters, a tenth of the threads do GPU work (their events feed
the metrics' per-process histograms and the P99 series). CPU is
process_time over --seconds of events, the median of --rounds.

With --recording FILE (`mmtrace record` of a workload: the soak's mix,
say), both streams of the recording instead, in time order, cut into
batches of --batch-ms (as the daemon drains them), each window followed
by the tick's detector work (P99 windows, call failures, the launchers'
time split): CPU per event of everything the daemon does with them, the
bytes its rings hold a record, and a digest of what it tells (anomalies,
the metrics' counts, P99 states, the rings' records), equal between two
revisions that change no figure. Run a baseline with PYTHONPATH on a
`git archive` of it (bench_recording.baseline_env) and compare.

Usage: .venv/bin/python bench/bench_sink.py [--seconds 30] [--rounds 3] [--submitters]
       .venv/bin/python bench/bench_sink.py --recording FILE [--batch-ms 250] [--rounds 3]
"""

import argparse
import hashlib
import json
import statistics
import time

import numpy as np

from mmtrace.agent import heap
from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.loop import p99_detector
from mmtrace.agent.daemon.streams import Streams
from mmtrace.agent.ingest.threads import ThreadProcesses
from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import RUNQ_EVENT

RATE = 20_000
BATCH = 5_000
COMMS = np.array([b"python3", b"vision-encoder", b"decoder", b"kworker/0:1", b"tokenizer",
                  b"nccl-proxy", b"sshd", b"containerd-shim"])


def events(shape: str, seconds: float, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * RATE)
    out = np.zeros(n, RUNQ_EVENT)
    ts = 10**12 + np.cumsum(rng.exponential(1e9 / RATE, n)).astype(np.int64)
    back = rng.random(n) < 0.1                      # the other CPU's record, a little older
    ts[back] -= rng.integers(0, 4_000, int(back.sum()))
    out["ts_ns"] = ts
    if shape == "ping-pong":
        out["pid"] = 4242
        out["tid"] = 4242 + np.arange(n) % 2
        out["prev_tid"] = 4243 - np.arange(n) % 2
        out["cpu"] = rng.integers(0, 2, n)
        out["delay_ns"] = rng.lognormal(8.5, 0.8, n).astype(np.uint64)
        out["comm"] = b"paced_wakeups"
    else:
        tids = rng.integers(1_000, 1_300, n)
        out["tid"] = tids
        out["pid"] = 1_000 + (tids - 1_000) % 40
        out["prev_tid"] = rng.integers(1_000, 1_300, n)
        out["cpu"] = rng.integers(0, 8, n)
        out["delay_ns"] = rng.lognormal(9, 2, n).astype(np.uint64)
        out["comm"] = COMMS[tids % len(COMMS)]
    return out


def submitters_of(runq: np.ndarray) -> np.ndarray:
    """Device events of a tenth of the threads: Streams learns them as
    threads that do GPU work."""
    tids = np.unique(runq["tid"])[::10]
    dev = np.zeros(len(tids), device_stream.DEV_EVENT)
    dev["tid"] = tids
    dev["kind"] = device_stream.KIND_IDS["launch"]
    return dev


def run(shape: str, seconds: float, submitters: bool) -> dict:
    runq = events(shape, seconds)
    config = DaemonConfig()
    streams = Streams(config, p99_detector(config.p99), act=lambda anomalies: None)
    if submitters:
        streams.submitters.learn(submitters_of(runq))
    threads = ThreadProcesses()
    batches = [runq[i:i + BATCH].copy() for i in range(0, len(runq), BATCH)]
    began = time.process_time()
    for batch in batches:
        threads.fill(batch)
        streams.batch("cpu", batch, [])
    cpu = time.process_time() - began
    ring = streams.runq_ring
    return {"ns_per_event": cpu / len(runq) * 1e9, "ring_bytes_per_record": ring.nbytes / len(ring)}


def recording_batches(path, batch_ms: float):
    """The run-queue and device events of a recording, each in time order,
    cut into windows of `batch_ms`: [(window end ns, runq, device)], and
    the op-name rows the recording learnt."""
    from mmtrace.agent.recording.file_format import read_recording
    rec = read_recording(path)
    streams = {}
    for name in ("cpu.runq", "dev.event"):
        ev = rec.events[name]
        streams[name] = ev[np.argsort(ev["ts_ns"], kind="stable")]
    starts = [int(ev["ts_ns"][0]) for ev in streams.values() if len(ev)]
    ends = [int(ev["ts_ns"][-1]) for ev in streams.values() if len(ev)]
    step = int(batch_ms * 1e6)
    edges = np.arange(min(starts), max(ends) + step, step)
    cut = {name: np.searchsorted(ev["ts_ns"].astype(np.int64), edges)
           for name, ev in streams.items()}
    windows = [(int(edges[i + 1]), *(streams[name][cut[name][i]:cut[name][i + 1]].copy()
                                     for name in ("cpu.runq", "dev.event")))
               for i in range(len(edges) - 1)]
    names = [row for doc in rec.meta for row in (doc.get("op_names") or ())]
    return windows, names


def replay(windows, names) -> tuple[float, Streams]:
    """CPU seconds of Streams (and the tick's detectors) over `windows`."""
    config = DaemonConfig()
    p99 = p99_detector(config.p99)
    found = []
    streams = Streams(config, p99, act=found.extend)
    streams.found = found
    windows = [(end, runq.copy(), dev.copy()) for end, runq, dev in windows]
    began = time.process_time()
    for i, (end, runq, dev) in enumerate(windows):
        if len(runq):
            streams.batch("cpu", runq, [])
        if len(dev):
            streams.batch("dev", dev, names if i == 0 else [])
        found.extend(p99.advance(end - int(config.p99.window_s * 1e9 / 4)))
        found.extend(streams.failures.tick(end))
        found.extend(streams.launchers.tick(end))
    return time.process_time() - began, streams


def digest(streams: Streams) -> str:
    """What the replay told, hashed: equal where no figure changed."""
    snap = streams.counts.snapshot()
    hists = lambda hs: {k: (h.counts.tolist(), round(h.sum, 9)) for k, h in hs.items()}  # noqa: E731
    told = {"anomalies": streams.found,
            "submissions": sorted(map(str, snap.submissions.items())),
            "failures": sorted(map(str, snap.failures.items())),
            "sync_wait": hists(snap.sync_wait), "retire": hists(snap.submit_to_retire),
            "processes": {p: (v.name, v.hist.counts.tolist()) for p, v in snap.processes.items()},
            "p99": {n: (streams.p99.state(n), streams.p99.baseline(n))
                    for n in streams.series_keys},
            "launchers": streams.launchers.table(),
            "runq_ring": hashlib.md5(streams.runq_ring.window().tobytes()).hexdigest(),
            "device_ring": hashlib.md5(streams.aligner.window().tobytes()).hexdigest()}
    return hashlib.md5(json.dumps(told, sort_keys=True, default=str).encode()).hexdigest()


def main_recording(args):
    windows, names = recording_batches(args.recording, args.batch_ms)
    events = sum(len(r) + len(d) for _, r, d in windows)
    span_s = (windows[-1][0] - windows[0][0]) / 1e9 + args.batch_ms / 1e3
    got = [replay(windows, names) for _ in range(args.rounds)]
    cpu = statistics.median(g[0] for g in got)
    streams = got[-1][1]
    held = {name: ring.nbytes / max(len(ring), 1)
            for name, ring in (("runq", streams.runq_ring), ("device", streams.aligner._ring))}
    print(f"{events:,} events over {span_s:.1f} s in batches of {args.batch_ms:g} ms: "
          f"{cpu:.3f} s CPU, {100 * cpu / span_s:.2f} % of a core, {cpu / events * 1e9:.0f} ns "
          f"an event (median of {', '.join(f'{g[0]:.3f}' for g in got)})")
    print(f"held: run-queue {held['runq']:.3f} B/record, device {held['device']:.3f} B/record; "
          f"digest {digest(streams)} ({len(streams.found)} anomalies)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--submitters", action="store_true")
    ap.add_argument("--recording", help="replay this recording's streams instead")
    ap.add_argument("--batch-ms", type=float, default=250.0)
    args = ap.parse_args()
    heap.keep_large_blocks_mapped()                 # as the daemon runs
    if args.recording:
        main_recording(args)
        return
    for shape in ("ping-pong", "host"):
        got = [run(shape, args.seconds, args.submitters) for _ in range(args.rounds)]
        ns = statistics.median(g["ns_per_event"] for g in got)
        print(f"{shape:10s} {ns:7.1f} ns/event  ring {got[0]['ring_bytes_per_record']:.2f} B/record"
              f"  ({args.seconds:g} s at {RATE:,}/s in batches of {BATCH:,}, median of "
              f"{args.rounds})")


if __name__ == "__main__":
    main()
