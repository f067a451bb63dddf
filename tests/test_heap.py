"""agent/heap.py: the resident size a trim is judged by, and the one-shot
commands' malloc setting."""

import numpy as np
import pytest

from mmtrace.agent import heap


def test_resident_bytes_follow_what_the_process_touches():
    before = heap.resident_bytes()
    block = np.ones(32 << 20, np.uint8)        # 32 MiB, every page written
    grown = heap.resident_bytes()
    del block
    assert before > 0
    assert grown - before >= 30 << 20, (before, grown)
    assert heap.resident_bytes() < grown       # unmapped on free (past the mmap threshold)


REUSE = """
import resource, sys
import numpy as np
from mmtrace.agent import heap
# numpy asks for huge pages for large blocks: a 2 MiB page is one fault
# where transparent huge pages are on, so count in 4 KiB pages throughout.
np._core.multiarray._set_madvise_hugepage(False)
if sys.argv[1] == "reuse":
    assert heap.reuse_freed_blocks()
faults = []
for _ in range(20):             # three 8 MiB blocks, made and freed twenty times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(8 << 20, np.uint8) for _ in range(3)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[1:]))
"""


def _faults_after_the_first_batch(mode: str) -> int:
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True,
                          check=True, env=env)
    return int(done.stdout)


@pytest.mark.skipif(getattr(heap.libc(), "mallopt", None) is None, reason="no glibc mallopt")
def test_a_one_shot_command_reuses_each_batchs_pages():
    # With glibc's defaults the heap's free top goes back to the kernel
    # (past twice the largest block freed) and every batch faults its 24 MiB
    # in again (6 144 pages); kept, the pages are there for the next batch.
    assert _faults_after_the_first_batch("default") >= 19 * 2048     # 8 MiB a batch at least
    assert _faults_after_the_first_batch("reuse") < 19 * 100


def test_a_users_own_malloc_tuning_is_left_alone(monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "0")
    assert not heap.reuse_freed_blocks()


def test_report_and_export_ask_for_it(monkeypatch, tmp_path):
    from click.testing import CliRunner
    from mmtrace.agent import cli
    asked = []
    monkeypatch.setattr(heap, "reuse_freed_blocks", lambda: asked.append(True))
    for args in (["report", str(tmp_path / "missing.mmtr")],
                 ["export", str(tmp_path / "missing.mmtr"), "--format", "jsonl", "-o", "-"]):
        CliRunner().invoke(cli.cli, args)
    assert len(asked) == 2


THREADS = """
import os
import mmtrace.agent.cli
import numpy
print(os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")))
"""


def _command_process(env_extra: dict) -> tuple[str, int]:
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", THREADS], capture_output=True, text=True,
                          check=True, env={**env, **env_extra})
    setting, threads = done.stdout.split()
    return setting, int(threads)


def test_a_command_starts_no_blas_threads_unless_the_user_asks():
    # mmtrace does no linear algebra: numpy imported by the command line
    # starts no OpenBLAS thread per CPU (0.09 CPU-s a command on 2 CPUs).
    assert _command_process({}) == ("1", 1)
    setting, _ = _command_process({"OPENBLAS_NUM_THREADS": "2"})
    assert setting == "2"
