"""The idle daemon's CPU against the number of processes running, side by
side with another revision in one run.

    python bench/bench_idle.py [--processes 65 200] [--seconds 30] [--warmup 10]
                               [--baseline-rev REV] [--rounds 2] [--scoped]

For each count, enough `sleep` processes are started that the host runs
that many (counted from /proc; the host's own are part of it), then
`mmtrace run` with its defaults (bench_footprint.Daemon) idles for --warmup
and is measured over --seconds: CPU (% of one core, /proc/PID/stat),
RSS, and the run-queue events a second it drained. This tree and
--baseline-rev run at once and are measured over the same window: the
host's own load (which the daemons trace: its switches, its CUDA
processes) varied 50-fold between rounds taken one after the other on a
shared host. The daemons start first one, then the other, in turn from
round to round (use an even --rounds). Idle discovery used to read a
fifth of the processes' maps every poll: its cost grew with their number.

With --scoped, each daemon is scoped to one sleeping process of its own
(`mmtrace run --pid P`, as bench_pipeline runs it): the quiet daemon, one
wake-up every QUIET_WAIT_S, whose every step runs on cold caches. CPU is also
given from the threads' schedstat (ns), which at a fraction of a percent
is finer than /proc/PID/stat's clock ticks. Needs root. Figures go to
bench/out/idle.json.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from bench_footprint import Daemon, cpu_ns  # noqa: E402
from bench_recording import baseline_env, write_out  # noqa: E402
from mmtrace.agent.daemon.loop import QUIET_WAIT_S  # noqa: E402


def processes_running() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


# The floor: this interpreter, numpy loaded, waking as often as a quiet
# daemon (loop.QUIET_WAIT_S) and doing nothing. On this host the first
# steps after a sleep run slowly, in proportion to the sleep and to the
# memory they touch (waking once a second, a C program used 0.06 % of a
# core; Python 0.24 % doing nothing, 1.1 % with three numpy calls on a
# small array): what no change to the daemon's tick can remove.
FLOOR_PROGRAM = f"import time, numpy\nwhile True:\n    time.sleep({QUIET_WAIT_S})\n"


def floor_cpu(pid: int, warmup_s: float, seconds: float) -> dict:
    time.sleep(warmup_s)
    t0, n0 = time.monotonic(), cpu_ns(pid)
    time.sleep(seconds)
    return {"cpu_percent_schedstat": round((cpu_ns(pid) - n0) / 1e9 / (time.monotonic() - t0)
                                           * 100, 3)}


def idle(envs: dict, warmup_s: float, seconds: float, scoped: bool = False) -> dict:
    """Each environment's daemon, all started first, then measured together
    with the floor (FLOOR_PROGRAM); `scoped`: each daemon to a sleeping
    process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        daemons, sleepers = {}, []
        floor = subprocess.Popen([sys.executable, "-c", FLOOR_PROGRAM])
        sleepers.append(floor)
        try:
            for which, env in envs.items():
                (Path(tmp) / which).mkdir()
                args = ()
                if scoped:
                    sleepers.append(subprocess.Popen(["sleep", "3600"]))
                    args = ("--pid", str(sleepers[-1].pid))
                daemons[which] = Daemon(Path(tmp) / which, env, args)
            with ThreadPoolExecutor(len(daemons) + 1) as pool:
                measured = {which: pool.submit(d.measure, warmup_s, seconds)
                            for which, d in daemons.items()}
                at_floor = pool.submit(floor_cpu, floor.pid, warmup_s, seconds)
                out = {**{which: {"tracing_s": round(daemons[which].tracing_s, 2), **f.result()}
                          for which, f in measured.items()}, "floor": at_floor.result()}
            # Stopped one at a time, at whatever point of its sleep each is:
            # how long an operator's `systemctl stop` waits.
            for which in measured:
                out[which]["stop_s"] = round(daemons.pop(which).stop(), 3)
            return out
        finally:
            for d in daemons.values():
                d.stop()
            for s in sleepers:
                s.kill()
                s.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[65, 200])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline-rev", help="git revision to run side by side")
    ap.add_argument("--scoped", action="store_true",
                    help="each daemon scoped to one sleeping process (--pid)")
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
                # Started in turn, first one then the other: the daemon started
                # first read up to twice the CPU of the second, the same tree.
                order = dict(list(envs.items())[::-1 if round_ % 2 else 1])
                measured = idle(order, opts.warmup, opts.seconds, opts.scoped)
                floor = measured.pop("floor")["cpu_percent_schedstat"]
                for which, r in measured.items():
                    r.update(target=count, processes=processes_running(), implementation=which,
                             round=round_, scoped=opts.scoped, floor_cpu_percent=floor)
                    results.append(r)
                    print(f"{r['processes']:5d} processes  {which:<9} CPU {r['cpu_percent']:5.2f} %"
                          f" (schedstat {r['cpu_percent_schedstat']:.3f} %, floor {floor:.3f} %)"
                          f"  RSS {r['rss_mb']:6.1f} MB  run-queue events {r['runq_events_per_s']}/s"
                          f"  stopped in {r['stop_s']:.2f} s",
                          flush=True)
        finally:
            for s in sleepers:
                s.kill()
                s.wait()
    print("medians (CPU %, schedstat; seconds from SIGTERM to exit):")
    for count in sorted(opts.processes):
        def median(field, which=None):
            return statistics.median(r[field] for r in results if r["target"] == count
                                     and which in (None, r["implementation"]))
        row = {which: median("cpu_percent_schedstat", which) for which in envs}
        floor = median("floor_cpu_percent")
        stops = {which: median("stop_s", which) for which in envs}
        print(f"  {count:5d} processes: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items())
              + f"  floor (Python waking every {QUIET_WAIT_S:g} s) {floor:.3f}"
              + "  stop " + "  ".join(f"{k} {v:.2f} s" for k, v in stops.items()))
    write_out("idle.json", results)


if __name__ == "__main__":
    main()
