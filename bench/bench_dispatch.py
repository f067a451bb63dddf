"""Dispatcher overhead per request, throughput, and the cost of the agent
link, with a no-op handler.

    python bench/bench_dispatch.py [--requests 20000] [--throughput 60000]

Overhead: one thread submits one text request at a time (batch 1, one
device) and waits for its result. For each request it takes
CLOCK_MONOTONIC stamps at submit() entry, at submit() return and when
result() returns; the handler stamps its own entry and exit. Reported:

* overhead = (result() returned - submit() entered) - time inside the
  handler: everything the dispatcher adds end to end, the two thread
  hand-offs (caller -> device worker -> caller) included;
* hand-off = handler entered - submit() entered;
* submit() = the call alone, what the request path pays before it can
  go on.

The same runs with submit_async() from an asyncio loop, and with the
agent link connected to a real HintServer polled in a child process (one
`sample` message per request). Throughput: 4 threads submit a mixed load
(1 text : 3 vision) to 2 devices, all at once, then wait for every result.

Writes bench/out/dispatch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mmtrace.dispatch import Dispatcher

LISTENER = """
import json, select, sys
from mmtrace.agent.hint_socket import HintServer
server = HintServer(sys.argv[1])
print("ready", flush=True)
counts = {}
while not select.select([sys.stdin], [], [], 0)[0]:
    for _, m in server.poll(0.01):
        counts[m["type"]] = counts.get(m["type"], 0) + 1
server.close()
print(json.dumps(counts), flush=True)
"""


class NoOp:
    """The handler: stamps entry and exit, does nothing else."""

    def __init__(self):
        self.stamps = []

    def __call__(self, device, modality, items):
        t_in = time.monotonic_ns()
        out = [None] * len(items)
        self.stamps.append((t_in, time.monotonic_ns()))
        return out


def quantiles_us(values_ns: list[int]) -> dict:
    v = sorted(values_ns)
    return {"median_us": statistics.median(v) / 1e3, "p99_us": v[int(0.99 * (len(v) - 1))] / 1e3,
            "mean_us": statistics.fmean(v) / 1e3}


def overhead(socket_path, n: int, warmup: int) -> dict:
    handler = NoOp()
    d = Dispatcher(["dev0"], handler, socket=socket_path)
    try:
        if socket_path is not None:
            deadline = time.monotonic() + 5
            while not d.state()["agent"]["connected"] and time.monotonic() < deadline:
                time.sleep(0.01)
        rows = []
        for i in range(warmup + n):
            t0 = time.monotonic_ns()
            f = d.submit(i, modality="text")
            t1 = time.monotonic_ns()
            f.result()
            t2 = time.monotonic_ns()
            if i >= warmup:
                rows.append((t0, t1, t2))
        stamps = handler.stamps[warmup:]
        time.sleep(0.1)                       # let the link flush the last samples
        agent = d.state()["agent"]
    finally:
        d.close()
    return {
        "overhead": quantiles_us([(t2 - t0) - (h1 - h0) for (t0, _, t2), (h0, h1) in zip(rows, stamps)]),
        "hand_off": quantiles_us([h0 - t0 for (t0, _, _), (h0, _) in zip(rows, stamps)]),
        "submit_call": quantiles_us([t1 - t0 for t0, t1, _ in rows]),
        "agent": agent,
    }


def overhead_async(n: int, warmup: int) -> dict:
    handler = NoOp()
    d = Dispatcher(["dev0"], handler, socket=None)

    async def run():
        rows = []
        for i in range(warmup + n):
            t0 = time.monotonic_ns()
            await d.submit_async(i, modality="text")
            if i >= warmup:
                rows.append((t0, time.monotonic_ns()))
        return rows
    try:
        rows = asyncio.run(run())
    finally:
        d.close()
    stamps = handler.stamps[warmup:]
    return {"overhead": quantiles_us([(t1 - t0) - (h1 - h0) for (t0, t1), (h0, h1) in zip(rows, stamps)])}


def throughput(socket_path, total: int, threads: int = 4) -> dict:
    d = Dispatcher(["dev0", "dev1"], lambda device, modality, items: [None] * len(items), socket=socket_path)
    per = total // threads

    def client():
        futures = [d.submit(i, modality="text" if i % 4 == 0 else "vision") for i in range(per)]
        for f in futures:
            f.result()
    try:
        workers = [threading.Thread(target=client) for _ in range(threads)]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
        s = d.state()
    finally:
        d.close()
    return {"requests": per * threads, "wall_s": wall, "requests_per_s": per * threads / wall,
            "batches": s["counts"]["batches"], "dropped_reports": (s["agent"] or {}).get("dropped")}


def with_listener(body):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mmtrace.sock"
        child = subprocess.Popen([sys.executable, "-c", LISTENER, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            result = body(path)
        finally:
            child.stdin.close()
            counts = json.loads(child.stdout.readline() or "{}")
            child.wait(10)
        return result, counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000, help="closed-loop requests per overhead run")
    parser.add_argument("--warmup", type=int, default=1000)
    parser.add_argument("--throughput", type=int, default=60000, help="requests per throughput run")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "dispatch.json")
    args = parser.parse_args(argv)

    result = {"host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "kernel": platform.release()}}
    result["no_agent"] = overhead(None, args.requests, args.warmup)
    result["asyncio_no_agent"] = overhead_async(args.requests, args.warmup)
    result["agent_connected"], counts = with_listener(lambda p: overhead(p, args.requests, args.warmup))
    result["agent_connected"]["listener_received"] = counts
    result["throughput_no_agent"] = throughput(None, args.throughput)
    result["throughput_agent_connected"], counts = with_listener(lambda p: throughput(p, args.throughput))
    result["throughput_agent_connected"]["listener_received"] = counts

    for name in ("no_agent", "asyncio_no_agent", "agent_connected"):
        for part, q in result[name].items():
            if isinstance(q, dict) and "median_us" in q:
                print(f"{name:18s} {part:12s} median {q['median_us']:7.1f} us   p99 {q['p99_us']:7.1f} us")
    for name in ("throughput_no_agent", "throughput_agent_connected"):
        t = result[name]
        print(f"{name:28s} {t['requests_per_s']:9.0f} requests/s  ({t['batches']} batches)")
    print("listener received:", result["agent_connected"]["listener_received"],
          result["throughput_agent_connected"]["listener_received"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
