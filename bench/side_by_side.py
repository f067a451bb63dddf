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
