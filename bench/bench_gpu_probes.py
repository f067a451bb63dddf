"""What the GPU probes cost, measured on NVIDIA's real libcudart.so.12.

1. Per call: a loop of cudaLaunchKernel calls untraced, with an empty
   uprobe on cudaLaunchKernel, and fully traced by mmtrace (the launch
   decoder: scope, op_id, run-queue delay, device, comm, stack arguments,
   callers, ring buffer), each way of attaching against an empty program
   attached the same way (a uprobe_multi link; a perf-event uprobe through
   bcc). The trap dominates; the goal is traced / empty <= 1.15. Measured
   twice: on libcudart.so.12, and on the same loop built by nvcc the
   default way, its runtime (CUDA 13) linked statically into the
   executable (skipped without nvcc; --skip-static). Beside them, in the
   same rounds: the decoder sending every launch whole (the 144-byte
   record, as before the one-line record), floors (ring records of 144,
   64 and 56 bytes, a bpftrace-like map update), medians of each round's
   ratio, and each program's own ns per run as the kernel times it
   (bench/program_time.py: no trap in it).
   Piece by piece (--only pieces, bench/launch_pieces.py): a ladder of
   programs, each adding one piece of the decoder, beside mmtrace's own.
2. The adaptive mode: a launch-heavy loop (L launches per memcpy + sync)
   with the per-launch probes detached, against the same loop untraced. No
   driver here, so a launch returns at once; each launch is followed by
   --launch-ns of host work standing in for a real launch (about 4 µs).
   Goal <= 1.02.
3. Python CPU per GPU event: the record path (ring read, names, file
   write) and the live alignment ring, process CPU time per event.
4. Launches kept: `mmtrace record` (the command, as a user runs it) over
   a loop of --record-launches cudaLaunchKernel calls back to back, at
   the rate the uprobe trap allows; the launches in the recording, and
   those the kernel counted lost, by reason. Repeated --record-repeat
   times (the host is shared: the spread is part of the figure).
5. The same loop under the daemon (`mmtrace run --trace-launches`): the
   launches its metrics count (done and failed) and the kernel's losses.

Needs root (loads eBPF), gcc, and the nvidia-cuda-runtime-cu12 wheel.
Prints a table; writes bench/out/gpu_probes.json.

    sudo .venv/bin/python bench/bench_gpu_probes.py [--calls 200000] [--repeat 5]
    sudo .venv/bin/python bench/bench_gpu_probes.py --only record   # section 4 alone
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
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

from native import NATIVE, nvcc_build  # noqa: E402

import launch_pieces as launch_pieces_module  # noqa: E402
import program_time  # noqa: E402

EMPTY_PROGRAM = "int empty(struct pt_regs *ctx) { return 0; }"
# What any per-launch tracer pays beyond the trap, as floors beside
# mmtrace's decoder: a ring-buffer record of a launch's size (reserved,
# stamped, submitted without a wake-up) and one of a single cache line,
# and what a bpftrace one-liner does (six argument registers read, one
# hash map update).
FLOOR_PROGRAM = """
#include <uapi/linux/ptrace.h>
BPF_RINGBUF_OUTPUT(floor_ring, 8192);      /* 32 MiB: a whole run of records */
BPF_HASH(floor_map, u32, u64, 65536);

static __always_inline int ring_record_of(struct pt_regs *ctx, u32 size)
{
    u64 *p = floor_ring.ringbuf_reserve(size);
    if (!p)
        return 0;
    p[0] = bpf_ktime_get_ns();
    p[1] = bpf_get_current_pid_tgid();
    p[2] = PT_REGS_PARM1(ctx);
    floor_ring.ringbuf_submit(p, BPF_RB_NO_WAKEUP);
    return 0;
}

int ring_record(struct pt_regs *ctx) { return ring_record_of(ctx, 144); }
int ring_record_small(struct pt_regs *ctx) { return ring_record_of(ctx, 24); }   /* a cache line */

