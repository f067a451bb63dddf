"""Coverage-guided fuzzing. The parsers of outside input (hint socket
messages, the daemon's config, recording files) run MMTRACE_FUZZ_SECONDS
each (60 in CI, 10 elsewhere); the other targets, a third of that.
bench/fuzz runs them all longer."""

import os

import pytest

import fuzzing

SECONDS = int(os.environ.get("MMTRACE_FUZZ_SECONDS")
              or (60 if os.environ.get("CI") == "true" else 10))
OUTSIDE_INPUT = {"socket", "config", "recording"}


@pytest.mark.slow
@pytest.mark.parametrize("target", fuzzing.targets())
def test_fuzz_target_finds_no_crash_or_hang(target, tmp_path):
    seconds = SECONDS if target in OUTSIDE_INPUT else max(5, SECONDS // 3)
    run = fuzzing.run(target, seconds, tmp_path)
    assert run.clean, f"fuzz_{target} (exit {run.returncode}, {run.runs} runs):\n{run.output[-6000:]}"


def test_the_outside_input_parsers_have_fuzz_targets():
    assert OUTSIDE_INPUT <= set(fuzzing.targets())
