"""Ingest and scheduler-probe overhead, side by side in one run.

(a) Ingest: a tracepoint on getppid() turns each call of a C spinner into a
    ring-buffer record the size of a run-queue event. The same producer, at
    the same paced rate, is drained by mmtrace's batch reader and by bcc's
    per-event Python callback; we compare consumer CPU per event. Then the
    spinner runs flat out and we count losses for both.
(b) Scheduler-probe overhead: round trips per second of a context-switch
    loop, untraced, under runqlat-bpfcc, and under `mmtrace record`; with
    --baseline-rev, also under `mmtrace record` of that git revision (the
    scheduler program before a change), in the same interleaved rounds.

Needs root. Usage: .venv/bin/python bench/bench_ingest.py [--seconds 3] [--rounds 3]
                   [--baseline-rev REV] [--only overhead]
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import native  # noqa: E402

from mmtrace.agent.kernel.ringbuf import RingReader  # noqa: E402
from mmtrace.bpf.sched import RUNQ_EVENT  # noqa: E402

PRODUCER = r"""
BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_ARRAY(dropped, u64, 1);
BPF_ARRAY(target, u32, 1);
struct record { u64 ts_ns; u64 delay_ns; u32 pid; u32 tid; u32 cpu; u32 prev_tid; char comm[16]; };
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    u32 zero = 0;
    u32 *want = target.lookup(&zero);
    u64 id = bpf_get_current_pid_tgid();
    if (!want || *want != (u32)(id >> 32))
        return 0;
    struct record *r = events.ringbuf_reserve(sizeof(*r));
    if (!r) {
        u64 *d = dropped.lookup(&zero);
        if (d) __sync_fetch_and_add(d, 1);
        return 0;
    }
    r->ts_ns = bpf_ktime_get_ns();
    r->delay_ns = 0;
    r->pid = id >> 32;
    r->tid = (u32)id;
    r->cpu = bpf_get_smp_processor_id();
    r->prev_tid = 0;
    bpf_get_current_comm(&r->comm, sizeof(r->comm));
    events.ringbuf_submit(r, FLAGS);
    return 0;
}
"""

RINGBUF_PAGES = 4096


def load_producer(wakeup: bool):
    from bcc import BPF
    flags = "0" if wakeup else "BPF_RB_NO_WAKEUP"
    return BPF(text=PRODUCER, cflags=[f"-DRINGBUF_PAGES={RINGBUF_PAGES}", f"-DFLAGS={flags}"])


def start_spinner(program, seconds, rate):
    spin = native.build(ROOT / "bench" / "spin_syscall.c")
    # It waits for a line on stdin: its pid becomes the target first, so
    # that every call it makes is counted.
    proc = subprocess.Popen([str(spin), str(seconds), str(rate)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    program["target"][0] = program["target"].Leaf(proc.pid)
    proc.stdin.write("go\n")
    proc.stdin.close()
    return proc


def consume_mmtrace(seconds, rate, interval=0.025):
    program = load_producer(wakeup=False)
    reader = RingReader(program["events"].map_fd, RINGBUF_PAGES * 4096, RUNQ_EVENT)
    received = 0
    proc = start_spinner(program, seconds, rate)
    cpu0 = time.process_time()
    while proc.poll() is None:
        received += len(reader.read())
        time.sleep(interval)
    received += len(reader.read())
    cpu = time.process_time() - cpu0
    calls = int(proc.stdout.read())
    dropped = program["dropped"][0].value
    reader.close()
    program.cleanup()
    return {"calls": calls, "received": received, "dropped": dropped, "cpu_s": cpu}


def consume_bcc_callback(seconds, rate, timeout_ms=25):
    program = load_producer(wakeup=True)
    ring = program["events"]
    received = [0]

    def on_event(ctx, data, size):
        event = ring.event(data)        # what bcc tools do for each event
        _ = (event.ts_ns, event.pid, event.tid, event.comm)
        received[0] += 1

    ring.open_ring_buffer(on_event)
    proc = start_spinner(program, seconds, rate)
    cpu0 = time.process_time()
    while proc.poll() is None:
        program.ring_buffer_poll(timeout_ms)
    program.ring_buffer_consume()
    cpu = time.process_time() - cpu0
    calls = int(proc.stdout.read())
    dropped = program["dropped"][0].value
    program.cleanup()
    return {"calls": calls, "received": received[0], "dropped": dropped, "cpu_s": cpu}


def ingest(seconds):
    paced_rate = 300_000
    out = {"paced_rate_per_s": paced_rate}
    for name, fn in (("mmtrace", consume_mmtrace), ("bcc_callback", consume_bcc_callback)):
        paced = fn(seconds, paced_rate)
        paced["cpu_ns_per_event"] = paced["cpu_s"] / max(paced["received"], 1) * 1e9
        flat = fn(seconds, 0)
        flat["rate_per_s"] = flat["calls"] / seconds
        flat["loss_fraction"] = flat["dropped"] / max(flat["calls"], 1)
        out[name] = {"paced": paced, "flat_out": flat}
    out["cpu_per_event_ratio"] = (out["bcc_callback"]["paced"]["cpu_ns_per_event"]
                                  / out["mmtrace"]["paced"]["cpu_ns_per_event"])
    return out


def wait_for(proc, pattern, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{proc.args[0]} exited before printing {pattern!r}")
        if re.search(pattern, line):
            return
    raise RuntimeError(f"{proc.args[0]} did not print {pattern!r} in {timeout}s")


def ctxswitch_rate(seconds):
    ctx = native.workload("ctxswitch")
    run = subprocess.run([str(ctx), str(seconds), "2"], capture_output=True, text=True,
                         check=True)
    return int(run.stdout) / seconds


def under(tracer, seconds, tmp, env=None):
    if tracer == "untraced":
        return ctxswitch_rate(seconds)
    if tracer == "runqlat":
        cmd, ready = ["runqlat-bpfcc"], "Tracing run queue latency"
    else:
        cmd = [sys.executable, "-m", "mmtrace.agent", "record", "-o", str(tmp / "b.mmtr")]
        ready = r"^recording "
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    try:
        wait_for(proc, ready)
        rate = ctxswitch_rate(seconds)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    return rate


def overhead(seconds, rounds, baseline_rev=None):
    from bench_recording import baseline_env
    rates = {"untraced": [], "runqlat": [], "mmtrace": []}
    with tempfile.TemporaryDirectory() as tmp:
        envs = {}
        if baseline_rev:
            rates["mmtrace_baseline"] = []
            envs["mmtrace_baseline"] = baseline_env(baseline_rev, Path(tmp) / "baseline")
        for _ in range(rounds):
            for tracer in rates:      # interleaved, so drift hits all alike
                name = "mmtrace" if tracer == "mmtrace_baseline" else tracer
                rates[tracer].append(under(name, seconds, Path(tmp), envs.get(tracer)))
    med = {k: statistics.median(v) for k, v in rates.items()}
    out = {"round_trips_per_s": rates, "median": med, "baseline_rev": baseline_rev,
           "slowdown_runqlat": med["untraced"] / med["runqlat"],
           "slowdown_mmtrace": med["untraced"] / med["mmtrace"]}
    if baseline_rev:
        out["slowdown_mmtrace_baseline"] = med["untraced"] / med["mmtrace_baseline"]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "out" / "ingest.json"))
    parser.add_argument("--baseline-rev", help="git revision whose record runs side by side")
    parser.add_argument("--only", choices=("ingest", "overhead"), help="one part only")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_ingest: needs root (loads eBPF)")
    result = {"ingest": ingest(args.seconds) if args.only != "overhead" else None,
              "overhead": overhead(args.seconds, args.rounds, args.baseline_rev)
              if args.only != "ingest" else None,
              "host": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    ing, ovh = result["ingest"], result["overhead"]
    if ing:
        print_ingest(ing)
    if ovh:
        print(f"\n(b) context-switch loop, median round trips/s over {args.rounds} rounds")
        for k, v in ovh["median"].items():
            print(f"{k:<18}{v:>14,.0f}")
        print(f"slowdown: runqlat-bpfcc {ovh['slowdown_runqlat']:.3f}x, "
              f"mmtrace record {ovh['slowdown_mmtrace']:.3f}x"
              + (f", mmtrace record at {args.baseline_rev} "
                 f"{ovh['slowdown_mmtrace_baseline']:.3f}x" if args.baseline_rev else ""))
    print(f"\nwritten to {args.out}")


def print_ingest(ing):
    print(f"(a) ingest, producer paced at {ing['paced_rate_per_s']:,}/s")
    print(f"{'consumer':<14}{'CPU ns/event':>14}{'received':>12}{'dropped':>10}"
          f"{'flat-out rate/s':>17}{'flat-out loss':>15}")
    for name in ("mmtrace", "bcc_callback"):
        p, f = ing[name]["paced"], ing[name]["flat_out"]
        print(f"{name:<14}{p['cpu_ns_per_event']:>14.1f}{p['received']:>12,}{p['dropped']:>10,}"
              f"{f['rate_per_s']:>17,.0f}{f['loss_fraction']:>15.2%}")
    print(f"consumer CPU per event, bcc callback / mmtrace: {ing['cpu_per_event_ratio']:.1f}x")


if __name__ == "__main__":
    main()
