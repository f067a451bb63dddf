"""Coverage-guided fuzzing of everything that parses outside input: the
hint socket's messages, the daemon's config, recording files. Each target
runs MMTRACE_FUZZ_SECONDS (60 in CI, 10 elsewhere); bench/fuzz runs longer."""

import os

import pytest

import fuzzing

SECONDS = int(os.environ.get("MMTRACE_FUZZ_SECONDS")
              or (60 if os.environ.get("CI") == "true" else 10))


@pytest.mark.slow
@pytest.mark.parametrize("target", fuzzing.targets())
def test_fuzz_target_finds_no_crash_or_hang(target, tmp_path):
    run = fuzzing.run(target, SECONDS, tmp_path)
    assert run.clean, f"fuzz_{target} (exit {run.returncode}, {run.runs} runs):\n{run.output[-6000:]}"
