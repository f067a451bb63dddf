"""Names of the in-kernel loss and activity counters (common.h's enum)."""

COUNTER_NAMES = (
    "ringbuf_full_cpu",
    "enqueue_map_full",
    "thread_map_full",
    "negative_delta",
    "runq_events",
    "ringbuf_full_dev",
    "call_map_full",
    "user_read_failed",
    "dev_events",
    "return_without_entry",
    "call_abandoned",
    "name_truncated",
    "op_seq_map_full",
    "switch_in_unseen",
    "exited_unread",
    "failed_calls",
    "process_changes_full",
)

# Counters that mean an event or a fact was lost, not merely counted.
LOSS_COUNTERS = (
    "ringbuf_full_cpu",
    "enqueue_map_full",
    "thread_map_full",
    "ringbuf_full_dev",
    "call_map_full",
    "user_read_failed",
    "call_abandoned",
    "op_seq_map_full",
    "switch_in_unseen",
)


# Which stream each counter belongs to; the GPU and NPU programs share one
# ring buffer and one set of counters ("dev").
CPU_COUNTERS = frozenset({"ringbuf_full_cpu", "enqueue_map_full", "thread_map_full",
                          "negative_delta", "runq_events", "switch_in_unseen"})


def stream_of(counter: str) -> str:
    return "cpu" if counter in CPU_COUNTERS else "dev"


def since(now: dict[str, int], start: dict[str, int]) -> dict[str, int]:
    """Each counter's rise from `start` (counters are read, never cleared)."""
    return {name: value - start.get(name, 0) for name, value in now.items()}


def losses(counters: dict[str, int]) -> dict[str, int]:
    """The loss counters that are not zero, largest first."""
    found = {name: counters.get(name, 0) for name in LOSS_COUNTERS if counters.get(name, 0)}
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def describe_losses(counters: dict[str, int]) -> str:
    """What was lost, by stream and reason, for a person: "741,824 dev
    ringbuf_full_dev, 2 cpu switch_in_unseen" ("none" when nothing was)."""
    found = losses(counters)
    return ", ".join(f"{n:,} {stream_of(name)} {name}" for name, n in found.items()) or "none"


def read_counter(table, name: str) -> int:
    """One counter of the per-CPU array, summed."""
    return int(sum(table[table.Key(COUNTER_NAMES.index(name))]))


def read_counters(table) -> dict[str, int]:
    """Sum a per-CPU counter array; never clears it (other readers share it)."""
    if len(table) != len(COUNTER_NAMES):
        raise RuntimeError(
            f"counters map: expected {len(COUNTER_NAMES)} entries, "
            f"the compiled program has {len(table)}")
    totals = {}
    for index, name in enumerate(COUNTER_NAMES):
        totals[name] = int(sum(table[table.Key(index)]))
    return totals


def total_lost(counters: dict[str, int]) -> int:
    return sum(counters.get(name, 0) for name in LOSS_COUNTERS)
