"""Native Perfetto trace (protobuf TracePacket stream) for ui.perfetto.dev.

Every thread gets a track (grouped under its process); each event that has
a duration becomes a slice on its thread's track. Field numbers are those
of Perfetto's trace_packet.proto / track_event.proto / track_descriptor.proto.
"""

from dataclasses import dataclass

import numpy as np

from mmtrace.agent.replay import first_per_thread
from mmtrace.bpf.sched import wait_start_ns

from .protowire import field_bytes, field_str, field_varint, varint
from .rowtext import BATCH, Rows, split, varint_lengths, write_merged

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


class Tracks:
    """Descriptors of the process and thread tracks, each once, before the
    first slice that uses it."""

    def __init__(self):
        self.pids: set = set()
        self.threads: set = set()

    def new(self, pid: int, tid: int, thread_name: str):
        if pid not in self.pids:
            desc = field_varint(TD_UUID, process_uuid(pid)) + field_bytes(
                TD_PROCESS, field_varint(PD_PID, pid))
            flags = (field_varint(TP_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED)
                     if not self.pids else b"")
            self.pids.add(pid)
            yield _packet(flags, field_bytes(TP_TRACK_DESCRIPTOR, desc))
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            thread = (field_varint(THD_PID, pid) + field_varint(THD_TID, tid)
                      + field_str(THD_NAME, thread_name))
            desc = (field_varint(TD_UUID, thread_uuid(pid, tid))
                    + field_varint(TD_PARENT_UUID, process_uuid(pid))
                    + field_bytes(TD_THREAD, thread))
            yield _packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))


def _descriptors(slices):
    tracks = Tracks()
    for s in slices:
        yield from tracks.new(s.pid, s.tid, s.thread_name)


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


def _event_rows(n: int, ts: np.ndarray, track: np.ndarray, kind: bytes, labels=b""):
    """TracePackets (timestamp, track event) for n events of one type: the
    track event is its type field (`kind`), the track uuid, then `labels`:
    fixed bytes, or (codes, entries) for labels that differ by row."""
    tag_ts = varint(TP_TIMESTAMP << 3)
    tag_track = varint(TE_TRACK_UUID << 3)
    if isinstance(labels, bytes):
        label_len = len(labels)
    else:
        codes, entries = labels
        label_len = np.array([len(e) for e in entries], np.int64)[codes]
    event_len = len(kind) + len(tag_track) + varint_lengths(track) + label_len
    te_head = varint(TP_TRACK_EVENT << 3 | 2)
    inner_len = (len(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID)) + len(tag_ts)
                 + varint_lengths(ts) + len(te_head) + varint_lengths(event_len) + event_len)
    rows = (Rows(n).const(varint(TRACE_PACKET << 3 | 2)).varint(inner_len)
            .const(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID) + tag_ts).varint(ts)
            .const(te_head).varint(event_len).const(kind).const(tag_track).varint(track))
    return rows.const(labels) if isinstance(labels, bytes) else rows.table(*labels)


def _tracks_of(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    return np.uint64(1 << 62) | pid.astype(np.uint64) << np.uint64(32) | tid.astype(np.uint64)


def slice_rows(start_ns: np.ndarray, duration_ns: np.ndarray, pid: np.ndarray, tid: np.ndarray,
               labels) -> Rows:
    """A begin and an end packet per slice, as _slice_packets writes them,
    for a whole batch of slices (labels as _event_rows takes them)."""
    n = len(start_ns)
    track = _tracks_of(pid, tid)
    begin = _event_rows(n, start_ns, track, field_varint(TE_TYPE, SLICE_BEGIN), labels)
    end = _event_rows(n, start_ns + duration_ns, track, field_varint(TE_TYPE, SLICE_END))
    return begin.rows(end)


def labels(category: str, name: str) -> bytes:
    return field_str(TE_CATEGORIES, category) + field_str(TE_NAME, name)


def device_packets(rows) -> list[bytes]:
    """The packets of each GPU/NPU call, as _slice_packets writes them: the
    time inside the call where it was measured, else an instant; named by
    op, else by API. Built per batch; one bytes object per call."""
    ev = rows.events
    table: dict = {}
    codes = np.array([table.setdefault((f"{s}.{k}", op or api), len(table)) for s, k, op, api
                      in zip(rows.stream, rows.kind, rows.op_name, rows.api)], np.int64)
    entries = [labels(*key) for key in table]
    returned = (ev["flags"] & 1) != 0       # FLAG_RETURNED
    out = [b""] * len(ev)
    spans = np.flatnonzero(returned)
    if len(spans):
        e = ev[spans]
        made = slice_rows(e["ts_ns"], e["duration_ns"], e["pid"], e["tid"],
                          (codes[spans], entries))
        for i, packets in zip(spans.tolist(), split(made)):
            out[i] = packets
    instants = np.flatnonzero(~returned)
    if len(instants):
        e = ev[instants]
        made = _event_rows(len(e), e["ts_ns"], _tracks_of(e["pid"], e["tid"]),
                           field_varint(TE_TYPE, INSTANT), (codes[instants], entries))
        for i, packets in zip(instants.tolist(), split(made)):
            out[i] = packets
    return out


class PerfettoWriter:
    """Writes the slices of each replay step (agent/replay.py) as they come:
    run-queue waits a batch at a time, GPU/NPU calls one by one."""

    def __init__(self, out):
        self.out = out
        self.tracks = Tracks()
        self.slices = 0

    def _tracks(self, pids, tids, comms):
        for pid, tid, comm in zip(pids, tids, comms):
            if (pid, tid) not in self.tracks.threads:
                for packet in self.tracks.new(pid, tid, comm.decode(errors="replace")):
                    self.out.write(packet)

    def step(self, step):
        runq, device = step.part("cpu.runq"), step.device_rows()
        if runq is not None:
            start = wait_start_ns(runq)
            order = np.argsort(start, kind="stable")
            runq, start = runq[order], start[order]
            self._tracks(*first_per_thread(runq))
        others, other_keys = [], np.zeros(0, np.uint64)
        if device is not None:
            ev = device.events
            self._tracks(*first_per_thread(ev))
            others = [packets for part in device.batches(BATCH // 4)
                      for packets in device_packets(part)]
            other_keys = ev["ts_ns"]
        if runq is None:
            for row in others:
                self.out.write(row)
        else:
            write_merged(self.out, _runq_slice_rows, runq, start, others, other_keys)
        self.slices += (0 if runq is None else len(runq)) + len(others)


def _runq_slice_rows(runq: np.ndarray) -> Rows:
    start = wait_start_ns(runq)
    return slice_rows(start, runq["ts_ns"] - start, runq["pid"], runq["tid"],
                      labels("cpu", "runq"))


def write_recording(steps, out) -> int:
    """Write the slices of `steps` (agent.replay.replay) to the binary
    stream `out`; returns their number."""
    writer = PerfettoWriter(out)
    for step in steps:
        writer.step(step)
    return writer.slices


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
