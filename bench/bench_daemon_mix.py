"""The daemon's CPU on the soak's mix, this tree beside a baseline
revision, with no profiler attached.

The soak's loads run once (bench/soak.py: a paced thread pair at --rate
run-queue events a second, launch_loop on the real libcudart, ascend_loop
on the stand-ins); --copies daemons of this tree and as many of
--baseline-rev (a `git archive` of it on PYTHONPATH, as bench_recording's
baseline_env makes) trace them at once, started in alternating order.
On this 2-vCPU host a daemon's CPU depends on where it sits among the
others (the same tree read 3.5 and 4.7 % side by side), so each tree has
copies in several places, and a second run with the order swapped
(--swap) evens it out.

Per daemon, over --rounds windows of --window seconds after --warmup:
CPU from its threads' /proc/PID/task/*/schedstat, minor page faults a
second (pages touched afresh: kernel CPU no Python profile shows) and
anonymous RSS. Printed: the medians per daemon, the mean per tree and
the ratio, also written to bench/out/daemon_mix.json.

Needs root. Usage:
    .venv/bin/python bench/bench_daemon_mix.py --baseline-rev REV [--copies 2]
        [--rounds 4] [--window 30] [--warmup 20] [--swap]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

import native  # noqa: E402
from bench_footprint import cpu_ns, minor_faults  # noqa: E402
from bench_pipeline import anon_mb  # noqa: E402
from bench_recording import baseline_env  # noqa: E402
from profile_daemon import start_daemon  # noqa: E402
from soak import soak_loops  # noqa: E402

OUT = ROOT / "bench" / "out" / "daemon_mix.json"
THIS = "this"           # this tree's daemons are named this#1, this#2, ...


def alive(daemons: dict):
    """Raise if a daemon has exited: its CPU would read as zero."""
    for name, d in daemons.items():
        if d.poll() is not None:
            raise SystemExit(f"bench_daemon_mix: the daemon {name} exited with {d.returncode}")


def measure(daemons: dict, rounds: int, window_s: float) -> dict:
    """Per daemon, per round: (CPU % of a core, faults a second, anonymous MB)."""
    out = {name: [] for name in daemons}
    for _ in range(rounds):
        alive(daemons)
        cpu0 = {n: cpu_ns(d.pid) for n, d in daemons.items()}
        flt0 = {n: minor_faults(d.pid) for n, d in daemons.items()}
        began = time.monotonic()
        time.sleep(window_s)
        took = time.monotonic() - began
        alive(daemons)
        for n, d in daemons.items():
            out[n].append(((cpu_ns(d.pid) - cpu0[n]) / took / 1e7,
                           (minor_faults(d.pid) - flt0[n]) / took, anon_mb(d.pid)))
        print("  ".join(f"{n} {v[-1][0]:.2f}%" for n, v in out.items()), flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline-rev", required=True, help="git revision beside this tree")
    p.add_argument("--copies", type=int, default=2, help="daemons of each tree")
    p.add_argument("--rate", type=int, default=20_000, help="run-queue events a second")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--warmup", type=float, default=20.0)
    p.add_argument("--swap", action="store_true", help="the baseline's daemons start first")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if args.baseline_rev == THIS:
        p.error(f"--baseline-rev names a revision; {THIS!r} is this tree's label")
    binary = native.build(ROOT / "bench" / "paced_wakeups.c", flags=["-pthread"])
    pacer = subprocess.Popen([str(binary), "0", str(args.rate / 2), "stdin"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert pacer.stdout.readline().startswith("ready")
    # Paced from now: long enough for every daemon's start (each up to 120 s).
    pacer.stdin.write(f"{args.warmup + args.rounds * args.window + 300 * args.copies}\n")
    pacer.stdin.flush()
    daemons, loops = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        try:
            loops, pids, extra = soak_loops(tmp)
            trees = [(THIS, dict(os.environ)),
                     (args.baseline_rev, baseline_env(args.baseline_rev, tmp / "baseline"))]
            if args.swap:
                trees.reverse()
            for copy in range(args.copies):
                for tree, env in trees:
                    name = f"{tree}#{copy + 1}"
                    daemons[name] = start_daemon([pacer.pid, *pids], tmp / f"d-{len(daemons)}",
                                                 env, extra)
                    alive({name: daemons[name]})      # it ended before it traced
            for loop in loops:
                loop.start()
            time.sleep(args.warmup)
            rounds = measure(daemons, args.rounds, args.window)
        finally:
            for d in daemons.values():
                d.terminate()
            for d in daemons.values():
                try:
                    d.wait(60)
                except subprocess.TimeoutExpired:
                    d.kill()
                    d.wait()
            for loop in loops:
                loop.stop()
            pacer.kill()
            pacer.wait(10)
    per_daemon = {n: {"cpu_percent": statistics.median(r[0] for r in v),
                      "faults_per_s": statistics.median(r[1] for r in v),
                      "anon_mb_max": max(r[2] for r in v)} for n, v in rounds.items()}
    per_tree = {}
    for tree in (THIS, args.baseline_rev):
        mine = [v for n, v in per_daemon.items() if n.rpartition("#")[0] == tree]
        per_tree[tree] = {k: statistics.mean(m[k] for m in mine) for k in mine[0]}
    ratio = per_tree[THIS]["cpu_percent"] / per_tree[args.baseline_rev]["cpu_percent"]
    for n, v in per_daemon.items():
        print(f"{n:<24} CPU {v['cpu_percent']:.2f} %  faults/s {v['faults_per_s']:.0f}  "
              f"anon max {v['anon_mb_max']:.1f} MB")
    for tree, v in per_tree.items():
        print(f"mean {tree:<19} CPU {v['cpu_percent']:.2f} %  faults/s {v['faults_per_s']:.0f}"
              f"  anon max {v['anon_mb_max']:.1f} MB")
    print(f"this tree / {args.baseline_rev}: {ratio:.2f}x CPU")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"baseline_rev": args.baseline_rev, "swap": args.swap,
                                    "rate": args.rate, "per_daemon": per_daemon,
                                    "per_tree": per_tree, "cpu_ratio": ratio,
                                    "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
