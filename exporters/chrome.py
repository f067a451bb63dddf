"""Chrome trace-event JSON (opens in Perfetto UI and chrome://tracing).

A run-queue delay becomes a slice on the waiting thread's track that ends
when the thread got the CPU."""

import json

import numpy as np


def _runq_events(runq: np.ndarray):
    names = {}
    for ts, delay, pid, tid, comm, cpu in zip(
            runq["ts_ns"].tolist(), runq["delay_ns"].tolist(), runq["pid"].tolist(),
            runq["tid"].tolist(), runq["comm"].tolist(), runq["cpu"].tolist()):
        names.setdefault((pid, tid), comm.decode(errors="replace"))
        yield {"name": "runq", "cat": "cpu", "ph": "X", "pid": pid, "tid": tid,
               "ts": (ts - delay) / 1e3, "dur": delay / 1e3, "args": {"cpu": cpu}}
    for (pid, tid), name in names.items():
        yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
               "args": {"name": name}}


def write_chrome(events: dict[str, np.ndarray], out) -> int:
    """Streams the trace as one JSON object; returns the number of events."""
    out.write('{"displayTimeUnit":"ns","traceEvents":[')
    n = 0
    runq = events.get("cpu.runq")
    if runq is not None and len(runq):
        for event in _runq_events(runq):
            out.write(("," if n else "") + json.dumps(event, separators=(",", ":")))
            n += 1
    out.write("]}\n")
    return n
