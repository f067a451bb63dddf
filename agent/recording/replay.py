"""A recording replayed in time order, step by step, in bounded memory:
the events of each schema, and the GPU/NPU events aligned and decoded.
Everything in a step comes before everything in the steps after it; within
a step each part is sorted by time, and a consumer that needs one order
across parts merges them itself. Works on a RecordingReader (streamed from
disk) and on an in-memory Recording alike."""

from dataclasses import dataclass, field

import numpy as np

from mmtrace.agent.recording.device_replay import DeviceReplay
from mmtrace.agent.recording.device_view import DeviceContext, DeviceRows
from mmtrace.agent.ingest.record_arrays import concat
from mmtrace.agent.recording.time_order import ordered_steps

DEVICE = "dev.event"
MAX_WAITING_BYTES = 16 << 20


@dataclass
class Step:
    records: dict[str, np.ndarray] = field(default_factory=dict)    # by schema, sorted
    device: DeviceRows | None = None

    def part(self, schema: str) -> np.ndarray | None:
        """The records of `schema` in this step; None when there are none."""
        records = self.records.get(schema)
        return records if records is not None and len(records) else None

    def device_rows(self) -> DeviceRows | None:
        return self.device if self.device is not None and len(self.device) else None


def replay(source, schemas=None, device_context: DeviceContext | None = None):
    """Yield Steps of `source` (all its schemas, or those named)."""
    names = [n for n in source.schemas if schemas is None or n in schemas]
    device = None
    if DEVICE in names:
        device = DeviceReplay(device_context or DeviceContext.from_meta(source.meta))
    waiting: dict[str, list[np.ndarray]] = {n: [] for n in names if n != DEVICE}
    held = 0
    steps = ordered_steps({n: source.pieces(n) for n in names},
                          {n: source.schemas[n] for n in names})
    for step in steps:
        rows = device.push(step.pop(DEVICE)) if device and DEVICE in step else None
        for name, records in step.items():
            waiting[name].append(records)
            held += records.nbytes
        if device is None:
            yield Step(_release(waiting, None), rows)
            held = 0
            continue
        horizon = device.horizon
        if held > MAX_WAITING_BYTES and horizon is not None:
            # Do not hold the other streams back without bound for a
            # submission whose sync may never come.
            newest = max(int(p[-1]["ts_ns"]) for parts in waiting.values() for p in parts)
            rows = _joined(rows, device.flush_until(newest))
            horizon = device.horizon
        released = _release(waiting, horizon)
        held -= sum(r.nbytes for r in released.values())
        if released or rows is not None:
            yield Step(released, rows)
    rows = device.finish() if device else None
    released = _release(waiting, None)
    if released or rows is not None:
        yield Step(released, rows)


def _joined(a: DeviceRows | None, b: DeviceRows | None) -> DeviceRows | None:
    if a is None or b is None:
        return a if b is None else b
    return DeviceRows(concat([a.events, b.events]),
                      *(np.concatenate([getattr(a, f), getattr(b, f)])
                        for f in ("stream", "kind", "api", "op_name", "direction")),
                      np.concatenate([a.fields, b.fields]), np.concatenate([a.error, b.error]))


def _release(waiting: dict, limit: int | None) -> dict[str, np.ndarray]:
    """The waiting records stamped before `limit` (None: all), by schema."""
    out = {}
    for name, parts in waiting.items():
        if not parts:
            continue
        records = concat(parts) if len(parts) > 1 else parts[0]
        k = len(records) if limit is None else int(
            np.searchsorted(records["ts_ns"], np.uint64(max(limit, 0)), side="left"))
        if k:
            out[name] = records[:k]
        waiting[name] = [records[k:]] if k < len(records) else []
    return out
