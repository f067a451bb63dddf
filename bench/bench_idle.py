"""The idle daemon's CPU against the number of processes running, side by
side with another revision in one run.

    python bench/bench_idle.py [--processes 65 200] [--seconds 30] [--warmup 10]
                               [--baseline-rev REV] [--rounds 2]

For each count, enough `sleep` processes are started that the host runs
that many (counted from /proc; the host's own are part of it), then
`mmtrace run` with its defaults (bench_footprint.Daemon) idles for --warmup
and is measured over --seconds: CPU (% of one core, /proc/PID/stat),
RSS, and the run-queue events a second it drained. This tree and
--baseline-rev run at once and are measured over the same window: the
host's own load (which the daemons trace: its switches, its CUDA
processes) varied 50-fold between rounds taken one after the other on a
shared host. Idle discovery used to read a fifth of the processes' maps
every poll: its cost grew with their number. Needs root. Figures go to
bench/out/idle.json.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_footprint import Daemon  # noqa: E402
from bench_recording import baseline_env, write_out  # noqa: E402


def processes_running() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def idle(envs: dict, warmup_s: float, seconds: float) -> dict:
    """Each environment's daemon, all started first, then measured together."""
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {}
        try:
            for which, env in envs.items():
                (Path(tmp) / which).mkdir()
                daemons[which] = Daemon(Path(tmp) / which, env)
            with ThreadPoolExecutor(len(daemons)) as pool:
                measured = {which: pool.submit(d.measure, warmup_s, seconds)
                            for which, d in daemons.items()}
                return {which: {"tracing_s": round(daemons[which].tracing_s, 2), **f.result()}
                        for which, f in measured.items()}
        finally:
            for d in daemons.values():
                d.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[65, 200])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-rev", help="git revision to run side by side")
    opts = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    envs = {"this": dict(os.environ)}
    if opts.baseline_rev:
        envs["baseline"] = baseline_env(opts.baseline_rev, Path(tmp.name))
    results = []
    for count in sorted(opts.processes):
        sleepers = []
        while processes_running() < count:
            sleepers.append(subprocess.Popen(["sleep", "3600"]))
        try:
            for round_ in range(opts.rounds):
                for which, r in idle(envs, opts.warmup, opts.seconds).items():
                    r.update(target=count, processes=processes_running(), implementation=which,
                             round=round_)
                    results.append(r)
                    print(f"{r['processes']:5d} processes  {which:<9} CPU {r['cpu_percent']:5.2f} %"
                          f"  RSS {r['rss_mb']:6.1f} MB  run-queue events {r['runq_events_per_s']}/s",
                          flush=True)
        finally:
            for s in sleepers:
                s.kill()
                s.wait()
    print("medians (CPU %):")
    for count in sorted(opts.processes):
        row = {which: statistics.median(r["cpu_percent"] for r in results
                                        if r["implementation"] == which
                                        and r["target"] == count)
               for which in envs}
        print(f"  {count:5d} processes: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
    write_out("idle.json", results)


if __name__ == "__main__":
    main()
