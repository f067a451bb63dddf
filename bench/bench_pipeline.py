"""Consumer CPU per run-queue event: the daemon, `record` and the bare
drain, side by side in one run, as an operator would run them.

One paced thread pair (bench/paced_wakeups.c, on request: RATE/2 round
trips a second) is the only process in scope of three consumers started
at once, each loading the scheduler program of its own:
- drain: the ring read and nothing else (RingReader through
  LoadedProbes.read every 25 ms, the reader bench_ingest.py measures);
- drain_250ms: the same every 250 ms, the daemon's longest sleep without
  a wake-up from the ring (what its batches are at the rated rate);
- run: `mmtrace run --pid P` (state and socket in a temporary directory,
  metrics on 127.0.0.1:0), the daemon with its defaults;
- record: `mmtrace record --pid P -o FILE`.
Each consumer's CPU comes from its threads' /proc/PID/task/*/schedstat
(nanoseconds; /proc/PID/stat's clock ticks are too coarse for a window
of a consumer at 1 % of a core) and, over all windows together, from
/proc/PID/stat. Events drained in a window are the drain's count (every
consumer sees the same events); at the end the daemon's own count
(mmtrace_kernel_events_total) and record's are checked against it.

After a warm-up at the rate (--warmup, default 35 s: the daemon's rings
fill their 30 s reach), --rounds rounds of a quiet window and a paced
one, --window seconds each, interleaved. Per consumer: ns per event
(CPU in the paced window / events), the marginal ns per event (less the
quiet window's CPU over the same time), the ratios to the drain, the
anonymous RSS at the end of the paced windows and the minor page faults a
second in them (kernel CPU spent on pages touched afresh), medians over
the rounds.

With --baseline-rev REV, that revision's run and record (a `git archive`
of it on PYTHONPATH, as bench_recording's baseline_env makes) are started
beside this tree's, on the same events: the only figures to compare
across revisions on a shared host.

Needs root. Usage: .venv/bin/python bench/bench_pipeline.py [--rate 20000]
[--window 10] [--rounds 3] [--warmup 35] [--baseline-rev REV] [--json] [--out FILE]
"""

import argparse
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import native  # noqa: E402
from bench_footprint import cpu_ns, cpu_ticks, minor_faults  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")
CONSUMERS = ("drain", "drain_250ms", "run", "record")


def drain_child(pid: int, interval_s: float):
    """The bare drain, in a process of its own: every `interval_s` (a wait
    on stdin), what the rings hold; a line on stdin is answered with the
    events read so far; end of input ends it."""
    from mmtrace.agent.kernel import probes
    loaded = probes.load_cpu(probes.ProbeOptions(pids=(pid,), device=False))
    events = 0
    print("ready", flush=True)
    try:
        while True:
            for batch in loaded.read().values():
                events += len(batch)
            ready, _, _ = select.select([sys.stdin], [], [], interval_s)
            if ready:
                if not sys.stdin.readline():
                    break
                print(events, flush=True)
    finally:
        loaded.close()


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """CPU time of each live thread of `pid` by its name, ns."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = f"{(task / 'comm').read_text().strip()}:{task.name}"
            out[name] = out.get(name, 0) + int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def anon_mb(pid: int) -> float:
    m = re.search(r"^RssAnon:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) / 1024 if m else float("nan")


class Consumer:
    def __init__(self, name: str, cmd: list, ready: str, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.ready = ready
        self.lines: list[str] = []

    def wait_ready(self, timeout_s: float = 180):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"{self.name} exited:\n" + "".join(self.lines))
            self.lines.append(line)
            if re.search(self.ready, line):
                return
        raise SystemExit(f"{self.name} not ready in {timeout_s} s:\n" + "".join(self.lines))

    def read_rest(self):
        """What it printed since it became ready (record's and run's logs)."""
        rest = self.proc.communicate(timeout=60)[0]
        self.lines.append(rest)
        return rest


def settle(consumers, limit_s: float = 120, quiet_percent: float = 3.0):
    """Until every consumer uses under quiet_percent of a core for a second
    (the GPU/NPU programs compile in the background after start)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        before = {c.name: cpu_ns(c.proc.pid) for c in consumers}
        time.sleep(1.0)
        busy = {c.name: (cpu_ns(c.proc.pid) - before[c.name]) / 1e7 for c in consumers}
        if all(v < quiet_percent for v in busy.values()):
            return
    print(f"bench_pipeline: consumers still busy after {limit_s} s: {busy}", file=sys.stderr)


