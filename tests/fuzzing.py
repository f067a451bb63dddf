"""Runs the coverage-guided fuzz targets of tests/fuzz (atheris, libFuzzer).

A target is `tests/fuzz/fuzz_<name>.py`: it calls atheris.Setup() and
atheris.Fuzz() under `if __name__ == "__main__"`. Its committed corpus,
`tests/fuzz/corpus/<name>/`, holds the seed inputs and every crash ever
found (named `crash-<what>`), kept with the fix that made it pass.

Three ways to run a target, kept apart as projects fuzzed under OSS-Fuzz
keep them:
- replay(): every corpus input once. The suite's regression test.
- search(seed=S, runs=N): a bounded search from the corpus, with a fixed
  seed and a fixed number of inputs, under PYTHONHASHSEED=0. The same
  commit explores the same inputs, so the suite's verdict is the same on
  every run.
- search(seconds=T): the open search (random seed, time-bounded) that
  bench/fuzz and the soak run. What it finds is printed with the command
  that replays it; add the file to the corpus with the fix.
New inputs that a search finds go to a working copy of the corpus under
`workdir`, never into the checkout.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
CORPUS_DIR = FUZZ_DIR / "corpus"
PER_INPUT_TIMEOUT_S = 10      # one input running longer than this is a hang
RSS_LIMIT_MB = 2048
# A long open search is made of fuzzer sessions this long, each starting
# from the corpus the previous ones grew. atheris keeps the results of
# instrumented comparisons of numpy arrays alive (tracemalloc shows the
# boolean arrays of `sections["type"] == kind` and the like in elf_reader.py
# retained): the elf_symbols target grows about 4.6 KB per input, 2 GB in
# two minutes, where the same code run without instrumentation stays flat.
# One long session would end at the RSS limit, not on a bug.
SESSION_S = 60
# Where the targets' own files go (TMPDIR): the config and recording targets
# write each input to a file for the loader to open, the policy target a
# /proc/stat. On ext4 a file truncated and written again is flushed when it
# is closed (auto_da_alloc): 2-5 ms an input on this host, most of what a
# seeded search of those targets spent. On tmpfs nothing is flushed, and the
# targets read the same bytes (the config and recording searches keep the
# same inputs; where objects hashed by address steer a search, policy_loop's,
# the environment's size moves the addresses, as any variable does, and the
# search takes another path, the same on every run).
SCRATCH_ROOT = Path("/dev/shm")
# libFuzzer's report of a crash or a hang: the file it wrote the input to.
_ARTIFACT = re.compile(r"Test unit written to (\S+)")


@dataclass
class FuzzRun:
    target: str
    returncode: int
    runs: int
    output: str
    artifacts: list[Path]

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and self.runs > 0

    def replay_commands(self) -> list[str]:
        """The command that replays each crash or hang this run found."""
        script = FUZZ_DIR / f"fuzz_{self.target}.py"
        return [f"{sys.executable} {script} {path}" for path in self.artifacts]


def targets() -> list[str]:
    return sorted(p.stem.removeprefix("fuzz_") for p in FUZZ_DIR.glob("fuzz_*.py"))


def corpus(target: str) -> list[Path]:
    """The committed inputs of `target`, in a stable order."""
    folder = CORPUS_DIR / target
    return sorted(p for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def replay(target: str, workdir: Path) -> FuzzRun:
    """Run every committed input of `target` once; the first failure ends it."""
    inputs = corpus(target)
    if not inputs:      # without inputs libFuzzer would start an open search
        return FuzzRun(target, 1, 0, f"no corpus in {CORPUS_DIR / target}", [])
    returncode, _, output = _fuzzer(target, list(map(str, inputs)), workdir,
                                    timeout_s=60 + 10 * len(inputs), instrumented=False)
    # libFuzzer names each file as it runs it; a run that stopped early lists fewer
    ran = len(re.findall(r"^Running: ", output, re.M))
    return FuzzRun(target, returncode, ran, output, _artifacts(output))


def search(target: str, workdir: Path, *, seed: int | None = None, runs: int | None = None,
           seconds: int | None = None, session_s: int = SESSION_S) -> FuzzRun:
    """Fuzz `target` from its corpus: `runs` inputs from `seed` (the
    suite's bounded search, in one session), or for `seconds` from random
    seeds (the open search, in sessions of at most `session_s`). The
    first failing session ends the run; crashes and hangs land in workdir."""
    if (runs is None) == (seconds is None):
        raise ValueError("search: expected runs (with a seed) or seconds, not both")
    grown = workdir / "corpus"
    grown.mkdir(parents=True, exist_ok=True)
    for path in corpus(target):
        shutil.copy(path, grown / path.name)
    if runs is not None:
        # -reload=0: the corpus folder is not re-read on a timer
        returncode, done, output = _fuzzer(
            target, [f"-seed={seed if seed is not None else 1}", f"-runs={runs}", "-reload=0",
                     str(grown)], workdir, timeout_s=1800, fixed_addresses=True)
        return FuzzRun(target, returncode, done, output, _artifacts(output))
    total, outputs, left = 0, [], seconds
    while True:
        session = min(left, session_s)
        returncode, done, output = _fuzzer(target, [f"-max_total_time={session}", str(grown)],
                                           workdir, timeout_s=session + 120)
        total += done
        outputs.append(output)
        left -= session
        if returncode != 0 or done == 0 or left <= 0:
            text = "".join(outputs)
            return FuzzRun(target, returncode, total, text, _artifacts(text))


# A replay needs no coverage: the target is run as it is, its imports not
# instrumented (atheris.instrument_imports does nothing). Each input runs the
# same code; what is saved is rewriting every module it imports (numpy's
# too, for the recording and ELF targets: 8-15 s of a 10-16 s replay here).
_UNINSTRUMENTED = """
import contextlib, runpy, sys
import atheris
atheris.instrument_imports = lambda *args, **kwargs: contextlib.nullcontext()
sys.argv = sys.argv[1:]
sys.path[0] = sys.argv[0].rpartition("/")[0]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _fuzzer(target: str, args: list[str], workdir: Path, timeout_s: float,
            fixed_addresses: bool = False, instrumented: bool = True):
    """(exit status, inputs run, output) of one libFuzzer process."""
    workdir.mkdir(parents=True, exist_ok=True)
    launch = [] if instrumented else ["-c", _UNINSTRUMENTED]
    cmd = [sys.executable, *launch, str(FUZZ_DIR / f"fuzz_{target}.py"),
           f"-timeout={PER_INPUT_TIMEOUT_S}", f"-rss_limit_mb={RSS_LIMIT_MB}",
           f"-artifact_prefix={workdir}/", *args]
    # A fixed hash seed and, for a seeded search, no address randomisation:
    # the order of sets and of objects hashed by address, and so the
    # coverage that steers the search, are then the same on every run (with
    # either one random, two runs of one seed part within 2 000 inputs).
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if fixed_addresses and shutil.which("setarch"):
        cmd = ["setarch", os.uname().machine, "--addr-no-randomize", *cmd]
    scratch_root = SCRATCH_ROOT if os.access(SCRATCH_ROOT, os.W_OK | os.X_OK) else None
    with tempfile.TemporaryDirectory(prefix=f"fuzz-{target}-", dir=scratch_root) as scratch:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=timeout_s, env={**env, "TMPDIR": scratch})
    output = proc.stdout + proc.stderr
    done = re.findall(r"Done (\d+) runs", output)
    ran = int(done[-1]) if done else 0
    return proc.returncode, ran, output


def _artifacts(output: str) -> list[Path]:
    return [Path(p) for p in _ARTIFACT.findall(output)]
