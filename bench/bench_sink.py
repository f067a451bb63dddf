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

Usage: .venv/bin/python bench/bench_sink.py [--seconds 30] [--rounds 3] [--submitters]
"""

import argparse
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--submitters", action="store_true")
    args = ap.parse_args()
    heap.keep_large_blocks_mapped()                 # as the daemon runs
    for shape in ("ping-pong", "host"):
        got = [run(shape, args.seconds, args.submitters) for _ in range(args.rounds)]
        ns = statistics.median(g["ns_per_event"] for g in got)
        print(f"{shape:10s} {ns:7.1f} ns/event  ring {got[0]['ring_bytes_per_record']:.2f} B/record"
              f"  ({args.seconds:g} s at {RATE:,}/s in batches of {BATCH:,}, median of "
              f"{args.rounds})")


if __name__ == "__main__":
    main()
