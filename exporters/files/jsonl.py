"""JSON Lines export: one object per event with the keys of the interface
spec, in time order across streams."""

import json

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.exporters.files.rowtext import (NO_LINES, Rows, device_lines, json_texts, json_value,
                                             strings, write_merged)

# Every line carries every key of the spec, null where it does not apply.
KEYS = ("ts_ns", "stream", "kind", "pid", "tid", "comm", "api", "op_id", "op_name",
        "handle", "stream_handle", "grid", "block", "shared_mem_bytes", "bytes",
        "direction", "duration_ns", "sched_delay_ns", "retired_ns", "device", "ret")


def runq_rows(runq: np.ndarray) -> Rows:
    """One line per run-queue record (newline included), for a whole batch."""
    comm_codes, comms = strings(runq["comm"])
    return (Rows(len(runq), text=True).const(b'{"ts_ns":').decimal(runq["ts_ns"])
            .const(b',"stream":"cpu","kind":"runq","pid":').decimal(runq["pid"])
            .const(b',"tid":').decimal(runq["tid"])
            .const(b',"comm":').table(comm_codes, [json_text(c) for c in comms])
            .const(b',"api":null,"op_id":null,"op_name":null,"handle":null,'
                   b'"stream_handle":null,"grid":null,"block":null,"shared_mem_bytes":null,'
                   b'"bytes":null,"direction":null,"duration_ns":').decimal(runq["delay_ns"])
            .const(b',"sched_delay_ns":null,"retired_ns":null,"device":null,"ret":null}\n'))


def json_text(raw: bytes) -> bytes:
    return json.dumps(raw.decode(errors="replace")).encode()


def device_rows(rows) -> Rows:
    """One line per GPU/NPU event of a recording's decoded DeviceRows (newline
    included), for a whole batch."""
    ev = rows.events
    n = len(ev)
    ds = device_stream
    # Stream, kind and the fields a row fills follow from its API id.
    by_api = rows.api_groups()
    has = {name: by_api.filling(name) for name in (ds.HANDLE, ds.STREAM, ds.GRID, ds.BLOCK,
                                                   ds.SHARED_MEM, ds.BYTES)}
    sync = by_api.of_kinds("sync")
    from_record = (ev["flags"] & device_stream.FLAG_STREAM_FROM_RECORD) != 0
    # An event sync whose record was not seen has no stream.
    stream_known = has[ds.STREAM] & ~(sync & has[ds.HANDLE] & ~from_record)

    def number(values):
        return Rows(n, text=True).decimal(values)

    def number_signed(values):
        return Rows(n, text=True).signed(values)

    def triple(prefix):
        return (Rows(n, text=True).const(b"[").decimal(ev[prefix + "_x"]).const(b", ")
                .decimal(ev[prefix + "_y"]).const(b", ").decimal(ev[prefix + "_z"]).const(b"]"))

    comm_codes, comms = strings(ev["comm"])
    return (Rows(n, text=True).const(b'{"ts_ns":').decimal(ev["ts_ns"])
            .const(b',"stream":').table(by_api.inverse, [json_value(v) for v in by_api.stream])
            .const(b',"kind":').table(by_api.inverse, [json_value(v) for v in by_api.kind])
            .const(b',"pid":').decimal(ev["pid"]).const(b',"tid":').decimal(ev["tid"])
            .const(b',"comm":').table(comm_codes, [json_text(c) for c in comms])
            .const(b',"api":').table(*json_texts(rows.api))
            .const(b',"op_id":').optional(ev["op_id"] != 0, number(ev["op_id"]))
            .const(b',"op_name":').table(*json_texts(rows.op_name))
            .const(b',"handle":').optional(has[ds.HANDLE], number(ev["handle"]))
            .const(b',"stream_handle":').optional(stream_known, number(ev["stream_handle"]))
            .const(b',"grid":').optional(has[ds.GRID], triple("grid"))
            .const(b',"block":').optional(has[ds.BLOCK], triple("block"))
            .const(b',"shared_mem_bytes":').optional(has[ds.SHARED_MEM],
                                                     number(ev["shared_mem_bytes"]))
            .const(b',"bytes":').optional(has[ds.BYTES], number(ev["bytes"]))
            .const(b',"direction":').table(*json_texts(rows.direction))
            .const(b',"duration_ns":').optional((ev["flags"] & ds.FLAG_RETURNED) != 0,
                                                number(ev["duration_ns"]))
            .const(b',"sched_delay_ns":').decimal(ev["sched_delay_ns"])
            .const(b',"retired_ns":').optional(~sync & (ev["retired_ns"] >= 0),
                                               number(ev["retired_ns"]))
            .const(b',"device":').optional(ev["device"] >= 0, number(ev["device"]))
            .const(b',"ret":').optional(ds.returned(ev), number_signed(ev["ret"]))
            .const(b"}\n"))



def write_step(step, out) -> int:
    """Write one replay step (agent/recording/replay.py) as lines in time order;
    returns the number of lines."""
    runq, device = step.part("cpu.runq"), step.device_rows()
    if runq is None:
        if device is not None:
            device_lines(device_rows, device, out)
        return 0 if device is None else len(device)
    others = device_lines(device_rows, device) if device is not None else NO_LINES
    keys = device.events["ts_ns"] if device is not None else np.zeros(0, np.uint64)
    write_merged(out, runq_rows, runq, runq["ts_ns"], others, keys)
    return len(runq) + len(others)


def write_jsonl(steps, out) -> int:
    """Write the events of `steps` (a recording's replay) to the binary
    stream `out`; returns the number of lines."""
    return sum(write_step(step, out) for step in steps)
