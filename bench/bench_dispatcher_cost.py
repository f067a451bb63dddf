"""What a dispatcher costs the daemon: daemons side by side, each scoped to
a sleeping process of its own (so that the socket is all they serve), each
with a dispatcher of its own at a given request rate, as the soak runs one
(bench/soak.py's Requests: a Dispatcher submitting vision and text in turn,
its latency samples sent to the daemon's hint socket).

Configurations, all started at once and measured over the same windows:
- none: the daemon alone (quiet: it wakes every 2 s);
- low: a dispatcher at --low requests a second (connected, the daemon is
  not quiet: it ticks four times a second);
- busy: a dispatcher at --rate requests a second;
- with --baseline-rev REV: busy again, that revision's daemon and
  dispatcher (a `git archive` of it on PYTHONPATH, as bench_recording's
  baseline_env makes).

Each daemon's CPU comes from its threads' /proc/PID/task/*/schedstat
(nanoseconds), --rounds windows of --window seconds after --warmup; the
medians, and busy's ratio to the baseline, are printed and written to
bench/out/dispatcher_cost.json.

Needs root (the daemon loads its programs). Usage:
    .venv/bin/python bench/bench_dispatcher_cost.py [--rate 100] [--low 2]
        [--window 30] [--rounds 4] [--warmup 15] [--baseline-rev REV]
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

from bench_footprint import cpu_ns  # noqa: E402
from bench_recording import baseline_env  # noqa: E402

OUT = ROOT / "bench" / "out" / "dispatcher_cost.json"

# A dispatcher in a process of its own, importing the tree under test (its
# PYTHONPATH): its flush interval is part of what is measured.
DISPATCHER = """
import sys, time
sys.path.insert(0, sys.argv[3])
from soak import Requests
requests = Requests(sys.argv[1], int(sys.argv[2]))
sys.stdin.readline()
print(requests.stop()["completed"], flush=True)
"""


class Consumer:
    """One daemon, its sleeping process, and its dispatcher (rate 0: none)."""

    def __init__(self, name: str, rate: int, env: dict, where: Path):
        self.name, self.rate, self.env = name, rate, env
        self.dir = where / name
        self.dir.mkdir()
        self.sleeper = subprocess.Popen(["sleep", "100000"])
        self.log = open(self.dir / "daemon.log", "w")
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "mmtrace.agent", "run", "--state-dir", str(self.dir / "state"),
             "--socket", str(self.dir / "hint.sock"), "--metrics-address", "off",
             "--pid", str(self.sleeper.pid)],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=where)
        self.dispatcher = None
        self.cpu: list[float] = []

    def wait_tracing(self, timeout_s: float = 120):
        deadline = time.monotonic() + timeout_s
        while "tracing" not in (self.dir / "daemon.log").read_text():
            if self.daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{self.name}: the daemon did not start:\n"
                                 + (self.dir / "daemon.log").read_text())
            time.sleep(0.2)

    def start_dispatcher(self):
        if self.rate:
            self.dispatcher = subprocess.Popen(
                [sys.executable, "-c", DISPATCHER, str(self.dir / "hint.sock"), str(self.rate),
                 str(ROOT / "bench")], env=self.env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True)

    def stop(self) -> int | None:
        completed = None
        if self.dispatcher is not None:
            completed = int(self.dispatcher.communicate("\n", timeout=30)[0].split()[-1])
        self.daemon.terminate()
        self.daemon.wait(30)
        self.sleeper.kill()
        self.sleeper.wait()
        self.log.close()
        return completed


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=int, default=100, help="the busy dispatcher's requests/s")
    p.add_argument("--low", type=int, default=2, help="the low dispatcher's requests/s")
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup", type=float, default=15.0)
    p.add_argument("--baseline-rev", help="git revision measured side by side (busy)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root: the daemon loads its eBPF programs")
    where = Path(tempfile.mkdtemp(prefix="mmtrace-dispatcher-cost-"))
    this_env = {**os.environ}
    plan = [("none", 0, this_env), ("low", args.low, this_env), ("busy", args.rate, this_env)]
    if args.baseline_rev:
        plan.append(("baseline busy", args.rate, baseline_env(args.baseline_rev, where / "tree")))
    consumers = [Consumer(name, rate, env, where) for name, rate, env in plan]
    try:
        for c in consumers:
            c.wait_tracing()
        for c in consumers:
            c.start_dispatcher()
        time.sleep(args.warmup)
        for r in range(args.rounds):
            before = {c.name: cpu_ns(c.daemon.pid) for c in consumers}
            began = time.monotonic()
            time.sleep(args.window)
            seconds = time.monotonic() - began
            for c in consumers:
                c.cpu.append((cpu_ns(c.daemon.pid) - before[c.name]) / seconds / 1e7)
            print(f"round {r + 1}: " + ", ".join(f"{c.name} {c.cpu[-1]:.3f} %"
                                                for c in consumers), flush=True)
    finally:
        completed = {c.name: c.stop() for c in consumers}
    result = {"rate": args.rate, "low": args.low, "window_s": args.window, "rounds": args.rounds,
              "baseline_rev": args.baseline_rev, "completed": completed,
              "cpu_percent": {c.name: round(statistics.median(c.cpu), 3) for c in consumers}}
    if args.baseline_rev:
        result["busy_over_baseline"] = round(
            result["cpu_percent"]["busy"] / result["cpu_percent"]["baseline busy"], 3)
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