class Pacer:
    def __init__(self, rate: int):
        binary = native.build(ROOT / "bench" / "paced_wakeups.c", flags=["-pthread"])
        self.proc = subprocess.Popen([str(binary), "0", str(rate / 2), "stdin"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().startswith("ready")

    def pace(self, seconds: float) -> int:
        self.proc.stdin.write(f"{seconds}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


def window(consumers, drain: Consumer, action) -> dict:
    """CPU of each consumer and the drain's events while `action()` runs."""
    def drained() -> int:
        drain.proc.stdin.write("?\n")
        drain.proc.stdin.flush()
        return int(drain.proc.stdout.readline())

    time.sleep(0.2)             # the last batch of the window before drained
    e0 = drained()
    c0 = {c.name: cpu_ns(c.proc.pid) for c in consumers}
    t0_threads = {c.name: thread_cpu_ns(c.proc.pid) for c in consumers}
    f0 = {c.name: minor_faults(c.proc.pid) for c in consumers}
    t0 = time.monotonic()
    trips = action()
    time.sleep(0.3)             # what the window made is drained within it
    elapsed = time.monotonic() - t0
    c1 = {c.name: cpu_ns(c.proc.pid) for c in consumers}
    t1_threads = {c.name: thread_cpu_ns(c.proc.pid) for c in consumers}
    f1 = {c.name: minor_faults(c.proc.pid) for c in consumers}
    return {"seconds": elapsed, "events": drained() - e0, "trips": trips,
            "cpu_ns": {name: c1[name] - c0[name] for name in c0},
            "minor_faults": {name: f1[name] - f0[name] for name in f0},
            "anon_mb": {c.name: anon_mb(c.proc.pid) for c in consumers},
            "thread_cpu_ns": {name: {t: v - t0_threads[name].get(t, 0) for t, v in
                                     t1_threads[name].items()} for name in t1_threads}}


def scrape_runq_events(address: str) -> int:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    m = re.search(r'^mmtrace_kernel_events_total\{[^}]*counter="runq_events"[^}]*\} (\S+)$',
                  body, re.M)
    return int(float(m.group(1))) if m else -1


def mmtrace_consumers(pid: int, tmp: Path, suffix: str = "", env: dict | None = None) -> list:
    """`run` and `record` (named run{suffix}, record{suffix}), in `tmp`."""
    py = sys.executable
    tmp.mkdir(parents=True, exist_ok=True)
    return [Consumer(f"run{suffix}", [py, "-m", "mmtrace.agent", "run", "--pid", pid,
                                      "--state-dir", tmp / "state", "--socket", tmp / "hint.sock",
                                      "--metrics-address", "127.0.0.1:0"], r"tracing:", env),
            Consumer(f"record{suffix}", [py, "-m", "mmtrace.agent", "record", "--pid", pid,
                                         "-o", tmp / "bench.mmtr"],
                     r"^gpu/npu stream live|^recording", env)]


def bench(rate: int, window_s: float, rounds: int, warmup_s: float,
          baseline_rev: str | None = None) -> dict:
    pacer = Pacer(rate)
    pid = pacer.proc.pid
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        py = sys.executable
        consumers = [
            Consumer("drain", [py, __file__, "--drain-child", pid], r"^ready"),
            Consumer("drain_250ms", [py, __file__, "--drain-child", pid, "--drain-interval",
                                     0.25], r"^ready"),
            *mmtrace_consumers(pid, tmp),
        ]
        if baseline_rev:
            # That revision's run and record beside this tree's, on the same events.
            from bench_recording import baseline_env
            consumers += mmtrace_consumers(pid, tmp / "baseline-run", f"@{baseline_rev}",
                                           baseline_env(baseline_rev, tmp / "baseline"))
        by_name = {c.name: c for c in consumers}
        try:
            for c in consumers:
                c.wait_ready()
            address = next(m.group(1) for line in by_name["run"].lines
                           if (m := re.search(r"metrics on (\S+)/metrics", line)))
            settle(consumers)
            pacer.pace(warmup_s)
            ticks0 = {c.name: cpu_ticks(c.proc.pid) for c in consumers}
            quiet, paced = [], []
            for _ in range(rounds):
                quiet.append(window(consumers, by_name["drain"], lambda: time.sleep(window_s)))
                paced.append(window(consumers, by_name["drain"], lambda: pacer.pace(window_s)))
            ticks = {c.name: cpu_ticks(c.proc.pid) - ticks0[c.name] for c in consumers}
            time.sleep(0.5)
            daemon_events = scrape_runq_events(address)
            baseline_events = {}
            for c in consumers[4:]:
                if c.name.startswith("run@"):
                    baseline_events[c.name] = scrape_runq_events(next(
                        m.group(1) for line in c.lines
                        if (m := re.search(r"metrics on (\S+)/metrics", line))))
            drain = by_name["drain"]
            drain.proc.stdin.write("?\n")
            drain.proc.stdin.flush()
            drain_events = int(drain.proc.stdout.readline())
        finally:
            pacer.close()
            for c in consumers:         # the drain ends at the end of its input
                if c.proc.poll() is None and not c.name.startswith("drain"):
                    c.proc.send_signal(signal.SIGINT)
            for c in consumers:
                c.read_rest()
        totals = {"drain": drain_events, "run": daemon_events, **baseline_events}
        for c in consumers:
            if c.name.startswith("record"):
                totals[c.name] = recorded_events(c)
    return summarise(rate, window_s, quiet, paced, ticks, totals, [c.name for c in consumers])


def recorded_events(record: Consumer) -> int:
    """The events `record` says it wrote (its last progress line)."""
    lines = [line for text in record.lines for line in text.splitlines()
             if line.startswith("recording ")]
    m = re.search(r"events\s+([\d,]+)", lines[-1]) if lines else None
    return int(m.group(1).replace(",", "")) if m else -1


def summarise(rate, window_s, quiet, paced, ticks, totals, names=CONSUMERS) -> dict:
    per = {name: {"ns_per_event": [], "marginal_ns_per_event": [], "quiet_cpu_percent": [],
                  "paced_cpu_percent": [], "anon_mb": [], "faults_per_s": []} for name in names}
    for q, p in zip(quiet, paced):
        for name in names:
            idle_ns = q["cpu_ns"][name] / q["seconds"] * p["seconds"]
            per[name]["ns_per_event"].append(p["cpu_ns"][name] / max(p["events"], 1))
            per[name]["marginal_ns_per_event"].append(
                (p["cpu_ns"][name] - idle_ns) / max(p["events"], 1))
            per[name]["quiet_cpu_percent"].append(q["cpu_ns"][name] / q["seconds"] / 1e7)
            per[name]["paced_cpu_percent"].append(p["cpu_ns"][name] / p["seconds"] / 1e7)
            per[name]["anon_mb"].append(p["anon_mb"][name])
            per[name]["faults_per_s"].append(p["minor_faults"][name] / p["seconds"])
    med = {name: {k: statistics.median(v) for k, v in figures.items()}
           for name, figures in per.items()}
    events = sum(p["events"] for p in paced)
    return {
        "rate_runq_events_per_s": statistics.median(p["events"] / p["seconds"] for p in paced),
        "asked_rate_per_s": rate, "window_s": window_s, "rounds": len(paced),
        "median": med,
        "ratio_to_drain": {name: med[name]["ns_per_event"] / med["drain"]["ns_per_event"]
                           for name in names},
        "stat_ticks_ns_per_event": {
            # /proc/PID/stat over every window, quiet ones included
            name: ticks[name] / TICKS * 1e9 / max(events, 1) for name in names},
        "events_total": totals,
        "windows": {"quiet": quiet, "paced": paced},
        "per_round": per,
    }


def show(out: dict):
    print(f"run-queue events: {out['rate_runq_events_per_s']:,.0f}/s in the paced windows "
          f"({out['rounds']} rounds of {out['window_s']:g} s quiet + {out['window_s']:g} s paced)")
    print(f"{'consumer':<12}{'ns/event':>10}{'marginal':>10}{'x drain':>9}{'quiet %':>9}"
          f"{'paced %':>9}{'stat ns/ev':>12}{'anon MB':>9}{'faults/s':>10}")
    for name in out["median"]:
        m = out["median"][name]
        print(f"{name:<12}{m['ns_per_event']:>10.1f}{m['marginal_ns_per_event']:>10.1f}"
              f"{out['ratio_to_drain'][name]:>9.2f}{m['quiet_cpu_percent']:>9.3f}"
              f"{m['paced_cpu_percent']:>9.3f}{out['stat_ticks_ns_per_event'][name]:>12.1f}"
              f"{m['anon_mb']:>9.1f}{m['faults_per_s']:>10.0f}")
    print("events seen in all (drain, run's runq_events counter, record's file):",
          out["events_total"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=int, default=20000, help="run-queue events a second")
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=float, default=35.0)
    ap.add_argument("--baseline-rev", help="that revision's run and record too, side by side")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "pipeline.json"))
    ap.add_argument("--drain-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--drain-interval", type=float, default=0.025, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.drain_child:
        drain_child(args.drain_child, args.drain_interval)
        return
    if os.geteuid() != 0:
        sys.exit("bench_pipeline: needs root (it loads eBPF)")
    out = bench(args.rate, args.window, args.rounds, args.warmup, args.baseline_rev)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        show(out)
        print(f"written to {args.out}")


if __name__ == "__main__":
    main()
