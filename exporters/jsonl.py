"""JSON Lines export: one object per event with the keys of the interface
spec, in time order across streams."""

import json

import numpy as np

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


STREAM_LINES = {"cpu.runq": _runq_lines}


def iter_lines(events: dict[str, np.ndarray]):
    """Lines of every known schema, merged by timestamp."""
    import heapq
    sources = []
    for name, records in events.items():
        if name in STREAM_LINES and len(records):
            order = np.argsort(records["ts_ns"], kind="stable")
            sources.append(STREAM_LINES[name](records[order]))
    for _, line in heapq.merge(*sources, key=lambda item: item[0]):
        yield line


def write_jsonl(events: dict[str, np.ndarray], out) -> int:
    n = 0
    for line in iter_lines(events):
        out.write(line)
        out.write("\n")
        n += 1
    return n
