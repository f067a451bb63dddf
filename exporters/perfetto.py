"""Native Perfetto trace (protobuf TracePacket stream) for ui.perfetto.dev.

Every thread gets a track (grouped under its process); each event that has
a duration becomes a slice on its thread's track. Field numbers are those
of Perfetto's trace_packet.proto / track_event.proto / track_descriptor.proto.
"""

from dataclasses import dataclass

from .protowire import field_bytes, field_str, field_varint

# Trace
TRACE_PACKET = 1
# TracePacket
TP_TIMESTAMP = 8
TP_SEQUENCE_ID = 10
TP_TRACK_EVENT = 11
TP_SEQUENCE_FLAGS = 13
TP_TRACK_DESCRIPTOR = 60
SEQ_INCREMENTAL_STATE_CLEARED = 1
# TrackDescriptor
TD_UUID = 1
TD_NAME = 2
TD_PROCESS = 3
TD_THREAD = 4
TD_PARENT_UUID = 5
# ProcessDescriptor / ThreadDescriptor
PD_PID = 1
PD_NAME = 6
THD_PID = 1
THD_TID = 2
THD_NAME = 5
# TrackEvent
TE_TYPE = 9
TE_TRACK_UUID = 11
TE_CATEGORIES = 22
TE_NAME = 23
SLICE_BEGIN = 1
SLICE_END = 2
INSTANT = 3

SEQUENCE_ID = 7


@dataclass(frozen=True)
class Slice:
    pid: int
    tid: int
    thread_name: str
    category: str
    name: str
    start_ns: int
    duration_ns: int | None     # None: an instant


def _packet(*fields: bytes) -> bytes:
    return field_bytes(TRACE_PACKET, field_varint(TP_SEQUENCE_ID, SEQUENCE_ID) + b"".join(fields))


def process_uuid(pid: int) -> int:
    return 1 << 61 | pid            # 0 is Perfetto's global track


def thread_uuid(pid: int, tid: int) -> int:
    return 1 << 62 | pid << 32 | tid


def _descriptors(slices):
    seen_pids, seen_threads = set(), set()
    first = True
    for s in slices:
        if s.pid not in seen_pids:
            seen_pids.add(s.pid)
            desc = field_varint(TD_UUID, process_uuid(s.pid)) + field_bytes(
                TD_PROCESS, field_varint(PD_PID, s.pid))
            flags = field_varint(TP_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED) if first else b""
            first = False
            yield _packet(flags, field_bytes(TP_TRACK_DESCRIPTOR, desc))
        if (s.pid, s.tid) not in seen_threads:
            seen_threads.add((s.pid, s.tid))
            thread = (field_varint(THD_PID, s.pid) + field_varint(THD_TID, s.tid)
                      + field_str(THD_NAME, s.thread_name))
            desc = (field_varint(TD_UUID, thread_uuid(s.pid, s.tid))
                    + field_varint(TD_PARENT_UUID, process_uuid(s.pid))
                    + field_bytes(TD_THREAD, thread))
            yield _packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))


def _slice_packets(s: Slice):
    track = field_varint(TE_TRACK_UUID, thread_uuid(s.pid, s.tid))
    labels = field_str(TE_CATEGORIES, s.category) + field_str(TE_NAME, s.name)
    if s.duration_ns is None:
        instant = field_varint(TE_TYPE, INSTANT) + track + labels
        yield _packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, instant))
        return
    begin = field_varint(TE_TYPE, SLICE_BEGIN) + track + labels
    end = field_varint(TE_TYPE, SLICE_END) + track
    yield _packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, begin))
    yield _packet(field_varint(TP_TIMESTAMP, s.start_ns + s.duration_ns),
                  field_bytes(TP_TRACK_EVENT, end))


def write_perfetto(slices: list[Slice], out) -> int:
    """Write slices (any order) as a binary Perfetto trace; returns their number."""
    slices = sorted(slices, key=lambda s: s.start_ns)
    for packet in _descriptors(slices):
        out.write(packet)
    for s in slices:
        for packet in _slice_packets(s):
            out.write(packet)
    return len(slices)


def runq_slices(runq) -> list[Slice]:
    """A run-queue wait ends when the thread gets the CPU."""
    return [Slice(pid, tid, comm.decode(errors="replace"), "cpu", "runq", ts - delay, delay)
            for ts, delay, pid, tid, comm in zip(
                runq["ts_ns"].tolist(), runq["delay_ns"].tolist(), runq["pid"].tolist(),
                runq["tid"].tolist(), runq["comm"].tolist())]


def device_slices(rows, thread_names: dict) -> list[Slice]:
    """GPU/NPU calls on their calling thread: the time inside the call where
    it was measured, else an instant; named by op, else by API."""
    ev = rows.events
    out = []
    for i, (pid, tid, ts, dur, flags) in enumerate(zip(
            ev["pid"].tolist(), ev["tid"].tolist(), ev["ts_ns"].tolist(),
            ev["duration_ns"].tolist(), ev["flags"].tolist())):
        out.append(Slice(pid, tid, thread_names.get((pid, tid), str(tid)),
                         f"{rows.stream[i]}.{rows.kind[i]}", rows.op_name[i] or rows.api[i],
                         ts, dur if flags & 1 else None))   # FLAG_RETURNED
    return out


def recording_slices(events: dict, meta=()) -> list[Slice]:
    slices = []
    names = {}
    runq = events.get("cpu.runq")
    if runq is not None and len(runq):
        slices = runq_slices(runq)
        names = {(s.pid, s.tid): s.thread_name for s in slices}
    device = events.get("dev.event")
    if device is not None and len(device):
        from mmtrace.agent.device_view import DeviceContext, decode
        rows = decode(device, DeviceContext.from_meta(list(meta)))
        for pid, tid, comm in zip(device["pid"].tolist(), device["tid"].tolist(),
                                  device["comm"].tolist()):
            names.setdefault((pid, tid), comm.decode(errors="replace"))
        slices += device_slices(rows, names)
    return slices
