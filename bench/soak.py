"""Soak: `mmtrace run` for MINUTES with every stream busy, then every fuzz
target for FUZZ_MINUTES each. Not part of the test suite.

Streams, each a process in the daemon's --pid scope (so that nothing else
on a shared host adds to the counts):
- CPU: bench/paced_wakeups.c, one thread pair bouncing a byte at a fixed
  pace: --cpu-rate run-queue events a second (the rated rate, 20 000);
- GPU: tests/native/launch_loop.c on NVIDIA's real libcudart.so.12, paced
  to --gpu-iterations per second (a launch, a memcpy and a sync each);
- NPU: bench/ascend_loop.c on the gcc-built Ascend stand-ins (libascendcl,
  libopapi; no NPU here), paced to --npu-iterations per second;
plus a Dispatcher (mmtrace.dispatch) serving --requests per second and
reporting their latencies on the hint socket, the metrics endpoint
scraped every --sample-s seconds, and a flight recording of the last 30 s
(SIGUSR2) every --dump-every-s seconds, as alarms would write them.

Every --sample-s seconds the daemon's RSS, anonymous and file-backed RSS
(/proc/PID/status) and CPU time (/proc/PID/stat) are sampled. At the end:
- RSS flat after --warmup-s: the median of the last third of the samples
  against the first third's, and a least-squares slope;
- every GPU/NPU call either delivered (mmtrace_device_submissions_total and
  the syncs' histogram count), failed (mmtrace_device_call_failures_total:
  the stand-ins and the driverless libcudart return errors, and a failed
  call is no work) or counted lost (mmtrace_events_lost_total of the dev
  stream): the three must add up to the calls made;
- each flight recording written and read back, and the largest anonymous
  RSS while one was written (sampled every 10 ms);
then each fuzz target of tests/fuzz runs for FUZZ_MINUTES.
Writes OUT/samples.csv and OUT/summary.json, and prints the summary.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fuzzing  # noqa: E402
import native  # noqa: E402
from gpu_fixtures import build_natives  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")     # /proc/PID/stat's unit of CPU time
GPU_ITERATIONS = 2000       # launch_loop iterations a second
NPU_ITERATIONS = 500        # ascend_loop iterations a second


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench/soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0, help="soak duration (default 10)")
    p.add_argument("--fuzz-minutes", type=float, default=10.0,
                   help="per fuzz target after the soak (default 10; 0: none)")
    p.add_argument("--warmup-s", type=float, default=60.0, help="left out of the RSS check")
    p.add_argument("--sample-s", type=float, default=5.0, help="sampling period")
    p.add_argument("--cpu-rate", type=int, default=20000,
                   help="run-queue events/s from the paced thread pair (default: the rated 20000)")
    p.add_argument("--gpu-iterations", type=int, default=GPU_ITERATIONS,
                   help="launch_loop iterations/s")
    p.add_argument("--npu-iterations", type=int, default=NPU_ITERATIONS,
                   help="ascend_loop iterations/s")
    p.add_argument("--requests", type=int, default=100, help="dispatcher requests/s")
    p.add_argument("--dump-every-s", type=float, default=60.0,
                   help="a flight recording (SIGUSR2) this often, its memory sampled every "
                        "10 ms while it is written (default 60; 0: none)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "soak")
    return p.parse_args(argv)


class Paced:
    """Drives a stdin-controlled caller ("run N" -> "done") at `per_s`
    iterations a second from a thread; `iterations` counts what it made."""

    def __init__(self, cmd, per_s: int):
        self.proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().startswith("ready")
        self.per_s = per_s
        self.iterations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True)

    def start(self):
        self._thread.start()

    def _drive(self):
        step = max(1, self.per_s // 10)
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.proc.stdin.write(f"run {step}\n")
            self.proc.stdin.flush()
            if not self.proc.stdout.readline().startswith("done"):
                return
            self.iterations += step
            next_at += step / self.per_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self):
        """The pacing stopped (if started) and the caller ended; one that
        does not end at the end of its input within 30 s is killed."""
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def loop_programs(where: Path):
    """The soak's callers built: the natives (launch_loop on the real
    libcudart, the Ascend stand-ins) and ascend_loop."""
    natives = build_natives(where / "natives")
    ascend_loop = native.build(ROOT / "bench" / "ascend_loop.c",
                               flags=[f"-I{native.NATIVE}", str(natives.ascendcl),
                                      str(natives.opapi), f"-Wl,-rpath,{natives.dir}"])
    return natives, ascend_loop


def soak_loops(tmp: Path, gpu_per_s: int = GPU_ITERATIONS, npu_per_s: int = NPU_ITERATIONS):
    """The soak's GPU and NPU loops, paced as it paces them (not started),
    their pids, and the daemon's arguments that trace them."""
    natives, ascend_loop = loop_programs(tmp)
    loops = [Paced([natives.launch_loop], gpu_per_s)]
    try:
        loops.append(Paced([ascend_loop], npu_per_s))
    except BaseException:
        loops[0].stop()
        raise
    extra = ["--trace-launches"] + [a for lib in (natives.cudart, natives.ascendcl, natives.opapi)
                                    for a in ("--lib", lib)]
    return loops, [loop.proc.pid for loop in loops], extra


