"""JSON Lines export: one object per event with the keys of the interface
spec, in time order across streams."""

import json

import numpy as np

from mmtrace.bpf import device as device_stream

# Every line carries every key of the spec, null where it does not apply.
KEYS = ("ts_ns", "stream", "kind", "pid", "tid", "comm", "api", "op_id", "op_name",
        "handle", "stream_handle", "grid", "block", "shared_mem_bytes", "bytes",
        "direction", "duration_ns", "sched_delay_ns", "retired_ns", "device")


def _runq_lines(runq: np.ndarray):
    comm_json = {}
    for ts, delay, pid, tid, comm in zip(runq["ts_ns"].tolist(), runq["delay_ns"].tolist(),
                                         runq["pid"].tolist(), runq["tid"].tolist(),
                                         runq["comm"].tolist()):
        quoted = comm_json.get(comm)
        if quoted is None:
            quoted = comm_json[comm] = json.dumps(comm.decode(errors="replace"))
        yield ts, (
            f'{{"ts_ns":{ts},"stream":"cpu","kind":"runq","pid":{pid},"tid":{tid},'
            f'"comm":{quoted},"api":null,"op_id":null,"op_name":null,"handle":null,'
            f'"stream_handle":null,"grid":null,"block":null,"shared_mem_bytes":null,'
            f'"bytes":null,"direction":null,"duration_ns":{delay},"sched_delay_ns":null,'
            f'"retired_ns":null,"device":null}}')


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


STREAM_LINES = {"cpu.runq": _runq_lines}


def iter_lines(events: dict[str, np.ndarray], meta: list[dict] = ()):
    """Lines of every known schema, merged by timestamp. `meta` is the
    recording's meta chunks (API table, op-name tables) for GPU/NPU events."""
    import heapq
    sources = []
    for name, records in events.items():
        if name in STREAM_LINES and len(records):
            order = np.argsort(records["ts_ns"], kind="stable")
            sources.append(STREAM_LINES[name](records[order]))
    device = events.get("dev.event")
    if device is not None and len(device):
        from mmtrace.agent.device_view import DeviceContext, decode
        sources.append(_device_lines(decode(device, DeviceContext.from_meta(list(meta)))))
    for _, line in heapq.merge(*sources, key=lambda item: item[0]):
        yield line


def write_jsonl(events: dict[str, np.ndarray], out, meta: list[dict] = ()) -> int:
    n = 0
    for line in iter_lines(events, meta):
        out.write(line)
        out.write("\n")
        n += 1
    return n
