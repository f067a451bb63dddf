"""Perfetto packets one event at a time: a recording's events as Slices
and Counters, and the packets of each. The streaming writer encodes whole
batches (perfetto_rows, perfetto_device) to the same bytes; these are
what it is checked against, and what writes NVML's few samples."""

import struct
from dataclasses import dataclass

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.device import NOT_RETIRED as NONE
from mmtrace.bpf.device import SUBMISSION_KINDS

from mmtrace.exporters.files.perfetto_call_annotations import call_bytes, call_fields
from mmtrace.exporters.files.perfetto_fields import (
    TP_TIMESTAMP, TP_TRACK_EVENT, TE_TYPE, TE_TRACK_UUID, TE_CATEGORIES, TE_NAME,
    TE_COUNTER_VALUE, TE_DOUBLE_COUNTER_VALUE, TE_FLOW_IDS, TE_TERMINATING_FLOW_IDS,
    SLICE_BEGIN, SLICE_END, INSTANT, COUNTER, packet, trace_start)
from mmtrace.exporters.files.perfetto_tracks import (GPU_COUNTERS, Tracks, copied_uuid, flow_id,
                                                     gpu_counter_uuid, stream_uuid, thread_uuid)
from mmtrace.exporters.files.protowire import field_bytes, field_fixed64, field_str, field_varint, varint


@dataclass(frozen=True)
class Slice:
    pid: int
    tid: int
    thread_name: str
    category: str
    name: str
    start_ns: int
    duration_ns: int | None     # None: an instant
    track: int | None = None    # None: the thread's track
    flow_ids: tuple = ()                # flows that start here
    terminating_flow_ids: tuple = ()    # flows that end here
    annotations: bytes = b""            # encoded debug annotations (a call's fields)


@dataclass(frozen=True)
class Counter:
    track: int
    ts_ns: int
    value: int


def _descriptors(slices):
    tracks = Tracks()
    for s in slices:
        yield from tracks.new(s.pid, s.tid, s.thread_name)


def slice_packets(s: Slice):
    uuid = thread_uuid(s.pid, s.tid) if s.track is None else s.track
    track = field_varint(TE_TRACK_UUID, uuid)
    labels = field_str(TE_CATEGORIES, s.category) + field_str(TE_NAME, s.name)
    flows = b"".join([field_fixed64(TE_FLOW_IDS, f) for f in s.flow_ids]
                     + [field_fixed64(TE_TERMINATING_FLOW_IDS, f)
                        for f in s.terminating_flow_ids])
    if s.duration_ns is None:
        instant = field_varint(TE_TYPE, INSTANT) + track + labels + flows + s.annotations
        yield packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, instant))
        return
    begin = field_varint(TE_TYPE, SLICE_BEGIN) + track + labels + flows + s.annotations
    end = field_varint(TE_TYPE, SLICE_END) + track
    yield packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, begin))
    yield packet(field_varint(TP_TIMESTAMP, s.start_ns + s.duration_ns),
                  field_bytes(TP_TRACK_EVENT, end))


def counter_packets(c: Counter):
    event = (field_varint(TE_TYPE, COUNTER) + field_varint(TE_TRACK_UUID, c.track)
             + field_varint(TE_COUNTER_VALUE, c.value))
    yield packet(field_varint(TP_TIMESTAMP, c.ts_ns), field_bytes(TP_TRACK_EVENT, event))


def gpu_state_packets(samples: np.ndarray, tracks: Tracks):
    """Each NVML sample's utilisations on its GPU's counter tracks (one a
    second per GPU: written one by one), as (timestamp, packet); a track's
    descriptor first, as (None, packet)."""
    for row in samples.tolist():
        sample = dict(zip(samples.dtype.names, row))
        for which, (key, _) in enumerate(GPU_COUNTERS):
            for descriptor in tracks.gpu(sample["gpu"], which):
                yield None, descriptor
            event = (field_varint(TE_TYPE, COUNTER)
                     + field_varint(TE_TRACK_UUID, gpu_counter_uuid(sample["gpu"], which))
                     + varint(TE_DOUBLE_COUNTER_VALUE << 3 | 1)
                     + struct.pack("<d", sample[key] * 100.0))
            yield sample["ts_ns"], packet(field_varint(TP_TIMESTAMP, sample["ts_ns"]),
                                          field_bytes(TP_TRACK_EVENT, event))


def item_packets(item) -> bytes:
    return b"".join(counter_packets(item) if isinstance(item, Counter) else slice_packets(item))


def write_perfetto(slices: list[Slice], out) -> int:
    """Write slices (any order) as a binary Perfetto trace, the packets in
    time order; returns their number."""
    slices = sorted(slices, key=lambda s: s.start_ns)
    out.write(trace_start(0, None))
    for packet in _descriptors(slices):
        out.write(packet)
    stamped = [(p.start_ns if p.duration_ns is None or k == 0 else p.start_ns + p.duration_ns,
                packet) for p in slices for k, packet in enumerate(slice_packets(p))]
    for _, packet in sorted(stamped, key=lambda item: item[0]):
        out.write(packet)
    return len(slices)


def runq_slices(runq) -> list[Slice]:
    """A run-queue wait ends when the thread gets the CPU."""
    return [Slice(pid, tid, comm.decode(errors="replace"), "cpu", "runq", ts - delay, delay)
            for ts, delay, pid, tid, comm in zip(
                runq["ts_ns"].tolist(), runq["delay_ns"].tolist(), runq["pid"].tolist(),
                runq["tid"].tolist(), runq["comm"].tolist())]


def device_items(rows, thread_names: dict) -> list[list]:
    """Per GPU/NPU call, one event at a time: its Slice on its calling thread
    (the time inside the call where it was measured, else an instant; named
    by op, else by API), with the flow it starts (a submission a later sync
    retired) or the flows it ends (the sync that retired them); a retired
    submission's Slice on its stream's track; a memcpy's Counter of the
    bytes its process has copied so far."""
    ev = rows.events
    fields = call_fields(rows)
    pending, copied, out = {}, {}, []
    for i, row in enumerate(ev.tolist()):
        e = dict(zip(ev.dtype.names, row))
        pid, ts, kind = e["pid"], e["ts_ns"], rows.kind[i]
        returned = bool(e["flags"] & device_stream.FLAG_RETURNED)
        end = ts + e["duration_ns"]
        category, name = f"{rows.stream[i]}.{kind}", rows.op_name[i] or rows.api[i]
        starts, ends, items = (), (), []
        retired = e["retired_ns"]
        in_flight = kind in SUBMISSION_KINDS and retired != NONE
        pending = {k: v for k, v in pending.items() if k[1] >= ts}
        if in_flight and not (returned and retired == end):
            starts = (flow_id(pid, e["op_id"]),)
            pending.setdefault((pid, retired), []).extend(starts)
        elif kind == "sync" and returned:
            ends = tuple(pending.pop((pid, end), ()))
        thread = thread_names.get((pid, e["tid"]), str(e["tid"]))
        items.append(Slice(pid, e["tid"], thread, category, name, ts,
                           e["duration_ns"] if returned else None,
                           flow_ids=starts, terminating_flow_ids=ends,
                           annotations=call_bytes(fields, i)))
        if in_flight:
            items.append(Slice(pid, e["tid"], thread, category, name, ts, retired - ts,
                               track=stream_uuid(pid, e["stream_handle"])))
        if kind == "memcpy":
            copied[pid] = copied.get(pid, 0) + e["bytes"]
            items.append(Counter(copied_uuid(pid), ts, copied[pid]))
        out.append(items)
    return out
