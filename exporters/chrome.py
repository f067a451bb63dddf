"""Chrome trace-event JSON (opens in Perfetto UI and chrome://tracing).

A run-queue delay becomes a slice on the waiting thread's track that ends
when the thread got the CPU. A GPU/NPU call becomes a slice on its calling
thread's track (the time inside the call where measured, else an instant),
named by its op or API."""

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


def write_chrome(events: dict[str, np.ndarray], out, meta: list[dict] = ()) -> int:
    """Streams the trace as one JSON object; returns the number of events."""
    out.write('{"displayTimeUnit":"ns","traceEvents":[')
    n = 0
    runq = events.get("cpu.runq")
    if runq is not None and len(runq):
        for event in _runq_events(runq):
            out.write(("," if n else "") + json.dumps(event, separators=(",", ":")))
            n += 1
    device = events.get("dev.event")
    if device is not None and len(device):
        from mmtrace.agent.device_view import DeviceContext, decode
        for event in _device_events(decode(device, DeviceContext.from_meta(list(meta)))):
            out.write(("," if n else "") + json.dumps(event, separators=(",", ":")))
            n += 1
    out.write("]}\n")
    return n
