"""The daemon's footprint and start-up, side by side in one run.

(a) A bare bcc program on one tracepoint (sched_switch, a counter): RSS
    and anonymous RSS after `import bcc`, after compiling, and after
    malloc_trim(0): the floor any bcc agent starts from.
(b) `mmtrace run` with its defaults (metrics on 127.0.0.1:0, the state
    directory and socket in a temporary directory), idle: time from launch
    to "cpu stream live" and to "tracing:" (every probe attached), from
    its log; then RSS, anonymous RSS and CPU (% of one core) from
    /proc/PID/status and /proc/PID/stat over --seconds after --warmup.
(c) The same daemon at the rated event rate: paced_wakeups (one thread
    pair, RATE/2 round trips a second) adds ~RATE run-queue events a
    second; the same figures, and the events lost (mmtrace_events_lost_total
    from its metrics endpoint) over the measured seconds.
Ratios against the bare bcc program close the report.

Needs root. Usage: .venv/bin/python bench/bench_footprint.py [--seconds 20]
[--warmup 10] [--rated-warmup 35] [--rate 20000] [--json]
(the rated warm-up covers ring_seconds, 30 s by default: the rings grow
with the rate until they hold that long.)
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import native  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")

BARE_BCC = r"""
import ctypes, json, re, sys
def mem():
    s = open("/proc/self/status").read()
    d = {k: int(v) for k, v in re.findall(r"^(VmRSS|RssAnon|RssFile):\s+(\d+)", s, re.M)}
    return {"rss_mb": d["VmRSS"] / 1024, "anon_mb": d["RssAnon"] / 1024}
from bcc import BPF
out = {"before_compile": mem()}
b = BPF(text='''
BPF_ARRAY(switches, u64, 1);
TRACEPOINT_PROBE(sched, sched_switch) { switches.increment(0); return 0; }
''')
out["after_compile"] = mem()
ctypes.CDLL("libc.so.6").malloc_trim(0)
out["after_malloc_trim"] = mem()
print(json.dumps(out))
"""


def bare_bcc() -> dict:
    run = subprocess.run([sys.executable, "-c", BARE_BCC], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(run.stdout)


def memory(pid: int) -> dict:
    text = Path(f"/proc/{pid}/status").read_text()
    d = {k: int(v) for k, v in re.findall(r"^(VmRSS|RssAnon|RssFile|VmHWM):\s+(\d+)", text,
                                          re.M)}
    return {"rss_mb": d["VmRSS"] / 1024, "anon_mb": d["RssAnon"] / 1024,
            "file_mb": d["RssFile"] / 1024, "peak_mb": d["VmHWM"] / 1024}


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> int:
    fields = _stat_fields(pid)
    return int(fields[11]) + int(fields[12])        # utime + stime


def minor_faults(pid: int) -> int:
    """Page faults served without I/O: each a page the process touched
    afresh, zeroed by the kernel (1.4 us on this host), CPU that no Python
    profile shows."""
    return int(_stat_fields(pid)[7])


def cpu_ns(pid: int) -> int:
    """CPU time of the process's threads now, in ns (/proc/PID/task/*/schedstat):
    a daemon at a fraction of a percent is a few clock ticks a minute. A
    thread that ends takes its time with it (the daemon's compile thread
    ends before a measured window)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass                # a thread that ended meanwhile
    return total


