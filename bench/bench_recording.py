"""report and export on large recordings: events/s and peak RSS.

    python bench/bench_recording.py [--sizes-mib 128 2048] [--baseline-rev REV]
                                    [--runq-per-drain 2000] [--launches 16]
                                    [--real-s 15 [--pairs 1] [--keep] | --mix-s 90 [--keep]
                                     | --recording F]
                                    [--commands "export perfetto" ...]

Writes a synthetic recording of each size through the real writer (the
run-queue stream of a busy host and two GPU server processes launching,
copying and syncing, drained every 25 ms: tests/synthetic_recording.py),
then runs `mmtrace report --json`, `mmtrace explain --json` and `mmtrace
export` in every format, each
in its own process, output to /dev/null, and reports wall and CPU time,
events per second (of wall time, and of CPU time: the host may be shared)
and peak RSS (the child's ru_maxrss, which is its
VmHWM). With --real-s (root), a real recording comes first: `mmtrace
record` for that long of a pipe ping-pong (tests/workloads/ctxswitch.c,
--pairs pairs: the scheduler stream at the rate this host switches, with
the cross-CPU disorder of a shared ring) and a launch loop on NVIDIA's
real libcudart (tests/native/launch_loop.c: launches, copies and syncs
that fail without a driver). With --mix-s (root), a recording of the
soak's mix instead: 20 000 paced run-queue events a second
(bench/paced_wakeups.c) beside the soak's GPU and NPU loops (a quarter of
the events are GPU/NPU calls, where each costs the exporters most). The
synthetic ones carry the same disorder.
With --baseline-rev, the same commands of that git revision run side by
side on the sizes up to --baseline-max-mib (the old reader holds the whole
file and more). Figures go to bench/out/recording.json.
"""

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from peak_rss import measure, mmtrace  # noqa: E402
from synthetic_recording import write_synthetic  # noqa: E402
import native  # noqa: E402

PACKAGES = ("agent", "bpf", "detectors", "exporters", "dispatch")
COMMANDS = {
    "report": ["report", "{file}", "--json"],
    "explain": ["explain", "{file}", "--json"],
    "export jsonl": ["export", "{file}", "--format", "jsonl", "-o", os.devnull],
    "export chrome": ["export", "{file}", "--format", "chrome", "-o", os.devnull],
    "export perfetto": ["export", "{file}", "--format", "perfetto", "-o", os.devnull],
}


def baseline_env(rev: str, where: Path) -> dict:
    """An environment whose `mmtrace` is revision `rev` of this tree."""
    src, pkg = where / "src", where / "pkg" / "mmtrace"
    src.mkdir(parents=True)
    pkg.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *PACKAGES], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(src / name)
    compile_bytecode(src)
    return {**os.environ, "PYTHONPATH": str(where / "pkg")}


def compile_bytecode(tree: Path):
    """Byte-compile a tree's packages, so that neither side compiles its
    modules at every start (PYTHONDONTWRITEBYTECODE, a fresh archive):
    tens of ms a command, more than the changes measured."""
    done = subprocess.run([sys.executable, "-m", "compileall", "-q",
                           *(str(tree / n) for n in PACKAGES)], stdout=subprocess.DEVNULL)
    if done.returncode:     # a tree we may not write: it compiles as it starts, as before
        print(f"note: {tree} could not be byte-compiled in full", file=sys.stderr)


def recording_counts(path: Path) -> dict[str, int]:
    """Events of a recording, by schema."""
    from mmtrace.agent.recording.file_format import RecordingReader
    with RecordingReader(path) as reader:
        return {name: sum(len(p) for p in reader.pieces(name)) for name in reader.schemas}


