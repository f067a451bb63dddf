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