/* Every byte written, as a decoder's record is: 144 bytes (struct
 * dev_event), 64 (struct dev_launch), 56 (a cache line with the header). */
static __always_inline int ring_written_of(struct pt_regs *ctx, u32 words)
{
    u64 *p = floor_ring.ringbuf_reserve(words * 8);
    if (!p)
        return 0;
    u64 v = bpf_ktime_get_ns();
#pragma unroll
    for (u32 i = 0; i < 18; i++)
        if (i < words)
            p[i] = v + i;
    floor_ring.ringbuf_submit(p, BPF_RB_NO_WAKEUP);
    return 0;
}

int ring_written_144(struct pt_regs *ctx) { return ring_written_of(ctx, 18); }
int ring_written_64(struct pt_regs *ctx) { return ring_written_of(ctx, 8); }
int ring_written_56(struct pt_regs *ctx) { return ring_written_of(ctx, 7); }

int args_map(struct pt_regs *ctx)
{
    u64 v = PT_REGS_PARM1(ctx) ^ PT_REGS_PARM2(ctx) ^ PT_REGS_PARM3(ctx)
            ^ PT_REGS_PARM4(ctx) ^ PT_REGS_PARM5(ctx) ^ PT_REGS_PARM6(ctx);
    u32 tid = bpf_get_current_pid_tgid();
    floor_map.update(&tid, &v);
    return 0;
}
"""
RING_PAGES = 1 << 15     # 128 MiB: 600k device events
# Floor rows of per_call: their program in FLOOR_PROGRAM.
FLOORS = {"floor_ring_single": "ring_record", "floor_small_ring_single": "ring_record_small",
          "floor_written_144_single": "ring_written_144",
          "floor_written_64_single": "ring_written_64",
          "floor_written_56_single": "ring_written_56",
          "floor_args_map_single": "args_map"}


class Loop:
    """tests/native/launch_loop.c, driven line by line."""

    def __init__(self, binary: Path, launch_only: bool):
        args = [str(binary)] + (["launch-only"] if launch_only else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.pid = int(self.proc.stdout.readline().split()[1])

    def run(self, n: int, per_sync: int = 1, spin_ns: int = 0) -> float:
        self.proc.stdin.write(f"run {n} {per_sync} {spin_ns}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split()[1])

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def best_run(loop: Loop, repeat: int, *args, between=None) -> float:
    """The fastest of `repeat` runs: on a shared host the least disturbed."""
    loop.run(max(1, args[0] // 20), *args[1:])        # warm up
    times = []
    for _ in range(repeat):
        times.append(loop.run(*args))
        if between is not None:
            between()
    return min(times)


def empty_multi_link(cudart: Path, program=None, attach: bool = True):
    """The empty program on cudaLaunchKernel through a uprobe_multi link."""
    import os

    import bcc
    from mmtrace.agent.discovery.elf_reader import load_segments_of
    from mmtrace.agent.kernel.uprobe_link import BPF_TRACE_UPROBE_MULTI, UprobeMultiLink
    program = program or bcc.BPF(text=EMPTY_PROGRAM)
    fn = program.load_func(b"empty", bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
    if not attach:
        return program, None
    (_, vaddr), = bcc.BPF.get_user_functions_and_addresses(str(cudart), b"^cudaLaunchKernel$")
    fd = os.open(cudart, os.O_RDONLY)
    try:
        offset = load_segments_of(fd, str(cudart)).offset_of_vaddr(vaddr)
    finally:
        os.close(fd)
    return program, UprobeMultiLink(fn.fd, str(cudart).encode(), [offset], [0])


def per_call(loop_binary: Path, runtime: Path, calls: int, repeat: int) -> dict:
    """ns per cudaLaunchKernel call in each configuration, the runtime's
    cudaLaunchKernel in file `runtime` (a libcudart, or the loop itself when
    it is linked statically). Every program is loaded up front; each round
    attaches one configuration, runs, detaches, so that all see the same
    host load; the fastest round of each counts."""
    import bcc
    from mmtrace.agent.kernel import probes
    loop = Loop(loop_binary, launch_only=True)
    empty_bcc = bcc.BPF(text=EMPTY_PROGRAM)
    empty_multi, _ = empty_multi_link(runtime, attach=False)
    floors = bcc.BPF(text=FLOOR_PROGRAM)
    floors["floor_ring"].open_ring_buffer(lambda *_: None)
    traced = {}
    # "multi" probes launches as uprobe sessions: with no driver every call
    # fails, so every return is probed (a storm of failures is counted
    # whole); "multi_entry" (launch_return_every 0) is the entry decoder
    # alone, what a process whose launches succeed pays 63 calls in 64.
    # "single_whole": the decoder sending every launch as a whole 144-byte
    # record, as before launches went in one cache line.
    for mode, every in (("multi", 64), ("multi_entry", 0), ("single", 64),
                        ("single_whole", 64)):
        # A ring that holds a whole run: a full ring drops events, and a
        # dropped event costs less than a delivered one.
        traced[mode] = probes.load(probes.ProbeOptions(
            attach_mode=mode.split("_")[0], trace_launches=False, dev_ringbuf_pages=RING_PAGES,
            launch_return_every=every,
            extra_cflags=["-DMMTRACE_LAUNCH_WHOLE"] if mode == "single_whole" else []))
        traced[mode].device.add_path(str(runtime))

    # ns per run of each program itself, as the kernel times it (beside
    # the wall time, which holds the trap too)
    program_ns: dict = {}

    def kernel_timed(name, fds, run):
        def timed():
            took, ns = program_time.timed_runs(fds() if callable(fds) else fds, run)
            program_ns.setdefault(name, []).append(ns)
            return took
        return timed

    def run_untraced():
        return loop.run(calls)

    run_empty_single = kernel_timed("empty_single", [empty_bcc.load_func(
        b"empty", bcc.BPF.KPROBE).fd], lambda: launch_pieces_module.uprobe_run(
            empty_bcc, "empty", runtime, loop, calls, drain=False))

    def run_floor(name, fn_name):
        return kernel_timed(name, [floors.load_func(fn_name.encode(), bcc.BPF.KPROBE).fd],
                            lambda: launch_pieces_module.uprobe_run(floors, fn_name, runtime,
                                                                    loop, calls))

    def run_empty_multi():
        _, link = empty_multi_link(runtime, program=empty_multi)
        try:
            return loop.run(calls)
        finally:
            link.close()

    def run_traced(mode):
        def run():
            loaded = traced[mode]
            loaded.device.attach_launches()
            try:
                took = loop.run(calls)
            finally:
                loaded.device.detach_launches()
            delivered.setdefault(mode, []).append(sum(len(b) for b in _drain(loaded)))
            return took
        def launch_fds():       # loaded once attached
            return [fd for name, fd in traced[mode].figures()["programs"].items()
                    if name == "on_cudaLaunchKernel"]
        return kernel_timed(f"traced_{mode}", launch_fds, run) if mode.startswith(
            "single") else run

    delivered: dict = {}
    configs = {"untraced": run_untraced, "empty_multi": run_empty_multi,
               "traced_multi": run_traced("multi"),
               "traced_multi_entry": run_traced("multi_entry"),
               "empty_single": run_empty_single, "traced_single": run_traced("single"),
               "traced_single_whole": run_traced("single_whole"),
               **{floor: run_floor(floor, fn) for floor, fn in FLOORS.items()}}
    try:
        with program_time.RunTimeStats():
            rounds = launch_pieces_module.interleaved_rounds(loop, calls, repeat, configs)
    finally:
        loop.close()
        for loaded in traced.values():
            lost = loaded.counters()["ringbuf_full_dev"]
            loaded.close()
        empty_bcc.cleanup()
        empty_multi.cleanup()
        floors.cleanup()
    out = {f"{name}_ns": min(ts) / calls * 1e9 for name, ts in rounds.items()}
    # Medians of the same rounds: each round's ratio to the empty program
    # of that round, so that a slow moment of the host cancels out.
    empty = rounds["empty_single"]
    for name in configs:
        if "_single" in name and name != "empty_single":
            out[f"{name}_median_vs_empty"] = statistics.median(
                t / e for t, e in zip(rounds[name], empty))
    for name, ns in program_ns.items():
        out[f"{name}_program_ns"] = statistics.median(ns)
        out[f"{name}_program_ns_rounds"] = ns
    for floor in FLOORS:
        out[f"{floor}_vs_empty"] = out[f"{floor}_ns"] / out["empty_single_ns"]
    for mode in ("multi", "multi_entry", "single", "single_whole"):
        out[f"traced_{mode}_events_per_call"] = min(delivered[mode]) / calls
        t, u = out[f"traced_{mode}_ns"], out["untraced_ns"]
        e = out[f"empty_{mode.split('_')[0]}_ns"]
        out[f"traced_{mode}_vs_empty"] = t / e
        out[f"probe_cost_{mode}_vs_empty_probe_cost"] = (t - u) / (e - u)
        out[f"decoder_ns_{mode}"] = t - e
    out["ring_full_drops"] = lost
    return out


def launch_pieces(loop_binary: Path, runtime: Path, calls: int, repeat: int) -> dict:
    """The decoder piece by piece (launch_pieces.py), beside mmtrace's own
    (bcc uprobe per symbol, no return probed) in the same rounds."""
    from mmtrace.agent.kernel import probes
    loop = Loop(loop_binary, launch_only=True)
    loaded = probes.load(probes.ProbeOptions(
        attach_mode="single", trace_launches=False, dev_ringbuf_pages=RING_PAGES,
        launch_return_every=0))
    loaded.device.add_path(str(runtime))

    def traced():
        loaded.device.attach_launches()
        try:
            return loop.run(calls)
        finally:
            loaded.device.detach_launches()
            _drain(loaded)

    def traced_fds():           # loaded once attached
        return [fd for name, fd in loaded.figures()["programs"].items()
                if name == "on_cudaLaunchKernel"]

    try:
        return launch_pieces_module.pieces(loop, runtime, calls, repeat, traced, traced_fds)
    finally:
        loop.close()
        loaded.close()


def _drain(loaded, max_rounds: int | None = None):
    """Device batches in the rings now; at most `max_rounds` reads, as
    record's loop does per tick (None: until empty)."""
    batches = []
    rounds = 0
    while max_rounds is None or rounds < max_rounds:
        rounds += 1
        got = loaded.read().get("dev")
        if got is None:
            break
        batches.append(got)
    return batches