def real_recording(path: Path, seconds: int, pairs: int) -> dict[str, int]:
    """`mmtrace record` of a ping-pong and a launch loop; events by schema."""
    from gpu_fixtures import build_natives
    natives = build_natives(path.parent / "natives")
    pingpong = native.workload("ctxswitch")
    rec = _start_record(path, seconds, "--lib", natives.cudart)
    if not _live(rec):
        raise SystemExit(f"mmtrace record ended before its GPU/NPU stream was live "
                         f"(exit {rec.wait()})")
    loop = subprocess.Popen([natives.launch_loop], stdin=subprocess.PIPE, text=True,
                            stdout=subprocess.DEVNULL)
    loop.stdin.write(f"run {seconds * 4000} 4 50000\n")   # ~16 k launches/s, paced
    loop.stdin.flush()
    subprocess.run([pingpong, str(seconds), str(pairs)], check=True, stdout=subprocess.DEVNULL)
    rec.communicate(timeout=seconds + 60)
    loop.kill()
    loop.wait()
    if rec.returncode:
        raise SystemExit(f"mmtrace record failed (exit {rec.returncode})")
    return recording_counts(path)


def _start_record(path: Path, seconds: int, *args) -> subprocess.Popen:
    """`mmtrace record -o path --duration seconds *args`, its output piped."""
    return subprocess.Popen(mmtrace("record", "-o", path, "--duration", seconds, *args),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _live(rec: subprocess.Popen) -> bool:
    """Read `rec`'s output until it says its GPU/NPU stream is live; False
    if it ended first."""
    line = rec.stdout.readline()
    while line and not line.startswith("gpu/npu stream live"):
        line = rec.stdout.readline()
    return bool(line)


def mix_recording(path: Path, seconds: int) -> dict[str, int]:
    """`mmtrace record` of the soak's mix (bench/soak.py); events by schema.
    Every process is ended on every way out (record first interrupted, so
    that it detaches its probes and finishes its file)."""
    from soak import soak_loops
    with contextlib.ExitStack() as ends:
        loops, pids, extra = soak_loops(path.parent / "mix")
        for loop in loops:
            ends.callback(loop.stop)
        # Paced for far longer than the recording: it is killed at the end.
        pacer = subprocess.Popen([native.build(ROOT / "bench" / "paced_wakeups.c",
                                               flags=["-pthread"]),
                                  str(seconds + 600), "10000"], stdout=subprocess.DEVNULL)
        ends.callback(_end, pacer, kill=True)
        pids.append(pacer.pid)
        libs = [a for a in extra if a != "--trace-launches"]
        rec = _start_record(path, seconds, *(a for pid in pids for a in ("--pid", pid)), *libs)
        ends.callback(_end, rec)
        if not _live(rec):
            raise SystemExit(f"mmtrace record ended before its GPU/NPU stream was live "
                             f"(exit {rec.wait()})")
        for loop in loops:
            loop.start()
        rec.communicate(timeout=seconds + 60)
    if rec.returncode:
        raise SystemExit(f"mmtrace record failed (exit {rec.returncode})")
    return recording_counts(path)


def _end(proc: subprocess.Popen, kill: bool = False):
    """End `proc`: interrupted (killed, if `kill` or if it lingers 30 s);
    what it still writes to a pipe of ours is read meanwhile, so that a
    full pipe cannot hold it."""
    if proc.poll() is not None:
        return
    if kill:
        proc.kill()
    else:
        proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def _median_run(runs: list[dict]) -> dict:
    """The run of median CPU time (a failed one, if any failed), with every
    round's CPU and the highest peak RSS."""
    failed = [x for x in runs if x["exit"] != 0]
    runs = sorted(runs, key=lambda x: x["cpu_s"])
    r = dict(failed[0] if failed else runs[len(runs) // 2])
    r.update(rounds_cpu_s=[x["cpu_s"] for x in runs],
             peak_rss_mb=max(x["peak_rss_mb"] for x in runs))
    return r


def run_commands(opts, envs, path: Path, counts: dict, label: str, baseline: bool,
                 results: list):
    events = sum(counts.values())
    size = path.stat().st_size
    print(f"{path.name}: {size / 2**20:.0f} MiB, {events:,} events "
          f"({counts.get('dev.event', 0):,} GPU)", flush=True)
    for name in opts.commands:
        template = COMMANDS[name]
        args = [a.replace("{file}", str(path)) for a in template]
        which_envs = {w: e for w, e in envs.items() if w != "baseline" or baseline}
        # Interleaved rounds, each implementation's median (a shared host's
        # noise moves both alike).
        rounds = {w: [] for w in which_envs}
        for _ in range(opts.rounds):
            for which, env in which_envs.items():
                rounds[which].append(measure(mmtrace(*args), env))
        for which, runs in rounds.items():
            r = _median_run(runs)
            r.update(command=name, implementation=which, recording=label,
                     file_mib=round(size / 2**20), events=events,
                     events_per_s=round(events / r["wall_s"]),
                     events_per_cpu_s=round(events / max(r["cpu_s"], 0.01)),
                     events_per_cpu_s_best=round(events / max(min(r["rounds_cpu_s"]), 0.01)))
            results.append(r)
            status = "" if r["exit"] == 0 else f"  FAILED: {r['stderr'][-300:]}"
            print(f"  {name:<16} {which:<9} {r['wall_s']:7.1f} s wall {r['cpu_s']:7.1f} s CPU"
                  f"  {r['events_per_s'] / 1e6:5.2f} M events/s "
                  f"({r['events_per_cpu_s'] / 1e6:5.2f} M per CPU s, best round "
                  f"{r['events_per_cpu_s_best'] / 1e6:5.2f} M)  "
                  f"peak RSS {r['peak_rss_mb']:7.1f} MB{status}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="*", default=[128, 2048],
                    help="synthetic recordings of these sizes (none: --sizes-mib alone)")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/mmtrace-bench"))
    ap.add_argument("--baseline-rev", help="git revision to run side by side")
    ap.add_argument("--baseline-max-mib", type=int, default=256)
    ap.add_argument("--keep", action="store_true", help="keep the recordings")
    ap.add_argument("--runq-per-drain", type=int, default=2000,
                    help="run-queue events per 25 ms drain (default: a busy host)")
    ap.add_argument("--launches", type=int, default=16,
                    help="kernel launches per server process per drain")
    ap.add_argument("--commands", nargs="+", choices=list(COMMANDS), default=list(COMMANDS),
                    help="only these commands (default: all)")
    ap.add_argument("--real-s", type=int, default=0,
                    help="first a real recording of this many seconds (root; 0: none)")
    ap.add_argument("--pairs", type=int, default=1, help="ping-pong pairs of --real-s")
    ap.add_argument("--mix-s", type=int, default=0,
                    help="first a real recording of the soak's mix, this many seconds (root)")
    ap.add_argument("--recording", type=Path,
                    help="a real recording made before (--real-s with --keep): the same "
                         "file for every run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="interleaved runs of each command, the median's figures (default 1)")
    opts = ap.parse_args()
    opts.dir.mkdir(parents=True, exist_ok=True)
    compile_bytecode(ROOT)
    envs = {"this": dict(os.environ)}
    tmp = tempfile.TemporaryDirectory()
    if opts.baseline_rev:
        envs["baseline"] = baseline_env(opts.baseline_rev, Path(tmp.name))
    results = []
    if opts.real_s:
        path = opts.dir / f"real-{opts.real_s}s.mmtr"
        counts = real_recording(path, opts.real_s, opts.pairs)
        run_commands(opts, envs, path, counts, "real", True, results)
        if not opts.keep:
            path.unlink()
    if opts.mix_s:
        path = opts.dir / f"mix-{opts.mix_s}s.mmtr"
        counts = mix_recording(path, opts.mix_s)
        run_commands(opts, envs, path, counts, "mix", True, results)
        if not opts.keep:
            path.unlink()
    if opts.recording:
        run_commands(opts, envs, opts.recording, recording_counts(opts.recording), "given",
                     opts.recording.stat().st_size <= opts.baseline_max_mib << 20, results)
    for mib in opts.sizes_mib:
        path = opts.dir / f"synthetic-{mib}MiB.mmtr"
        counts = write_synthetic(path, mib << 20, runq_per_drain=opts.runq_per_drain,
                                 launches=opts.launches)
        run_commands(opts, envs, path, counts, "synthetic", mib <= opts.baseline_max_mib,
                     results)
        if not opts.keep:
            path.unlink()
    write_out("recording.json", results)


def write_out(name: str, results: list):
    """bench/out/NAME: the host and the results."""
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / name).write_text(json.dumps(
        {"host": platform.node(), "cpus": os.cpu_count(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
