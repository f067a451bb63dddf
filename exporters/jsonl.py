"""JSON Lines export: one object per event with the keys of the interface
spec, in time order across streams."""

import json

import numpy as np

from mmtrace.bpf import device as device_stream

from .rowtext import Rows, strings, write_merged

# Every line carries every key of the spec, null where it does not apply.
KEYS = ("ts_ns", "stream", "kind", "pid", "tid", "comm", "api", "op_id", "op_name",
        "handle", "stream_handle", "grid", "block", "shared_mem_bytes", "bytes",
        "direction", "duration_ns", "sched_delay_ns", "retired_ns", "device")


def runq_rows(runq: np.ndarray) -> Rows:
    """One line per run-queue record (newline included), for a whole batch."""
    codes, comms = strings(runq["comm"])
    return (Rows(len(runq), text=True).const(b'{"ts_ns":').decimal(runq["ts_ns"])
            .const(b',"stream":"cpu","kind":"runq","pid":').decimal(runq["pid"])
            .const(b',"tid":').decimal(runq["tid"])
            .const(b',"comm":').table(codes, [json_text(c) for c in comms])
            .const(b',"api":null,"op_id":null,"op_name":null,"handle":null,'
                   b'"stream_handle":null,"grid":null,"block":null,"shared_mem_bytes":null,'
                   b'"bytes":null,"direction":null,"duration_ns":').decimal(runq["delay_ns"])
            .const(b',"sched_delay_ns":null,"retired_ns":null,"device":null}\n'))


def json_text(raw: bytes) -> bytes:
    return json.dumps(raw.decode(errors="replace")).encode()


def _null(value):
    return "null" if value is None else str(value)


def _device_lines(rows):
    """One line per GPU/NPU event of agent.device_view.DeviceRows (time order)."""
    ev = rows.events
    cols = {name: ev[name].tolist() for name in (
        "ts_ns", "pid", "tid", "op_id", "handle", "stream_handle", "bytes",
        "shared_mem_bytes", "duration_ns", "sched_delay_ns", "retired_ns", "device", "flags")}
    grids = np.stack([ev["grid_x"], ev["grid_y"], ev["grid_z"]], axis=1).tolist()
    blocks = np.stack([ev["block_x"], ev["block_y"], ev["block_z"]], axis=1).tolist()
    comms = ev["comm"].tolist()
    quoted: dict = {}

    def q(value):
        if value is None:
            return "null"
        text = quoted.get(value)
        if text is None:
            raw = value.decode(errors="replace") if isinstance(value, bytes) else value
            text = quoted[value] = json.dumps(raw)
        return text

    returned = device_stream.FLAG_RETURNED
    from_record = 16    # agent.align.FLAG_STREAM_FROM_RECORD
    for i in range(len(ev)):
        f = rows.fields[i]
        kind = rows.kind[i]
        flags = cols["flags"][i]
        op_id = cols["op_id"][i] or None
        stream_handle = cols["stream_handle"][i] if device_stream.STREAM in f else None
        if kind == "sync" and device_stream.HANDLE in f and not flags & from_record:
            stream_handle = None        # an event sync whose record was not seen
        retired = cols["retired_ns"][i] if kind != "sync" else -1
        device = cols["device"][i]
        yield cols["ts_ns"][i], (
            f'{{"ts_ns":{cols["ts_ns"][i]},"stream":"{rows.stream[i]}","kind":"{kind}",'
            f'"pid":{cols["pid"][i]},"tid":{cols["tid"][i]},"comm":{q(comms[i])},'
            f'"api":{q(rows.api[i])},"op_id":{_null(op_id)},"op_name":{q(rows.op_name[i])},'
            f'"handle":{_null(cols["handle"][i] if device_stream.HANDLE in f else None)},'
            f'"stream_handle":{_null(stream_handle)},'
            f'"grid":{json.dumps(grids[i]) if device_stream.GRID in f else "null"},'
            f'"block":{json.dumps(blocks[i]) if device_stream.BLOCK in f else "null"},'
            f'"shared_mem_bytes":'
            f'{_null(cols["shared_mem_bytes"][i] if device_stream.SHARED_MEM in f else None)},'
            f'"bytes":{_null(cols["bytes"][i] if device_stream.BYTES in f else None)},'
            f'"direction":{q(rows.direction[i])},'
            f'"duration_ns":{_null(cols["duration_ns"][i] if flags & returned else None)},'
            f'"sched_delay_ns":{cols["sched_delay_ns"][i]},'
            f'"retired_ns":{_null(retired if retired >= 0 else None)},'
            f'"device":{_null(device if device >= 0 else None)}}}')


def write_step(step, out) -> int:
    """Write one replay step (agent/replay.py) as lines in time order;
    returns the number of lines."""
    runq = step.records.get("cpu.runq")
    n_runq = 0 if runq is None else len(runq)
    device = list(_device_lines(step.device)) if step.device is not None else []
    if not n_runq:
        for _, line in device:
            out.write(line.encode() + b"\n")
        return len(device)
    write_merged(out, runq_rows, runq, runq["ts_ns"], [line.encode() + b"\n" for _, line in device],
                 np.array([ts for ts, _ in device], np.uint64))
    return n_runq + len(device)


def write_jsonl(steps, out) -> int:
    """Write the events of `steps` (agent.replay.replay) to the binary
    stream `out`; returns the number of lines."""
    return sum(write_step(step, out) for step in steps)