def adaptive(natives, iterations: int, per_sync: int, launch_ns: int, repeat: int) -> dict:
    from mmtrace.agent.kernel import probes
    loop = Loop(natives.launch_loop, launch_only=False)
    out = {"launches_per_sync": per_sync, "launch_ns_stand_in": launch_ns}
    try:
        out["untraced_s"] = best_run(loop, repeat, iterations, per_sync, launch_ns)
        loaded = probes.load(probes.ProbeOptions(trace_launches=False))
        loaded.device.add_path(str(natives.cudart))
        out["adaptive_s"] = best_run(loop, repeat, iterations, per_sync, launch_ns)
        launches = sum(int(np.count_nonzero(b["api"] == 1)) for b in _drain(loaded))
        out["launch_events_in_adaptive_mode"] = launches
        loaded.device.attach_launches()
        out["fully_traced_s"] = best_run(loop, repeat, iterations, per_sync, launch_ns)
        loaded.close()
    finally:
        loop.close()
    out["adaptive_vs_untraced"] = out["adaptive_s"] / out["untraced_s"]
    out["fully_traced_vs_untraced"] = out["fully_traced_s"] / out["untraced_s"]
    return out


def python_cpu(natives, events: int) -> dict:
    """Process CPU of the agent's side per device event: ring read, names,
    recording write; and, apart, the live alignment ring."""
    from mmtrace.agent.kernel import probes
    from mmtrace.agent.ingest.align import Aligner, ApiRoles
    from mmtrace.agent.ingest.record_arrays import concat
    from mmtrace.agent.ingest.device_names import DeviceNames
    from mmtrace.agent.recording.file_format import RecordingWriter
    from mmtrace.bpf import device
    loaded = probes.load(probes.ProbeOptions(dev_ringbuf_pages=8192))
    loaded.device.add_path(str(natives.cudart))
    loop = Loop(natives.launch_loop, launch_only=False)
    names = DeviceNames(device.default_infos())
    aligner = Aligner(ApiRoles.from_infos(device.default_infos()))
    record_cpu = align_cpu = 0.0
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        writer = RecordingWriter(Path(tmp) / "bench.mmtr", {"dev.event": device.DEV_EVENT})
        # Each iteration: launch, memcpy, sync: three events, about 250k a
        # second (2 µs of host work per launch): a busy server, within what
        # one drain thread keeps up with.
        loop.proc.stdin.write(f"run {events // 3} 1 2000\n")
        loop.proc.stdin.flush()
        done = False
        while not done or total < events * 0.99:
            done = done or _ready(loop)
            start = time.process_time()
            # One batch per drain, as the agent's loop does: per-batch
            # costs are fixed, per-event ones are numpy's.
            batches = _drain(loaded, max_rounds=8)
            batch = concat(batches) if batches else None
            if batch is not None:
                names.process(batch)
                writer.write_events("dev.event", batch)
            mid = time.process_time()
            if batch is not None:
                aligner.push(batch)
            record_cpu += mid - start
            align_cpu += time.process_time() - mid
            total += sum(len(b) for b in batches)
            if done and not batches:
                break
            time.sleep(0.025)
        writer.close()
    loop.close()
    lost = loaded.counters()["ringbuf_full_dev"]
    loaded.close()
    return {"events": total, "lost": lost,
            "record_path_us_per_event": record_cpu / max(total, 1) * 1e6,
            "aligner_us_per_event": align_cpu / max(total, 1) * 1e6}