class Requests:
    """A Dispatcher on the daemon's hint socket serving `per_s` requests a
    second, vision and text in turn."""

    def __init__(self, socket_path: Path, per_s: int):
        from mmtrace.dispatch import Dispatcher
        self.dispatcher = Dispatcher(["gpu0", "gpu1"], self._handle, socket=str(socket_path))
        self.per_s = per_s
        self.done = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drive, daemon=True)
        self._thread.start()

    @staticmethod
    def _handle(device, modality, items):
        time.sleep(0.001 * len(items))
        return items

    def _drive(self):
        n = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            modality = "vision" if n % 2 else "text"
            self.dispatcher.submit(n, modality=modality).add_done_callback(self._count)
            n += 1
            next_at += 1 / self.per_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _count(self, future):
        if future.exception() is None:
            self.done += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        state = self.dispatcher.state()
        self.dispatcher.close()
        return {"completed": self.done, "agent": state.get("agent")}


def proc_sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    kb = {k: int(v.split()[0]) for k, v in re.findall(r"^(\w+):\s+(\d+ kB)", status, re.M)}
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {"t": time.monotonic(), "rss_mb": kb["VmRSS"] / 1024,
            "anon_mb": kb.get("RssAnon", 0) / 1024, "file_mb": kb.get("RssFile", 0) / 1024,
            "cpu_s": (int(fields[11]) + int(fields[12])) / CLOCK_TICKS}


def scrape(address: str) -> dict:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and labels.items() <= dict(lab).items())


