"""Device memory: what bpf/device_memory.c adds to the device stream.

Allocations and frees are device records (bpf/device.py DEV_EVENT) of the
kinds "alloc" and "free", read at the call's return:
- alloc: `bytes` asked for, `handle` the device pointer (0 when the call
  failed: a failed allocation holds nothing), `stream_handle` for the
  async calls;
- free: `handle` the pointer, `bytes` and `device` those of its
  allocation (0 bytes when it was allocated before tracing).
The kernel keeps live allocations in a bounded map; an allocation it had
no room for is flagged and never counted as held, so that its free, which
finds nothing, leaves no negative hole.
"""

import numpy as np

from mmtrace.bpf import device as device_stream

SOURCE = "device_memory.c"
ALLOCATIONS_MAP = "allocations"
COUNTERS_MAP = "memory_counters"
ALLOC = device_stream.KIND_IDS["alloc"]
FREE = device_stream.KIND_IDS["free"]

# Flags of alloc/free records (device_memory.c), beside enum dev_flag's.
FLAG_ALLOC_UNTRACKED = 32
FLAG_FREE_UNMATCHED = 64

# enum memory_counter, in its order.
MEMORY_COUNTERS = ("allocation_map_full", "free_unmatched", "nested_calls")

# struct allocation_key / struct allocation: the kernel's live allocations.
ALLOCATION_KEY = np.dtype([("pid", "<u4"), ("pad", "<u4"), ("ptr", "<u8")])
ALLOCATION = np.dtype([("bytes", "<u8"), ("ts_ns", "<u8"), ("device", "<i4"),
                       ("api", "<u2"), ("pad", "<u2")])


def ok(events: np.ndarray) -> np.ndarray:
    """Calls that returned 0."""
    return device_stream.returned(events) & (events["ret"] == 0)


def held(events: np.ndarray) -> np.ndarray:
    """Allocations that now hold memory: succeeded, with a pointer, kept."""
    return (events["kind"] == ALLOC) & ok(events) & (events["handle"] != 0) & \
        ((events["flags"] & FLAG_ALLOC_UNTRACKED) == 0)


def released(events: np.ndarray) -> np.ndarray:
    """Frees that gave memory back (their allocation was seen)."""
    return (events["kind"] == FREE) & ok(events) & (events["bytes"] > 0)


def failed_allocations(events: np.ndarray) -> np.ndarray:
    return (events["kind"] == ALLOC) & device_stream.failed(events)


def read_counters(table) -> dict[str, int]:
    """The per-CPU memory counters, summed; never cleared."""
    if len(table) != len(MEMORY_COUNTERS):
        raise RuntimeError(f"{COUNTERS_MAP}: expected {len(MEMORY_COUNTERS)} entries, "
                           f"the compiled program has {len(table)}")
    return {name: int(sum(table[table.Key(i)])) for i, name in enumerate(MEMORY_COUNTERS)}


def forget_processes(table, pids) -> int:
    """Drop exited processes' live allocations from the kernel's map (their
    entries would hold the map's room for ever); how many went."""
    pids = set(pids)
    # Each key once: a key deleted under the reader restarts the kernel's walk.
    keys = list({bytes(k): k for k in table.keys() if k.pid in pids}.values())
    for k in keys:
        try:
            del table[k]
        except KeyError:
            pass
    return len(keys)
