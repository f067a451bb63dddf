"""report and export on large recordings: events/s and peak RSS.

    python bench/bench_recording.py [--sizes-mib 128 2048] [--baseline-rev REV]
                                    [--runq-per-drain 2000] [--launches 16]
                                    [--commands "export perfetto" ...]

Writes a synthetic recording of each size through the real writer (the
run-queue stream of a busy host and two GPU server processes launching,
copying and syncing, drained every 25 ms: tests/synthetic_recording.py),
then runs `mmtrace report --json` and `mmtrace export` in every format, each
in its own process, output to /dev/null, and reports wall and CPU time,
events per second (of wall time, and of CPU time: the host may be shared)
and peak RSS (the child's ru_maxrss, which is its
VmHWM). With --baseline-rev, the same commands of that git revision run
side by side on the sizes up to --baseline-max-mib (the old reader holds
the whole file and more). Figures go to bench/out/recording.json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from peak_rss import measure, mmtrace  # noqa: E402
from synthetic_recording import write_synthetic  # noqa: E402

COMMANDS = {
    "report": ["report", "{file}", "--json"],
    "export jsonl": ["export", "{file}", "--format", "jsonl", "-o", os.devnull],
    "export chrome": ["export", "{file}", "--format", "chrome", "-o", os.devnull],
    "export perfetto": ["export", "{file}", "--format", "perfetto", "-o", os.devnull],
}


def baseline_env(rev: str, where: Path) -> dict:
    """An environment whose `mmtrace` is revision `rev` of this tree."""
    src, pkg = where / "src", where / "pkg" / "mmtrace"
    src.mkdir(parents=True)
    pkg.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "agent", "bpf",
                              "detectors", "exporters", "dispatch"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    for name in ("agent", "bpf", "detectors", "exporters", "dispatch"):
        (pkg / name).symlink_to(src / name)
    return {**os.environ, "PYTHONPATH": str(where / "pkg")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[128, 2048])
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
    opts = ap.parse_args()
    opts.dir.mkdir(parents=True, exist_ok=True)
    envs = {"this": dict(os.environ)}
    tmp = tempfile.TemporaryDirectory()
    if opts.baseline_rev:
        envs["baseline"] = baseline_env(opts.baseline_rev, Path(tmp.name))
    results = []
    for mib in opts.sizes_mib:
        path = opts.dir / f"synthetic-{mib}MiB.mmtr"
        counts = write_synthetic(path, mib << 20, runq_per_drain=opts.runq_per_drain,
                                 launches=opts.launches)
        events = sum(counts.values())
        size = path.stat().st_size
        print(f"{path.name}: {size / 2**20:.0f} MiB, {events:,} events "
              f"({counts['dev.event']:,} GPU)", flush=True)
        for name in opts.commands:
            template = COMMANDS[name]
            for which, env in envs.items():
                if which == "baseline" and mib > opts.baseline_max_mib:
                    continue
                args = [a.replace("{file}", str(path)) for a in template]
                r = measure(mmtrace(*args), env)
                r.update(command=name, implementation=which, file_mib=round(size / 2**20),
                         events=events, events_per_s=round(events / r["wall_s"]),
                         events_per_cpu_s=round(events / max(r["cpu_s"], 0.01)))
                results.append(r)
                status = "" if r["exit"] == 0 else f"  FAILED: {r['stderr'][-300:]}"
                print(f"  {name:<16} {which:<9} {r['wall_s']:7.1f} s wall {r['cpu_s']:7.1f} s CPU"
                      f"  {r['events_per_s'] / 1e6:5.2f} M events/s "
                      f"({r['events_per_cpu_s'] / 1e6:5.2f} M per CPU s)  "
                      f"peak RSS {r['peak_rss_mb']:7.1f} MB{status}", flush=True)
        if not opts.keep:
            path.unlink()
    out = ROOT / "bench" / "out"
    out.mkdir(exist_ok=True)
    (out / "recording.json").write_text(json.dumps(
        {"host": platform.node(), "cpus": os.cpu_count(), "results": results}, indent=2))


if __name__ == "__main__":
    main()
