"""CPU stream: decoder for bpf/sched.c."""

import numpy as np

SOURCE = "sched.c"
RINGBUF = "runq_events"
LAYOUT_MAP = "layout_runq_event"
HIST_MAP = "runq_hist_log2_us"
SUM_MAP = "runq_delay_sum_ns"

# Mirrors struct runq_event; checked against the compiled layout at load time.
RUNQ_EVENT = np.dtype([
    ("ts_ns", "<u8"),
    ("delay_ns", "<u8"),
    ("blocked_ns", "<u8"),     # asleep before the wake-up that began this wait
    ("pid", "<u4"),
    ("tid", "<u4"),
    ("cpu", "<u4"),
    ("prev_tid", "<u4"),
    ("comm", "S16"),
])


def hist_from_table(table) -> list[int]:
    """The in-kernel log2 histogram (per-CPU sums), index k = [2^k, 2^(k+1)) µs."""
    return [int(sum(table[table.Key(k)])) for k in range(len(table))]


def sum_from_table(table) -> int:
    """The in-kernel sum of the histogram's delays, ns (per-CPU sums)."""
    return int(sum(table[table.Key(0)]))


def wait_start_ns(runq: np.ndarray) -> np.ndarray:
    """When each run-queue wait began: the switch-in time less the delay
    (never before 0, whatever a damaged record says)."""
    ts = runq["ts_ns"]
    return ts - np.minimum(runq["delay_ns"], ts)
