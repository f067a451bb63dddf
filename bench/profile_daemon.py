"""Where the running daemon's CPU goes, under bench_pipeline's load.

One paced thread pair (bench/paced_wakeups.c: --rate run-queue events a
second) is the daemon's only process in scope (`mmtrace run --pid P`, its
defaults). After --warmup seconds, py-spy (PyPI: pip install py-spy)
samples the daemon for --seconds and the samples are summed per function:
the share of samples in which a function is on the stack (inclusive) and
at its top (self), its line numbers dropped. Waits are not samples (py-spy
leaves idle threads out, and the waits it does not tell are dropped here).

With --soak-mix, the soak's GPU and NPU loops run and are traced too
(bench/soak.py's mix, without its dispatcher and flight recordings).
With --baseline-rev, that revision's daemon runs beside this tree's on
the same processes, sampled over the same seconds, and each one's CPU over
them comes from /proc/PID/stat.

Needs root. Usage:
    .venv/bin/python bench/profile_daemon.py [--rate 20000] [--seconds 60] [--top 25]
        [--baseline-rev REV] [--soak-mix]
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import native  # noqa: E402
from bench_recording import baseline_env  # noqa: E402
from soak import soak_loops  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")

LINE = re.compile(r":\d+\)")
# Frames where a sampled thread waits (py-spy's idle test does not always
# tell a wait in C): their samples are not CPU, and are left out.
WAITS = ("Waiter.wait (", "_PollLikeSelector.select (", "Condition.wait (")


def summarise(raw: str) -> tuple[int, collections.Counter, collections.Counter]:
    """Samples, and per function the samples it is in / at the top of,
    from py-spy's raw (collapsed) output."""
    total, inclusive, own = 0, collections.Counter(), collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [LINE.sub(")", f) for f in stack.split(";")]
        if frames[-1].startswith(WAITS):
            continue
        total += n
        for frame in set(frames[1:] if frames[0].startswith("process ") else frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    return total, inclusive, own


def cpu_s(pid: int) -> float:
    """CPU seconds of process `pid` so far (utime + stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def start_daemon(pids, tmp: Path, env: dict, extra=()) -> subprocess.Popen:
    tmp.mkdir()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "mmtrace.agent", "run",
         *[a for p in pids for a in ("--pid", str(p))],
         "--state-dir", tmp / "state", "--socket", tmp / "hint.sock",
         "--metrics-address", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    for line in daemon.stdout:
        if "tracing:" in line:
            break
    threading.Thread(target=lambda: collections.deque(daemon.stdout, 0), daemon=True).start()
    return daemon


def show(label: str, total: int, inclusive, own, cpu_percent: float, top: int):
    print(f"\n== {label}: daemon CPU {cpu_percent:.2f} % of a core; {total} samples "
          f"off its waits")
    print(f"{'inclusive':>9} {'self':>6}  function")
    for frame, n in inclusive.most_common(top):
        print(f"{n / total:>9.1%} {own[frame] / total:>6.1%}  {frame}")
    print("largest self:")
    for frame, n in own.most_common(12):
        print(f"{n / total:>6.1%}  {frame}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=20_000)
    parser.add_argument("--warmup", type=float, default=35.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--sample-rate", type=int, default=1000, help="py-spy samples a second")
    parser.add_argument("--baseline-rev", help="git revision profiled side by side")
    parser.add_argument("--raw", type=Path, help="keep py-spy's samples in this folder")
    parser.add_argument("--soak-mix", action="store_true",
                        help="the soak's GPU and NPU loops too (bench/soak.py: launch_loop on "
                             "the real libcudart, ascend_loop on the stand-ins), traced")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    binary = native.build(ROOT / "bench" / "paced_wakeups.c", flags=["-pthread"])
    pacer = subprocess.Popen([str(binary), "0", str(args.rate / 2), "stdin"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert pacer.stdout.readline().startswith("ready")
    pacer.stdin.write(f"{args.warmup + args.seconds + 120}\n")     # from the start on
    pacer.stdin.flush()
    daemons, loops = {}, []
    pids, extra = [pacer.pid], []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.soak_mix:
            loops, more, extra = soak_loops(tmp)
            pids += more
        envs = {"this tree": dict(os.environ)}
        if args.baseline_rev:
            envs[args.baseline_rev] = baseline_env(args.baseline_rev, tmp / "baseline")
        raw_dir = args.raw or tmp
        raw_dir.mkdir(parents=True, exist_ok=True)
        try:
            for i, (label, env) in enumerate(envs.items()):
                daemons[label] = start_daemon(pids, tmp / f"d{i}", env, extra)
            for loop in loops:
                loop.start()
            time.sleep(args.warmup)
            before = {label: cpu_s(d.pid) for label, d in daemons.items()}
            spies = {label: subprocess.Popen(
                [spy, "record", "--pid", str(d.pid), "--duration", str(int(args.seconds)),
                 "--rate", str(args.sample_rate), "--format", "raw", "--nonblocking",
                 "--output", str(raw_dir / f"samples-{i}.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for i, (label, d) in enumerate(daemons.items())}
            began = time.monotonic()
            for s in spies.values():
                s.wait()
            took = time.monotonic() - began
            after = {label: cpu_s(d.pid) for label, d in daemons.items()}
            for i, label in enumerate(daemons):
                total, inclusive, own = summarise((raw_dir / f"samples-{i}.txt").read_text())
                show(label, total, inclusive, own,
                     100 * (after[label] - before[label]) / took, args.top)
        finally:
            for d in daemons.values():
                d.terminate()
                d.wait(60)
            for loop in loops:
                loop.stop()
            pacer.kill()
            pacer.wait(10)
    mix = " with the soak's GPU and NPU loops" if args.soak_mix else ""
    print(f"\n{args.seconds:g} s sampled at {args.rate} run-queue events/s{mix}; the daemons "
          f"side by side on the same processes")


if __name__ == "__main__":
    main()
