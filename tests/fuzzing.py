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


def run(target: str, seconds: int, workdir: Path) -> FuzzRun:
    """Fuzz `target` for `seconds`; crashes and hangs land in workdir."""
    corpus = workdir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    seeds = FUZZ_DIR / "seeds" / target
    if seeds.is_dir():
        for seed in seeds.iterdir():
            shutil.copy(seed, corpus / seed.name)
    cmd = [sys.executable, str(FUZZ_DIR / f"fuzz_{target}.py"),
           f"-max_total_time={seconds}", f"-timeout={PER_INPUT_TIMEOUT_S}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={workdir}/", str(corpus)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                          timeout=seconds + 120)
    output = proc.stdout + proc.stderr
    done = re.findall(r"Done (\d+) runs", output)
    return FuzzRun(target, proc.returncode, int(done[-1]) if done else 0, output)
