"""The fuzz targets as regression tests (tests/fuzzing.py): each replays
its committed corpus, every crash ever found included, then runs a
bounded search from a fixed seed for a fixed number of inputs. The same
commit gives the same verdict; the open search, random and longer, is
bench/fuzz's.

The run counts give each target 1-8 s on this 2-core host, a few of
them its start (the suite must stay under 20 minutes; bench/fuzz searches
for as long as asked, and the corpus replay above stays complete); the
parsers of outside input (hint socket messages, the daemon's config,
recording files) get the most. A seeded search of N runs is the first N
inputs of the longer one from the same seed."""

import pytest

import fuzzing

SEED = 1
RUNS = {
    "config": 7_500,
    "config_env": 2_500,
    "dispatch_hints": 25_000,
    "elf_symbols": 5_000,
    "event_counts": 1_250,
    "policy_loop": 5_000,
    "recording": 7_500,
    "socket": 7_500,
}
OUTSIDE_INPUT = {"socket", "config", "recording"}


@pytest.mark.parametrize("target", fuzzing.targets())
def test_fuzz_corpus_replays_clean(target, tmp_path):
    run = fuzzing.replay(target, tmp_path)
    assert run.clean and run.runs == len(fuzzing.corpus(target)), (
        f"fuzz_{target} (exit {run.returncode}, {run.runs} of {len(fuzzing.corpus(target))} "
        f"inputs):\n{run.output[-6000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("target", fuzzing.targets())
def test_fuzz_seeded_search_finds_no_crash_or_hang(target, tmp_path):
    run = fuzzing.search(target, tmp_path, seed=SEED, runs=RUNS[target])
    assert run.clean and run.runs >= RUNS[target], (
        f"fuzz_{target} (exit {run.returncode}, {run.runs} runs; replay: "
        f"{run.replay_commands()}):\n{run.output[-6000:]}")


def test_every_target_has_a_corpus_and_a_run_count():
    assert set(RUNS) == set(fuzzing.targets())
    assert all(fuzzing.corpus(t) for t in fuzzing.targets())
    assert OUTSIDE_INPUT <= set(fuzzing.targets())


def test_a_seeded_search_explores_the_same_inputs_twice(tmp_path):
    """What makes the verdict repeatable: one seed, one path of discoveries."""
    def discoveries(workdir):
        run = fuzzing.search("dispatch_hints", workdir, seed=7, runs=20_000)
        assert run.clean, run.output[-3000:]
        return sorted(p.name for p in (workdir / "corpus").iterdir())
    first = discoveries(tmp_path / "a")
    assert len(first) > len(fuzzing.corpus("dispatch_hints"))
    assert discoveries(tmp_path / "b") == first


def test_a_crash_is_reported_with_the_command_that_replays_it(tmp_path):
    """A target that fails on its own corpus: replay says so, and names the file."""
    target = tmp_path / "fuzz" / "fuzz_broken.py"
    target.parent.mkdir()
    target.write_text(
        "import sys\nimport atheris\n"
        "def test_one_input(data):\n"
        "    if data.startswith(b'boom'):\n"
        "        raise RuntimeError('boom')\n"
        "atheris.Setup(sys.argv, test_one_input)\natheris.Fuzz()\n")
    (tmp_path / "fuzz" / "corpus" / "broken").mkdir(parents=True)
    (tmp_path / "fuzz" / "corpus" / "broken" / "ok").write_bytes(b"fine")
    (tmp_path / "fuzz" / "corpus" / "broken" / "crash-boom").write_bytes(b"boom")
    saved = fuzzing.FUZZ_DIR, fuzzing.CORPUS_DIR
    fuzzing.FUZZ_DIR, fuzzing.CORPUS_DIR = target.parent, target.parent / "corpus"
    try:
        run = fuzzing.replay("broken", tmp_path / "work")
        searched = fuzzing.search("broken", tmp_path / "search", seconds=5)
    finally:
        fuzzing.FUZZ_DIR, fuzzing.CORPUS_DIR = saved
    assert not run.clean and "RuntimeError: boom" in run.output
    assert not searched.clean and searched.artifacts
    (command,) = searched.replay_commands()
    assert command.endswith(str(searched.artifacts[0])) and "fuzz_broken.py" in command
    assert searched.artifacts[0].read_bytes().startswith(b"boom")