def scrape(metrics_url: str) -> tuple[float, float]:
    """(events lost, run-queue events) so far, from the daemon's metrics."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    lost = sum(float(v) for v in re.findall(r"^mmtrace_events_lost_total\{[^}]*\} (\S+)", text,
                                            re.M))
    runq = sum(float(v) for v in re.findall(
        r'^mmtrace_kernel_events_total\{[^}]*runq_events[^}]*\} (\S+)', text, re.M))
    return lost, runq


class Daemon:
    """`mmtrace run` with its defaults, its log read in the background."""

    def __init__(self, tmp: Path, env: dict | None = None, args: tuple = ()):
        self.launched = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmtrace.agent", "run", "--state-dir", str(tmp / "state"),
             "--socket", str(tmp / "hint.sock"), "--metrics-address", "127.0.0.1:0", *args],
            stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.cpu_live_s = self.tracing_s = None
        self.metrics_url = None
        while self.tracing_s is None:
            line = self.proc.stderr.readline()
            if not line:
                raise RuntimeError("the daemon exited: " + "".join(self.lines))
            self.lines.append(line)
            at = time.monotonic() - self.launched
            if "cpu stream live" in line and self.cpu_live_s is None:
                self.cpu_live_s = at
            elif "tracing:" in line:
                self.tracing_s = at
            elif (m := re.search(r"metrics on (\S+)/metrics", line)):
                self.metrics_url = f"http://{m.group(1)}/metrics"
        if self.cpu_live_s is None:         # a daemon that logs only when all is attached
            self.cpu_live_s = self.tracing_s

    def measure(self, warmup_s: float, seconds: float) -> dict:
        time.sleep(warmup_s)
        start_mem = memory(self.proc.pid)
        lost0, runq0 = scrape(self.metrics_url)
        t0, c0, n0 = time.monotonic(), cpu_ticks(self.proc.pid), cpu_ns(self.proc.pid)
        time.sleep(seconds)
        elapsed = time.monotonic() - t0
        cpu = (cpu_ticks(self.proc.pid) - c0) / TICKS / elapsed * 100
        cpu_schedstat = (cpu_ns(self.proc.pid) - n0) / 1e9 / elapsed * 100
        end_mem = memory(self.proc.pid)
        lost, runq = scrape(self.metrics_url)
        return {"cpu_percent": round(cpu, 2), "cpu_percent_schedstat": round(cpu_schedstat, 3),
                "lost": lost - lost0,
                "runq_events_per_s": round((runq - runq0) / elapsed),
                **{k: round(v, 1) for k, v in end_mem.items()},
                "rss_mb_at_start_of_window": round(start_mem["rss_mb"], 1)}

    def stop(self) -> float:
        """SIGTERM, then the seconds until the process has exited."""
        began = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        self.proc.communicate(timeout=60)
        return time.monotonic() - began


def run_daemon(warmup_s: float, seconds: float, rate: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp))
        load = None
        try:
            if rate:
                pacer = native.build(ROOT / "bench" / "paced_wakeups.c", flags=["-pthread"])
                load = subprocess.Popen([str(pacer), str(warmup_s + seconds + 5), str(rate / 2)],
                                        stdout=subprocess.PIPE, text=True)
            figures = daemon.measure(warmup_s, seconds)
        finally:
            if load is not None:
                load.kill()
                load.wait()
            daemon.stop()
    return {"cpu_live_s": round(daemon.cpu_live_s, 2), "tracing_s": round(daemon.tracing_s, 2),
            **figures}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--rated-warmup", type=float, default=35.0)
    ap.add_argument("--rate", type=int, default=20000, help="rated run-queue events a second")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_footprint: needs root (it loads eBPF)")
    bare = bare_bcc()
    idle = run_daemon(args.warmup, args.seconds)
    rated = run_daemon(args.rated_warmup, args.seconds, args.rate)
    floor = bare["after_malloc_trim"]
    out = {"bare_bcc": bare, "daemon_idle": idle,
           "daemon_rated": {"rate_runq_events_per_s": args.rate, **rated},
           "ratios_to_bare_bcc_after_trim": {
               "idle_rss": round(idle["rss_mb"] / floor["rss_mb"], 2),
               "idle_anon": round(idle["anon_mb"] / floor["anon_mb"], 2),
               "rated_rss": round(rated["rss_mb"] / floor["rss_mb"], 2),
               "rated_anon": round(rated["anon_mb"] / floor["anon_mb"], 2)}}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for name, stages in bare.items():
        print(f"bare bcc {name:18s} RSS {stages['rss_mb']:6.1f} MB  anon {stages['anon_mb']:6.1f} MB")
    for name, d in (("idle", idle), (f"at {args.rate}/s", rated)):
        print(f"daemon {name:12s} cpu live {d['cpu_live_s']:5.2f} s  tracing {d['tracing_s']:5.2f} s  "
              f"RSS {d['rss_mb']:6.1f} MB (from {d['rss_mb_at_start_of_window']:.1f})  "
              f"anon {d['anon_mb']:6.1f} MB  file {d['file_mb']:6.1f} MB  "
              f"peak {d['peak_mb']:6.1f} MB  CPU {d['cpu_percent']:5.2f} %  "
              f"runq events {d['runq_events_per_s']}/s  lost {d['lost']:g}")
    print("ratios to bare bcc after malloc_trim:", out["ratios_to_bare_bcc_after_trim"])


if __name__ == "__main__":
    main()