def start_daemon(out: Path, libs, pids) -> tuple[subprocess.Popen, str]:
    log = open(out / "daemon.log", "w")
    args = [sys.executable, "-m", "mmtrace.agent", "run", "--state-dir", out / "state",
            "--socket", out / "hint.sock", "--metrics-address", "127.0.0.1:0",
            "--trace-launches", *[a for lib in libs for a in ("--lib", lib)],
            *[a for pid in pids for a in ("--pid", pid)]]
    proc = subprocess.Popen([str(a) for a in args], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = (out / "daemon.log").read_text()
        match = re.search(r"metrics on (\S+)/metrics", text)
        if match and "tracing:" in text:
            return proc, match.group(1)
        if proc.poll() is not None:
            raise SystemExit("the daemon exited:\n" + text)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the daemon did not start in 120 s")


def rss_trend(samples: list[dict], warmup_s: float) -> dict:
    t0 = samples[0]["t"]
    steady = [s for s in samples if s["t"] - t0 >= warmup_s]
    if len(steady) < 6:
        return {"samples_after_warmup": len(steady), "flat": None}
    third = len(steady) // 3
    out = {"samples_after_warmup": len(steady)}
    for key in ("rss_mb", "anon_mb"):
        first = statistics.median(s[key] for s in steady[:third])
        last = statistics.median(s[key] for s in steady[-third:])
        minutes = np.array([(s["t"] - t0) / 60 for s in steady])
        slope = float(np.polyfit(minutes, [s[key] for s in steady], 1)[0])
        out[key] = {"first_third_median": round(first, 1), "last_third_median": round(last, 1),
                    "slope_mb_per_min": round(slope, 3),
                    "max": round(max(s[key] for s in steady), 1)}
    growth = out["rss_mb"]["last_third_median"] - out["rss_mb"]["first_third_median"]
    out["flat"] = growth <= max(2.0, 0.02 * out["rss_mb"]["first_third_median"])
    return out


def dump_and_watch(daemon: subprocess.Popen, log: Path, watch_s: float = 5.0) -> float:
    """SIGUSR2 (a flight recording now); the largest anonymous RSS, in MB,
    sampled every 10 ms until the daemon logs the file written (or watch_s
    passed)."""
    said = "flight recording (SIGUSR2)"
    before = log.read_text().count(said)
    daemon.send_signal(signal.SIGUSR2)
    peak, deadline = 0.0, time.monotonic() + watch_s
    while time.monotonic() < deadline:
        peak = max(peak, proc_sample(daemon.pid)["anon_mb"])
        if log.read_text().count(said) > before:
            break
        time.sleep(0.01)
    return peak


def read_back(paths) -> int:
    """How many of the recordings at `paths` read back complete."""
    from mmtrace.agent.recording.file_format import RecordingError, RecordingReader
    good = 0
    for path in paths:
        try:
            with RecordingReader(path) as rec:
                good += rec.complete and not rec.warnings
        except RecordingError:
            pass
    return good


def soak(args) -> dict:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    natives, ascend_loop = loop_programs(out)
    seconds = args.minutes * 60
    for old in (out / "state").glob("flight-*.mmtr"):     # an earlier run's
        old.unlink()
    pacer = native.build(ROOT / "bench" / "paced_wakeups.c", flags=["-pthread"])
    cpu = subprocess.Popen([str(pacer), str(int(seconds + 120)), str(args.cpu_rate / 2)],
                           stdout=subprocess.PIPE)
    gpu = Paced([natives.launch_loop], args.gpu_iterations)
    npu = Paced([ascend_loop], args.npu_iterations)
    daemon, address = start_daemon(out, [natives.cudart, natives.ascendcl, natives.opapi],
                                   [cpu.pid, gpu.proc.pid, npu.proc.pid])
    requests = None
    samples, scrapes, dump_peaks = [], [], []
    try:
        gpu.start()
        npu.start()
        requests = Requests(out / "hint.sock", args.requests)
        started = time.monotonic()
        next_dump = started + args.dump_every_s
        while time.monotonic() - started < seconds:
            samples.append(proc_sample(daemon.pid))
            scrapes.append((time.monotonic(), scrape(address)))
            assert daemon.poll() is None, "the daemon exited"
            if args.dump_every_s > 0 and time.monotonic() >= next_dump:
                dump_peaks.append(dump_and_watch(daemon, out / "daemon.log"))
                next_dump += args.dump_every_s
            time.sleep(args.sample_s)
        gpu.stop()
        npu.stop()
        dispatched = requests.stop()
        requests = None
        time.sleep(2 * args.sample_s)     # the last events drained and counted
        final = scrape(address)
        final_at = time.monotonic()
        samples.append(proc_sample(daemon.pid))
    finally:
        if requests is not None:
            requests.stop()
        cpu.kill()
        cpu.wait()
        for caller in (gpu, npu):
            if caller.proc.poll() is None:
                caller.proc.kill()
        daemon.terminate()
        daemon_exit = daemon.wait(60)
    span_s = samples[-1]["t"] - samples[0]["t"]
    calls = 3 * (gpu.iterations + npu.iterations)
    delivered = (total(final, "mmtrace_device_submissions_total")
                 + total(final, "mmtrace_device_sync_wait_seconds_count"))
    failed = total(final, "mmtrace_device_call_failures_total")
    lost_dev = total(final, "mmtrace_events_lost_total", stream="dev")
    runq = total(final, "mmtrace_runq_delay_seconds_count")
    first_runq = total(scrapes[0][1], "mmtrace_runq_delay_seconds_count")
    summary = {
        "minutes": round(span_s / 60, 2), "daemon_exit": daemon_exit,
        "rates_per_s": {
            "cpu_runq_events": round((runq - first_runq) / (final_at - scrapes[0][0])),
            "gpu_calls": round(3 * gpu.iterations / seconds),
            "npu_calls": round(3 * npu.iterations / seconds),
            "requests": round(dispatched["completed"] / seconds)},
        "cpu_percent_of_a_core": round(100 * (samples[-1]["cpu_s"] - samples[0]["cpu_s"])
                                       / span_s, 2),
        "rss": rss_trend(samples, args.warmup_s),
        "device_calls": {"made": calls, "delivered": delivered, "failed": failed,
                         "lost_counted": lost_dev,
                         "uncounted": calls - delivered - failed - lost_dev},
        "losses_by_reason": {dict(lab)["reason"]: v for (n, lab), v in final.items()
                             if n == "mmtrace_events_lost_total" and v},
        "dispatcher": dispatched,
    }
    flights = sorted((out / "state").glob("flight-*.mmtr"))
    summary["flight_recordings"] = {
        "requested": len(dump_peaks),
        "written": len(flights),        # these and what alarms wrote
        "read_back": read_back(flights),
        "anon_mb_while_written_max": round(max(dump_peaks), 1) if dump_peaks else None}
    with open(out / "samples.csv", "w") as f:
        f.write("t_s,rss_mb,anon_mb,file_mb,cpu_s\n")
        for s in samples:
            f.write(f"{s['t'] - samples[0]['t']:.1f},{s['rss_mb']:.1f},{s['anon_mb']:.1f},"
                    f"{s['file_mb']:.1f},{s['cpu_s']:.2f}\n")
    return summary


def fuzz(minutes: float, out: Path) -> dict:
    results = {}
    for target in fuzzing.targets():
        run = fuzzing.search(target, out / "fuzz" / target, seconds=int(minutes * 60))
        results[target] = {"runs": run.runs, "clean": run.clean,
                           "replay": run.replay_commands()}
        if not run.clean:
            (out / "fuzz" / target / "output.txt").write_text(run.output)
        print(f"fuzz {target}: {run.runs} runs in {minutes:g} min, "
              f"{'clean' if run.clean else 'FAILED'}", flush=True)
        for command in run.replay_commands():
            print(f"  replay: {command}", flush=True)
    return results


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = soak(args) if args.minutes > 0 else {}
    print(json.dumps(summary, indent=1), flush=True)
    if args.fuzz_minutes > 0:
        summary["fuzz"] = fuzz(args.fuzz_minutes, args.out)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    flights = summary.get("flight_recordings", {})
    ok = (summary.get("device_calls", {}).get("uncounted", 0) == 0
          and flights.get("read_back") == flights.get("written")
          and summary.get("rss", {}).get("flat") is not False
          and all(r["clean"] for r in summary.get("fuzz", {}).values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
