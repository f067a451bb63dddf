"""agent/heap.py: the resident size a trim is judged by."""

import numpy as np

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
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True,
                          check=True)
    return int(done.stdout)


def test_a_one_shot_command_reuses_each_batchs_pages():
    # With glibc's defaults the heap's free top goes back to the kernel
    # (past twice the largest block freed), and comes back as page faults.
    assert _faults_after_the_first_batch("default") >= 19 * 512     # 2 MiB a batch
    assert _faults_after_the_first_batch("reuse") < 19 * 100
