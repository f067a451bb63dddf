"""Chrome trace-event JSON (opens in Perfetto UI and chrome://tracing).

A run-queue delay becomes a slice on the waiting thread's track that ends
when the thread got the CPU. A GPU/NPU call becomes a slice on its calling
thread's track (the time inside the call where measured, else an instant),
named by its op or API. Written step by step: each thread's name goes out
as a metadata event when the thread first appears."""

import json

import numpy as np

from mmtrace.agent.replay import first_per_thread
from mmtrace.bpf.sched import wait_start_ns

from .rowtext import Rows, write_merged


def _runq_rows(runq: np.ndarray) -> Rows:
    """',{...}' per record: µs with three decimals are the exact ns."""
    return (Rows(len(runq), text=True).const(b',{"name":"runq","cat":"cpu","ph":"X","pid":')
            .decimal(runq["pid"]).const(b',"tid":').decimal(runq["tid"])
            .const(b',"ts":').fixed3(wait_start_ns(runq))
            .const(b',"dur":').fixed3(runq["delay_ns"])
            .const(b',"args":{"cpu":').decimal(runq["cpu"]).const(b"}}"))


def _device_events(rows):
    ev = rows.events
    ts = ev["ts_ns"].tolist()
    dur = ev["duration_ns"].tolist()
    flags = ev["flags"].tolist()
    for i, (pid, tid) in enumerate(zip(ev["pid"].tolist(), ev["tid"].tolist())):
        args = {"api": rows.api[i], "op_id": int(ev["op_id"][i]) or None,
                "stream_handle": int(ev["stream_handle"][i]),
                "sched_delay_us": ev["sched_delay_ns"][i] / 1e3}
        if rows.direction[i] is not None:
            args.update(bytes=int(ev["bytes"][i]), direction=rows.direction[i])
        if ev["retired_ns"][i] >= 0:
            args["retired_us"] = int(ev["retired_ns"][i]) / 1e3
        event = {"name": rows.op_name[i] or rows.api[i], "cat": f"{rows.stream[i]}.{rows.kind[i]}",
                 "pid": pid, "tid": tid, "ts": ts[i] / 1e3, "args": args}
        if flags[i] & 1:    # FLAG_RETURNED: the time inside the call
            event.update(ph="X", dur=dur[i] / 1e3)
        else:
            event.update(ph="i", s="t")
        yield event


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
    """Writes the events of each replay step (agent/replay.py) as they come."""

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
        others = []
        if device is not None:
            ev = device.events
            self.out.write(self._names(ev["pid"].tolist(), ev["tid"].tolist(),
                                       ev["comm"].tolist()))
            others = [_dump(e) for e in _device_events(device)]
        if runq is None:
            for row in others:
                self.out.write(row)
        else:
            start = wait_start_ns(runq)
            order = np.argsort(start, kind="stable")
            write_merged(self.out, _runq_rows, runq[order], start[order], others,
                         device.events["ts_ns"] if device is not None else np.zeros(0, np.uint64))
        self.events += (0 if runq is None else len(runq)) + len(others)


def write_chrome(steps, out) -> int:
    """Stream `steps` as one trace JSON object to the binary stream `out`;
    returns the number of events."""
    out.write(b'{"displayTimeUnit":"ns","traceEvents":[')
    writer = ChromeWriter(out)
    for step in steps:
        writer.step(step)
    out.write(b"]}\n")
    return writer.events