def record_loss(natives, launches: int, repeat: int, return_every: int = 64) -> dict:
    """`mmtrace record --pid P --lib libcudart` over `launches` back-to-back
    cudaLaunchKernel calls: how many the recording holds, and what the
    kernel counted lost, per run. `return_every`: record's
    --launch-return-every (0: no return probed, every launch in one line;
    else, with no driver here, every launch fails and goes whole)."""
    mmtrace = Path(sys.executable).parent / "mmtrace"
    runs = []
    for _ in range(repeat):
        loop = Loop(natives.launch_loop, launch_only=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "loop.mmtr"
            rec = subprocess.Popen([str(mmtrace), "record", "-o", str(out), "--pid",
                                    str(loop.pid), "--lib", str(natives.cudart),
                                    "--launch-return-every", str(return_every)],
                                   stderr=subprocess.PIPE, text=True)
            try:
                for line in rec.stderr:
                    if "gpu/npu stream live" in line:
                        break
                else:
                    raise RuntimeError("mmtrace record ended before the GPU stream was live")
                took = loop.run(launches)
                time.sleep(0.5)
            finally:
                loop.close()
                rec.send_signal(signal.SIGINT)
                tail = rec.stderr.read()
                rec.wait(timeout=120)
            kept = _launches_in(out, loop.pid)
            wrote = re.search(r"wrote .*?: ([\d,]+) events, ([\d,]+) lost(?: \((.*)\))?", tail)
            runs.append({"launches": launches, "loop_s": took,
                         "rate_per_s": launches / took,
                         "kept": kept,
                         "lost": int(wrote.group(2).replace(",", "")) if wrote else None,
                         "lost_by": wrote.group(3) if wrote else tail.strip()[-200:],
                         "file_bytes": os.path.getsize(out)})
    return {"runs": runs,
            "kept_fraction": [r["kept"] / r["launches"] for r in runs]}


def daemon_loss(natives, launches: int, repeat: int) -> dict:
    """`mmtrace run --pid P --lib libcudart --trace-launches` over
    `launches` back-to-back cudaLaunchKernel calls: the launches its
    metrics count, and those counted lost, per run."""
    import socket
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape(port):
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        samples = [s for f in text_string_to_metric_families(text.decode()) for s in f.samples]
        launched = sum(s.value for s in samples if s.labels.get("api") == "cudaLaunchKernel"
                       and s.name in ("mmtrace_device_submissions_total",
                                      "mmtrace_device_call_failures_total"))
        lost = sum(s.value for s in samples if s.name == "mmtrace_events_lost_total"
                   and s.labels.get("reason") == "ringbuf_full_dev")
        return int(launched), int(lost)

    runs = []
    for _ in range(repeat):
        loop = Loop(natives.launch_loop, launch_only=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp) / "daemon.log"
            with open(log, "w") as out:
                daemon = subprocess.Popen(
                    [sys.executable, "-m", "mmtrace.agent", "run", "--state-dir",
                     str(Path(tmp) / "state"), "--socket", str(Path(tmp) / "s.sock"), "--lib",
                     str(natives.cudart), "--pid", str(loop.pid), "--trace-launches",
                     "--metrics-address", f"127.0.0.1:{port}"], stdout=out,
                    stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 120
                while "gpu/npu probes live" not in log.read_text():
                    if daemon.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the daemon did not go live:\n" + log.read_text())
                    time.sleep(0.1)
                took = loop.run(launches)
                deadline = time.monotonic() + 60
                while sum(scrape(port)) < launches and time.monotonic() < deadline:
                    time.sleep(0.2)
                kept, lost = scrape(port)
            finally:
                loop.close()
                daemon.send_signal(signal.SIGTERM)
                daemon.wait(timeout=60)
        runs.append({"launches": launches, "loop_s": took, "rate_per_s": launches / took,
                     "kept": kept, "lost": lost})
    return {"runs": runs, "kept_fraction": [r["kept"] / r["launches"] for r in runs]}


def _launches_in(path: Path, pid: int) -> int:
    """cudaLaunchKernel events of process `pid` in a recording (failed calls
    included: without a driver every launch fails)."""
    from mmtrace.agent.recording.file_format import RecordingReader
    from mmtrace.bpf import device
    n = 0
    with RecordingReader(path) as reader:
        for piece in reader.pieces("dev.event"):
            n += int(np.count_nonzero((piece["kind"] == device.KIND_IDS["launch"])
                                      & (piece["pid"] == pid)))
    return n


def _ready(loop: Loop) -> bool:
    import select
    readable, _, _ = select.select([loop.proc.stdout], [], [], 0)
    if readable:
        loop.proc.stdout.readline()
        return True
    return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--iterations", type=int, default=2_000)
    parser.add_argument("--launches-per-sync", type=int, default=64)
    parser.add_argument("--launch-ns", type=int, default=4_000,
                        help="host work after each launch, standing in for a real launch")
    parser.add_argument("--events", type=int, default=300_000)
    parser.add_argument("--record-launches", type=int, default=300_000)
    parser.add_argument("--record-repeat", type=int, default=3)
    parser.add_argument("--record-return-every", type=int, default=64,
                        help="record's --launch-return-every (0: every launch in one line)")
    parser.add_argument("--only", choices=["per_call", "pieces", "adaptive", "python_cpu",
                                           "record", "daemon"],
                        action="append", help="run these sections only (repeatable)")
    parser.add_argument("--skip-static", action="store_true",
                        help="per_call on the shared libcudart only, not the static runtime")
    parser.add_argument("-o", "--output", default=str(ROOT / "bench" / "out" / "gpu_probes.json"))
    args = parser.parse_args(argv)
    from gpu_fixtures import build_natives, build_program
    with tempfile.TemporaryDirectory() as tmp:
        natives = build_natives(Path(tmp))
        # A private copy of libcudart: uprobes that other tracers left on the
        # shared file's inode make bcc's attach by symbol fail (EINVAL).
        cudart = Path(tmp) / "private" / natives.cudart.name
        cudart.parent.mkdir()
        shutil.copy(natives.cudart, cudart)
        natives = dataclasses.replace(natives, cudart=cudart, launch_loop=build_program(
            "launch_loop.c", cudart.parent, [cudart]))
        wanted = set(args.only or ("per_call", "pieces", "adaptive", "python_cpu", "record",
                                   "daemon"))
        sections = {
            "per_call": lambda: per_call(natives.launch_loop, natives.cudart, args.calls,
                                         args.repeat),
            "pieces": lambda: launch_pieces(natives.launch_loop, natives.cudart, args.calls,
                                            args.repeat),
            "adaptive": lambda: adaptive(natives, args.iterations, args.launches_per_sync,
                                         args.launch_ns, args.repeat),
            "python_cpu": lambda: python_cpu(natives, args.events),
            "record": lambda: record_loss(natives, args.record_launches, args.record_repeat,
                                          args.record_return_every),
            "daemon": lambda: daemon_loss(natives, args.record_launches, args.record_repeat),
        }
        results = {name: run() for name, run in sections.items() if name in wanted}
        static_loop = nvcc_build(NATIVE / "launch_loop.c", "-cudart", "static", f"-I{NATIVE}",
                                 name="launch_loop-static") if (
            "per_call" in wanted and not args.skip_static) else None
        if static_loop is not None:
            # A private copy too: tests running beside may probe the built one.
            static_loop = Path(shutil.copy(static_loop, cudart.parent / static_loop.name))
            results["per_call_static"] = per_call(static_loop, static_loop, args.calls,
                                                  args.repeat)
    print_table(results)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")


def per_call_rows(c: dict, what: str) -> list[tuple]:
    return [
        (f"cudaLaunchKernel ({what}), untraced", f"{c['untraced_ns']:.0f} ns/call", ""),
        ("  + empty program, uprobe_multi link", f"{c['empty_multi_ns']:.0f} ns/call", ""),
        ("  + mmtrace, uprobe_multi link, every call failing (all returns probed)",
         f"{c['traced_multi_ns']:.0f} ns/call",
         f"{c['traced_multi_vs_empty']:.3f}x empty; decoder {c['decoder_ns_multi']:.0f} ns"),
        ("  + mmtrace, uprobe_multi link, no return probed (63 calls in 64 that succeed)",
         f"{c['traced_multi_entry_ns']:.0f} ns/call",
         f"{c['traced_multi_entry_vs_empty']:.3f}x empty (goal <= 1.15); decoder "
         f"{c['decoder_ns_multi_entry']:.0f} ns"),
        ("  + empty program, bcc uprobe", f"{c['empty_single_ns']:.0f} ns/call", ""),
        ("  + mmtrace, bcc uprobe, every launch a whole 144-byte record",
         f"{c['traced_single_whole_ns']:.0f} ns/call",
         f"{c['traced_single_whole_vs_empty']:.3f}x empty"),
        ("  + mmtrace, bcc uprobe per symbol", f"{c['traced_single_ns']:.0f} ns/call",
         f"{c['traced_single_vs_empty']:.3f}x empty (goal <= 1.15); decoder "
         f"{c['decoder_ns_single']:.0f} ns"),
        ("  + floor: a 144-byte ring record, stamped (bcc uprobe)",
         f"{c['floor_ring_single_ns']:.0f} ns/call",
         f"{c['floor_ring_single_vs_empty']:.3f}x empty"),
        ("  + floor: a 24-byte ring record, stamped (bcc uprobe)",
         f"{c['floor_small_ring_single_ns']:.0f} ns/call",
         f"{c['floor_small_ring_single_vs_empty']:.3f}x empty"),
        ("  + floor: six arguments read, one map update (bcc uprobe)",
         f"{c['floor_args_map_single_ns']:.0f} ns/call",
         f"{c['floor_args_map_single_vs_empty']:.3f}x empty"),
    ] + [(f"  {what}, median of round ratios", f"{c[f'{name}_median_vs_empty']:.3f}x", "")
         for name, what in (("traced_single", "mmtrace, bcc uprobe"),
                            ("traced_single_whole", "mmtrace, every launch whole (before)"),
                            ("floor_written_144_single", "floor: 144 bytes written"),
                            ("floor_written_64_single", "floor: 64 bytes written"),
                            ("floor_written_56_single", "floor: 56 bytes written"),
                            ("floor_ring_single", "floor: 144 bytes, stamped"),
                            ("floor_small_ring_single", "floor: 24 bytes, stamped"),
                            ("floor_args_map_single", "floor: six arguments, a map update"))
         if f"{name}_median_vs_empty" in c]


def print_table(r: dict):
    rows = per_call_rows(r["per_call"], "libcudart.so.12") if "per_call" in r else []
    if "per_call_static" in r:
        rows += per_call_rows(r["per_call_static"], "static runtime in the executable")
    if "pieces" in r:
        rows += launch_pieces_module.rows_of(r["pieces"])
    if "adaptive" in r:
        rows += adaptive_rows(r["adaptive"])
    if "python_cpu" in r:
        p = r["python_cpu"]
        rows += [
            ("Python CPU, record path", f"{p['record_path_us_per_event']:.3f} µs/event",
             f"{p['events']:,} events, {p['lost']} lost"),
            ("Python CPU, alignment ring", f"{p['aligner_us_per_event']:.3f} µs/event", ""),
        ]
    for run in r.get("record", {}).get("runs", []):
        rows.append((f"mmtrace record, {run['launches']:,} launches back to back "
                     f"({run['rate_per_s'] / 1e6:.2f} M/s)",
                     f"{run['kept'] / run['launches']:.1%} kept",
                     f"{run['kept']:,} in the file ({run['file_bytes'] / 2**20:.0f} MiB), "
                     f"{run['lost']:,} lost: {run['lost_by']}"))
    for run in r.get("daemon", {}).get("runs", []):
        rows.append((f"mmtrace run, {run['launches']:,} launches back to back "
                     f"({run['rate_per_s'] / 1e6:.2f} M/s)",
                     f"{run['kept'] / run['launches']:.1%} kept",
                     f"{run['kept']:,} counted, {run['lost']:,} lost (ringbuf_full_dev)"))
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>16}  {note}")


def adaptive_rows(a: dict) -> list[tuple]:
    return [
        (f"loop of {a['launches_per_sync']} launches + copy + sync, untraced",
         f"{a['untraced_s'] * 1e3:.1f} ms", f"launch stand-in {a['launch_ns_stand_in']} ns"),
        ("  adaptive (launch probes off)", f"{a['adaptive_s'] * 1e3:.1f} ms",
         f"{a['adaptive_vs_untraced']:.3f}x untraced (goal <= 1.02); "
         f"{a['launch_events_in_adaptive_mode']} launch events"),
        ("  everything traced", f"{a['fully_traced_s'] * 1e3:.1f} ms",
         f"{a['fully_traced_vs_untraced']:.3f}x untraced"),
    ]


if __name__ == "__main__":
    main()
