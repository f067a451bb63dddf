"""What the Prometheus endpoint costs, on a real daemon tracing 100 processes.

The 100 processes are real: tests/native/launch_loop.c on NVIDIA's real
libcudart.so.12, each launching kernels, copying and syncing (no driver
here: calls return at once, the probes see them all), started before the
daemon and given to it as its --pid scope. A driver thread keeps them
busy at a steady rate (every process: LAUNCHES launches + 1 memcpy + 1
sync, ITERS times, each second).

1. Scrape cost: wall time of GET /metrics (HTTP on loopback, the exposition
   built from the kernel maps and the daemon's state under its lock),
   median and p95 of --scrapes scrapes, with the default labels (top 10
   processes by name) and with pid labels on for a top 100.
2. Daemon CPU, side by side over the same workload, per round: metrics
   and OTLP off; metrics on (scraped every second, as Prometheus would);
   metrics on and OTLP traces to a receiver on loopback (1 % of the
   submissions sampled, at most 200 spans/s): the daemon's utime + stime
   over --seconds of steady state.

Needs root, gcc and the nvidia-cuda-runtime-cu12 wheel. Writes
bench/out/metrics.json.

    sudo .venv/bin/python bench/bench_metrics.py [--processes 100] [--seconds 20]
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

ITERS, LAUNCHES = 20, 5
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Loops:
    """N launch_loop processes and a thread driving them once a second."""

    def __init__(self, binary: Path, n: int):
        self.procs = [subprocess.Popen([str(binary)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True) for _ in range(n)]
        for p in self.procs:
            p.stdout.readline()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _drive(self):
        while not self._stop.is_set():
            started = time.monotonic()
            for p in self.procs:
                p.stdin.write(f"run {ITERS} {LAUNCHES}\n")
                p.stdin.flush()
            for p in self.procs:
                p.stdout.readline()
            self._stop.wait(max(0.0, 1.0 - (time.monotonic() - started)))

    def close(self):
        self._stop.set()
        self._thread.join(30)
        for p in self.procs:
            p.stdin.close()
            p.wait(timeout=30)


class Daemon:
    def __init__(self, tmp: Path, cudart: Path, pids, config: str, port: int | None):
        cfg = tmp / "mmtrace.toml"
        cfg.write_text(config)
        args = [sys.executable, "-m", "mmtrace.agent", "run", "--config", str(cfg),
                "--state-dir", str(tmp / "state"), "--socket", str(tmp / "hint.sock"),
                "--lib", str(cudart), "--trace-launches", "--metrics-address",
                f"127.0.0.1:{port}" if port else "off"]
        for pid in pids:
            args += ["--pid", str(pid)]
        self.log = tmp / "daemon.log"
        self.proc = subprocess.Popen(args, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while "tracing:" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("daemon did not start:\n" + self.log.read_text())
            time.sleep(0.2)

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


def scrape(url: str) -> tuple[float, bytes]:
    t0 = time.perf_counter()
    body = urllib.request.urlopen(url, timeout=30).read()
    return (time.perf_counter() - t0) * 1e3, body


def scrape_cost(natives, loops, scrapes: int, config: str) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), natives.cudart, loops.pids, config, port)
        try:
            time.sleep(3)       # every process has launched, slept, woken
            url = f"http://127.0.0.1:{port}/metrics"
            times, body = [], b""
            for _ in range(scrapes):
                ms, body = scrape(url)
                times.append(ms)
                time.sleep(0.1)
        finally:
            daemon.stop()
    lines = [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]
    workloads = [ln for ln in lines if ln.startswith("mmtrace_submitter_runq_delay_seconds_count")]
    times.sort()
    return {"median_ms": statistics.median(times), "p95_ms": times[int(0.95 * len(times)) - 1],
            "min_ms": times[0], "bytes": len(body), "series": len(lines),
            "workload_series": len(workloads)}


def cpu_round(natives, loops, seconds: float, metrics_on: bool, otlp_url: str | None = None):
    port = free_port() if metrics_on else None
    config = "" if metrics_on else "device_poll_interval_s = 0\n"
    if otlp_url:
        config += f'[otlp]\nendpoint = "{otlp_url}"\nsample_ratio = 0.01\n'
    with tempfile.TemporaryDirectory() as tmp:
        daemon = Daemon(Path(tmp), natives.cudart, loops.pids, config, port)
        try:
            time.sleep(3)       # past compilation and the first scans
            start = daemon.cpu_s()
            end_at = time.monotonic() + seconds
            while time.monotonic() < end_at:
                if port:
                    scrape(f"http://127.0.0.1:{port}/metrics")
                time.sleep(1.0)
            used = daemon.cpu_s() - start
        finally:
            daemon.stop()
    return used / seconds


def main():
    from gpu_fixtures import build_natives
    from otlp_receiver import Receiver
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=100)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    natives = build_natives(Path(tempfile.mkdtemp(prefix="mmtrace-bench-")))
    loops = Loops(natives.launch_loop, args.processes)
    out = {"processes": args.processes, "per_process_per_s": {
        "launches": ITERS * LAUNCHES, "memcpys": ITERS, "syncs": ITERS}}
    try:
        out["scrape_top10_by_name"] = scrape_cost(natives, loops, args.scrapes, "")
        out["scrape_top100_with_pid"] = scrape_cost(
            natives, loops, args.scrapes, "metrics_top_k = 100\nmetrics_pid_label = true\n")
        on, off, both = [], [], []
        receiver = Receiver()
        for _ in range(args.rounds):
            on.append(cpu_round(natives, loops, args.seconds, True))
            off.append(cpu_round(natives, loops, args.seconds, False))
            both.append(cpu_round(natives, loops, args.seconds, True, receiver.url))
        out["daemon_cpu_metrics_on"] = on
        out["daemon_cpu_metrics_off"] = off
        out["daemon_cpu_metrics_and_otlp_on"] = both
        out["otlp_spans_received"] = len(receiver.spans)
        out["daemon_cpu_on_minus_off"] = min(on) - min(off)
        out["daemon_cpu_both_on_minus_off"] = min(both) - min(off)
    finally:
        loops.close()
    (ROOT / "bench" / "out").mkdir(exist_ok=True)
    (ROOT / "bench" / "out" / "metrics.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
