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
Hint delivery: the child broadcasts hints one at a time; each is timed
from its issued_ns to the dispatcher's applied_ns.

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
import json, select, sys, time
from mmtrace.agent.socket.hint_socket import HintServer
server = HintServer(sys.argv[1])
print("ready", flush=True)
counts, sent = {}, 0
while True:
    if select.select([sys.stdin], [], [], 0)[0]:
        if not sys.stdin.readline():
            break
        sent += 1
        server.broadcast({"v": 1, "type": "hint", "id": str(sent), "kind": "modality_batch",
                          "target": "vision", "value": 2 + sent % 2, "ttl_s": 5, "reason": "bench",
                          "evidence": {}, "issued_ns": time.monotonic_ns()})
    for _, m in server.poll(0.001):
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


def hint_delivery(path, child, n: int) -> dict:
    """Hints broadcast by the agent's HintServer (a child process): from
    its issued_ns to the moment the dispatcher applied it (applied_ns in
    state(); both CLOCK_MONOTONIC, which every process shares)."""
    d = Dispatcher(["dev0"], lambda device, modality, items: [None] * len(items), socket=path)
    delays = []
    try:
        deadline = time.monotonic() + 5
        while not d.state()["agent"]["connected"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)                 # subscribed
        for i in range(1, n + 1):
            child.stdin.write("hint\n")
            child.stdin.flush()
            deadline = time.monotonic() + 2
            while d.state()["hints_applied"] < i and time.monotonic() < deadline:
                time.sleep(0.0005)
            (h,) = d.state()["hints"]
            delays.append(h["applied_ns"] - h["issued_ns"])
    finally:
        d.close()
    delays.sort()
    return {"hints": n, "median_ms": statistics.median(delays) / 1e6,
            "p99_ms": delays[int(0.99 * (len(delays) - 1))] / 1e6, "max_ms": delays[-1] / 1e6}


def with_listener(body):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mmtrace.sock"
        child = subprocess.Popen([sys.executable, "-c", LISTENER, str(path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            result = body(path, child)
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
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the overhead runs")
    parser.add_argument("--hints", type=int, default=200, help="hints timed from broadcast to applied")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out" / "dispatch.json")
    args = parser.parse_args(argv)

    result = {"host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "kernel": platform.release()}}
    # Overhead rounds interleave the three set-ups, so that a busy spell of
    # a shared host falls on all of them alike.
    rounds = {"no_agent": [], "asyncio_no_agent": [], "agent_connected": []}
    for _ in range(args.rounds):
        rounds["no_agent"].append(overhead(None, args.requests, args.warmup))
        rounds["asyncio_no_agent"].append(overhead_async(args.requests, args.warmup))
        run, counts = with_listener(lambda p, _: overhead(p, args.requests, args.warmup))
        run["listener_received"] = counts
        rounds["agent_connected"].append(run)
        print("load average", os.getloadavg())
    result["overhead_rounds"] = rounds
    for name, runs in rounds.items():
        best = sorted(runs, key=lambda r: r["overhead"]["median_us"])[len(runs) // 2]
        result[name] = best                  # the round with the median median
    result["throughput_no_agent"] = throughput(None, args.throughput)
    result["throughput_agent_connected"], counts = with_listener(lambda p, _: throughput(p, args.throughput))
    result["throughput_agent_connected"]["listener_received"] = counts

    result["hint_delivery"], _ = with_listener(lambda p, child: hint_delivery(p, child, args.hints))

    for name, runs in rounds.items():
        print(f"{name:18s} overhead medians per round (us):",
              " ".join(f"{r['overhead']['median_us']:.1f}" for r in runs),
              "  p99s:", " ".join(f"{r['overhead']['p99_us']:.1f}" for r in runs))
    for name in ("no_agent", "asyncio_no_agent", "agent_connected"):
        for part, q in result[name].items():
            if isinstance(q, dict) and "median_us" in q:
                print(f"{name:18s} {part:12s} median {q['median_us']:7.1f} us   p99 {q['p99_us']:7.1f} us")
    for name in ("throughput_no_agent", "throughput_agent_connected"):
        t = result[name]
        print(f"{name:28s} {t['requests_per_s']:9.0f} requests/s  ({t['batches']} batches)")
    h = result["hint_delivery"]
    print(f"hint broadcast -> applied: median {h['median_ms']:.2f} ms  p99 {h['p99_ms']:.2f} ms  "
          f"max {h['max_ms']:.2f} ms over {h['hints']} hints")
    print("listener received:", result["agent_connected"]["listener_received"],
          result["throughput_agent_connected"]["listener_received"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
