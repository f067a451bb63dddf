"""Runs the coverage-guided fuzz targets of tests/fuzz (atheris, libFuzzer).

A target is `tests/fuzz/fuzz_<name>.py`: it calls atheris.Setup() and
atheris.Fuzz() under `if __name__ == "__main__"`, and its seed inputs lie in
`tests/fuzz/seeds/<name>/`. New inputs that libFuzzer finds go to a working
corpus, never into the seeds, so a run leaves the checkout as it was.
"""

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
PER_INPUT_TIMEOUT_S = 10      # one input running longer than this is a hang
RSS_LIMIT_MB = 2048
# A long run is made of fuzzer sessions this long, each starting from the
# corpus the previous ones grew. atheris keeps the results of instrumented
# comparisons of numpy arrays alive (tracemalloc shows the boolean arrays
# of `sections["type"] == kind` and the like in symbols.py retained): the
# elf_symbols target grows about 4.6 KB per input, 2 GB in two minutes,
# where the same code run without instrumentation stays flat. One long
# session would end at the RSS limit, not on a bug.
SESSION_S = 60


@dataclass
class FuzzRun:
    target: str
    returncode: int
    runs: int
    output: str

    @property
    def clean(self) -> bool:
        return self.returncode == 0 and self.runs > 0


def targets() -> list[str]:
    return sorted(p.stem.removeprefix("fuzz_") for p in FUZZ_DIR.glob("fuzz_*.py"))


def run(target: str, seconds: int, workdir: Path, session_s: int = SESSION_S) -> FuzzRun:
    """Fuzz `target` for `seconds`, in sessions of at most `session_s`
    sharing one corpus; the first failing session ends the run. Crashes
    and hangs land in workdir."""
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    seeds = FUZZ_DIR / "seeds" / target
    if seeds.is_dir():
        for seed in seeds.iterdir():
            shutil.copy(seed, corpus / seed.name)
    runs, outputs, left = 0, [], seconds
    while True:
        session = min(left, session_s)
        returncode, done, output = _session(target, session, workdir, corpus)
        runs += done
        outputs.append(output)
        left -= session
        if returncode != 0 or done == 0 or left <= 0:
            return FuzzRun(target, returncode, runs, "".join(outputs))


def _session(target: str, seconds: int, workdir: Path, corpus: Path) -> tuple[int, int, str]:
    cmd = [sys.executable, str(FUZZ_DIR / f"fuzz_{target}.py"),
           f"-max_total_time={seconds}", f"-timeout={PER_INPUT_TIMEOUT_S}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={workdir}/", str(corpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                          timeout=seconds + 120)
    output = proc.stdout + proc.stderr
    done = re.findall(r"Done (\d+) runs", output)
    return proc.returncode, int(done[-1]) if done else 0, output
