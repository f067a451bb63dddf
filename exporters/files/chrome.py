"""Chrome trace-event JSON (opens in Perfetto UI and chrome://tracing).

A run-queue delay becomes a slice on the waiting thread's track that ends
when the thread got the CPU. A GPU/NPU call becomes a slice on its calling
thread's track (the time inside the call where measured, else an instant),
named by its op or API. Written step by step: each thread's name goes out
as a metadata event when the thread first appears."""

import json

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.sched import wait_start_ns

from mmtrace.exporters.files.rowtext import (NO_LINES, Rows, first_per_thread, device_lines,
                                             json_texts, json_value, row_codes, write_merged)


def _runq_rows(runq: np.ndarray) -> Rows:
    """',{...}' per record: µs with three decimals are the exact ns."""
    return (Rows(len(runq), text=True).const(b',{"name":"runq","cat":"cpu","ph":"X","pid":')
            .decimal(runq["pid"]).const(b',"tid":').decimal(runq["tid"])
            .const(b',"ts":').fixed3(wait_start_ns(runq))
            .const(b',"dur":').fixed3(runq["delay_ns"])
            .const(b',"args":{"cpu":').decimal(runq["cpu"]).const(b"}}"))


def device_rows(rows) -> Rows:
    """',{...}' per GPU/NPU call, for a whole batch: a slice for the time
    inside the call where it was measured, else an instant; named by op,
    else by API."""
    ev = rows.events
    n = len(ev)
    # Named and filed per distinct (op, api) and (stream, kind), not per row.
    name_codes, names = row_codes(rows.op_name, rows.api)
    category_codes, categories = row_codes(rows.stream, rows.kind)
    copy = rows.direction != None  # noqa: E711  (elementwise on an object array)
    returned = (ev["flags"] & device_stream.FLAG_RETURNED) != 0
    return (Rows(n, text=True).const(b',{"name":')
            .table(name_codes, [json_value(op or api) for op, api in names])
            .const(b',"cat":').table(category_codes,
                                     [json_value(f"{s}.{k}") for s, k in categories])
            .const(b',"pid":').decimal(ev["pid"]).const(b',"tid":').decimal(ev["tid"])
            .const(b',"ts":').fixed3(ev["ts_ns"])
            .const(b',"args":{"api":').table(*json_texts(rows.api))
            .const(b',"op_id":').optional(ev["op_id"] != 0, Rows(n, text=True).decimal(ev["op_id"]))
            .const(b',"stream_handle":').decimal(ev["stream_handle"])
            .const(b',"sched_delay_us":').fixed3(ev["sched_delay_ns"])
            .optional(copy, Rows(n, text=True).const(b',"bytes":').decimal(ev["bytes"])
                      .const(b',"direction":').table(*json_texts(rows.direction)), absent=b"")
            .optional(ev["retired_ns"] >= 0, Rows(n, text=True).const(b',"retired_us":')
                      .fixed3(ev["retired_ns"]), absent=b"")
            .optional(returned, Rows(n, text=True).const(b',"ret":').signed(ev["ret"]),
                      absent=b"")
            .optional(rows.failed, Rows(n, text=True).const(b',"error":')
                      .table(*json_texts(rows.error)), absent=b"")
            .const(b"}")
            .optional(returned, Rows(n, text=True).const(b',"ph":"X","dur":')
                      .fixed3(ev["duration_ns"]), absent=b',"ph":"i","s":"t"')
            .const(b"}"))


def _dump(event: dict) -> bytes:
    return b"," + json.dumps(event, separators=(",", ":")).encode()


class _AfterFirst:
    """Passes writes through, less the very first byte (every event is
    written with a comma before it; the first one must not be)."""

    def __init__(self, out):
        self.out = out
        self.started = False

    def write(self, data):
        if not self.started and len(data):
            data = data[1:]
            self.started = True
        self.out.write(data)


class ChromeWriter:
    """Writes the events of each replay step (agent/recording/replay.py) as they come."""

    def __init__(self, out):
        self.out = _AfterFirst(out)
        self.events = 0
        self._named: set = set()

    def _names(self, pids, tids, comms) -> bytes:
        """Metadata events naming the threads not named yet."""
        out = []
        for pid, tid, comm in zip(pids, tids, comms):
            if (pid, tid) not in self._named:
                self._named.add((pid, tid))
                out.append(_dump({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                                  "args": {"name": comm.decode(errors="replace")}}))
        return b"".join(out)

    def step(self, step):
        runq, device = step.part("cpu.runq"), step.device_rows()
        if runq is not None:
            self.out.write(self._names(*first_per_thread(runq)))
        others, keys = NO_LINES, np.zeros(0, np.uint64)
        if device is not None:
            self.out.write(self._names(*first_per_thread(device.events)))
            if runq is None:
                device_lines(device_rows, device, self.out)
            else:
                others, keys = device_lines(device_rows, device), device.events["ts_ns"]
        if runq is not None:
            start = wait_start_ns(runq)
            order = np.argsort(start, kind="stable")
            write_merged(self.out, _runq_rows, runq[order], start[order], others, keys)
        self.events += (0 if runq is None else len(runq)) + (0 if device is None else len(device))


def write_chrome(steps, out) -> int:
    """Stream `steps` as one trace JSON object to the binary stream `out`;
    returns the number of events."""
    out.write(b'{"displayTimeUnit":"ns","traceEvents":[')
    writer = ChromeWriter(out)
    for step in steps:
        writer.step(step)
    out.write(b"]}\n")
    return writer.events
