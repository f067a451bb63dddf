"""In-process benches run on this tree and a baseline revision, side by
side: each tree's run is a child Python process (the baseline from a `git
archive` on PYTHONPATH, as bench_recording's baseline_env makes) that
prints one JSON document, and the trees alternate which goes first each
round."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_recording import baseline_env

# A child script's part that reads a recording whole, given `path` and
# `seconds` (and sys, numpy as np, RecordingReader imported): its run-queue
# and GPU/NPU records (runq, device) and their earliest and latest stamps
# (first, last); it exits unless both streams are there and span `seconds`.
RECORDED_STREAMS = r"""
with RecordingReader(path) as rec:
    runq, device = (list(rec.pieces(s)) for s in ("cpu.runq", "dev.event"))
if not runq or not device:
    sys.exit(f"{path}: expected run-queue and GPU/NPU events, got "
             f"{sum(map(len, runq))} and {sum(map(len, device))}")
runq, device = np.concatenate(runq), np.concatenate(device)
first = int(min(runq["ts_ns"].min(), device["ts_ns"].min()))
last = int(max(runq["ts_ns"].max(), device["ts_ns"].max()))
if first + int(seconds * 1e9) > last:
    sys.exit(f"{path}: expected at least {seconds:g} s of events, got {(last - first) / 1e9:.1f}")
"""


def run_child(bench: str, script: str, argv: list, env: dict):
    """`script` run by this Python with `argv` in `env`: what it printed, as JSON."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, argv)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{bench}: a tree's run failed:\n{done.stderr.strip()}")
    return json.loads(done.stdout)


def alternating_runs(bench: str, baseline_rev: str | None, rounds: int, run, describe) -> dict:
    """{tree: [run(env) of each round]} for "this" and baseline_rev (when
    given), in alternating order; describe(result) printed after each run."""
    with tempfile.TemporaryDirectory() as tmp:
        trees = [("this", dict(os.environ))]
        if baseline_rev:
            try:
                env = baseline_env(baseline_rev, Path(tmp) / "b")
            except subprocess.CalledProcessError as exc:
                raise SystemExit(f"{bench}: --baseline-rev {baseline_rev}: "
                                 f"{exc.stderr.decode(errors='replace').strip()}") from None
            trees.append((baseline_rev, env))
        runs = {name: [] for name, _ in trees}
        for r in range(rounds):
            for name, env in trees if r % 2 == 0 else trees[::-1]:
                runs[name].append(run(env))
                print(f"round {r + 1} {name}: {describe(runs[name][-1])}", flush=True)
    return runs
