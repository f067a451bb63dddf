"""Native Perfetto trace (protobuf TracePacket stream) for ui.perfetto.dev.

Every thread gets a track (grouped under its process); each event that has
a duration becomes a slice on its thread's track. Each GPU/NPU stream gets a
track too, where a submission is a slice from its call to its retirement,
with a flow from the submission's call to the sync that retired it; each
process that copies gets a counter track of the bytes it has copied, and
each GPU sampled by NVML counter tracks of its utilisations. Field
numbers are those of Perfetto's trace_packet.proto / track_event.proto /
track_descriptor.proto / counter_descriptor.proto.
"""

import struct
from dataclasses import dataclass

import numpy as np

from mmtrace.bpf.device import NOT_RETIRED as NONE
from mmtrace.bpf.device import SUBMISSION_KINDS
from mmtrace.bpf.sched import wait_start_ns

from mmtrace.exporters.files.perfetto_anomalies import anomaly_packets, recorded_anomalies
from mmtrace.exporters.files.perfetto_fields import (  # noqa: F401 (the field numbers, as tests read them)
    TRACE_PACKET, TP_TIMESTAMP, TP_SEQUENCE_ID, TP_TRACK_EVENT, TP_SEQUENCE_FLAGS,
    TP_TRACK_DESCRIPTOR, SEQ_INCREMENTAL_STATE_CLEARED, TD_UUID, TD_NAME, TD_PROCESS,
    TD_THREAD, TD_PARENT_UUID, TD_COUNTER, CD_UNIT, UNIT_SIZE_BYTES, PD_PID, PD_NAME,
    THD_PID, THD_TID, THD_NAME, TE_TYPE, TE_TRACK_UUID, TE_CATEGORIES, TE_NAME,
    TE_COUNTER_VALUE, TE_DOUBLE_COUNTER_VALUE, TE_FLOW_IDS, TE_TERMINATING_FLOW_IDS,
    SLICE_BEGIN, SLICE_END, INSTANT, COUNTER, SEQUENCE_ID, packet as _packet)
from mmtrace.exporters.files.perfetto_telemetry import Telemetry, hint_packets
from mmtrace.exporters.files.protowire import field_bytes, field_fixed64, field_str, field_varint, varint
from mmtrace.exporters.files.rowtext import (BATCH, Rows, first_per_thread, split, varint_lengths,
                                             write_merged)
from mmtrace.exporters.files.rowtext import codes as rowtext_codes


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


@dataclass(frozen=True)
class Counter:
    track: int
    ts_ns: int
    value: int




def process_uuid(pid: int) -> int:
    return 1 << 61 | pid            # 0 is Perfetto's global track


def thread_uuid(pid: int, tid: int) -> int:
    return 1 << 62 | pid << 32 | tid


def copied_uuid(pid: int) -> int:
    return 1 << 60 | pid


# NVML's samples ("gpu.state"): per GPU a counter track of each, in percent.
GPU_COUNTERS = (("sm_util", "SM utilisation %"), ("mem_bw_util", "memory-bandwidth utilisation %"))


def gpu_counter_uuid(gpu: int, which: int) -> int:
    return 1 << 58 | gpu << 4 | which


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well spread 64-bit hash of a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_uuid(pid: int, handle: int) -> int:
    """Bit 63 set: apart from the process, thread and counter tracks."""
    return 1 << 63 | _mix(_mix(pid) ^ handle) >> 1


def flow_id(pid: int, op_id: int) -> int:
    """A non-zero id of a process's submission (Perfetto ignores flow 0)."""
    return _mix(_mix(pid ^ 1 << 40) ^ op_id) or 1


class Tracks:
    """Descriptors of the process, thread, stream and counter tracks, each
    once, before the first event that uses it."""

    def __init__(self):
        self.pids: set = set()
        self.threads: set = set()
        self.others: set = set()

    def process(self, pid: int):
        if pid not in self.pids:
            desc = field_varint(TD_UUID, process_uuid(pid)) + field_bytes(
                TD_PROCESS, field_varint(PD_PID, pid))
            flags = (field_varint(TP_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED)
                     if not self.pids else b"")
            self.pids.add(pid)
            yield _packet(flags, field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def new(self, pid: int, tid: int, thread_name: str):
        yield from self.process(pid)
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            thread = (field_varint(THD_PID, pid) + field_varint(THD_TID, tid)
                      + field_str(THD_NAME, thread_name))
            desc = (field_varint(TD_UUID, thread_uuid(pid, tid))
                    + field_varint(TD_PARENT_UUID, process_uuid(pid))
                    + field_bytes(TD_THREAD, thread))
            yield _packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def named(self, pid: int, uuid: int, name: str, counter: bytes | None = None):
        """A track of its own under process `pid`; a counter track when
        `counter` (a CounterDescriptor) is given."""
        yield from self.process(pid)
        if uuid not in self.others:
            self.others.add(uuid)
            desc = (field_varint(TD_UUID, uuid) + field_str(TD_NAME, name)
                    + field_varint(TD_PARENT_UUID, process_uuid(pid)))
            if counter is not None:
                desc += field_bytes(TD_COUNTER, counter)
            yield _packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def stream(self, pid: int, stream: str, handle: int):
        yield from self.named(pid, stream_uuid(pid, handle), f"{stream} stream {handle:#x}")

    def gpu(self, gpu: int, which: int):
        """A GPU's counter track, global (its samples are not a process's)."""
        uuid = gpu_counter_uuid(gpu, which)
        if uuid not in self.others:
            self.others.add(uuid)
            desc = (field_varint(TD_UUID, uuid)
                    + field_str(TD_NAME, f"gpu {gpu} {GPU_COUNTERS[which][1]}")
                    + field_bytes(TD_COUNTER, b""))
            yield _packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def copied(self, pid: int):
        yield from self.named(pid, copied_uuid(pid), "memcpy bytes",
                              field_varint(CD_UNIT, UNIT_SIZE_BYTES))


def _descriptors(slices):
    tracks = Tracks()
    for s in slices:
        yield from tracks.new(s.pid, s.tid, s.thread_name)


def _slice_packets(s: Slice):
    uuid = thread_uuid(s.pid, s.tid) if s.track is None else s.track
    track = field_varint(TE_TRACK_UUID, uuid)
    labels = field_str(TE_CATEGORIES, s.category) + field_str(TE_NAME, s.name)
    flows = b"".join([field_fixed64(TE_FLOW_IDS, f) for f in s.flow_ids]
                     + [field_fixed64(TE_TERMINATING_FLOW_IDS, f)
                        for f in s.terminating_flow_ids])
    if s.duration_ns is None:
        instant = field_varint(TE_TYPE, INSTANT) + track + labels + flows
        yield _packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, instant))
        return
    begin = field_varint(TE_TYPE, SLICE_BEGIN) + track + labels + flows
    end = field_varint(TE_TYPE, SLICE_END) + track
    yield _packet(field_varint(TP_TIMESTAMP, s.start_ns), field_bytes(TP_TRACK_EVENT, begin))
    yield _packet(field_varint(TP_TIMESTAMP, s.start_ns + s.duration_ns),
                  field_bytes(TP_TRACK_EVENT, end))


def _counter_packets(c: Counter):
    event = (field_varint(TE_TYPE, COUNTER) + field_varint(TE_TRACK_UUID, c.track)
             + field_varint(TE_COUNTER_VALUE, c.value))
    yield _packet(field_varint(TP_TIMESTAMP, c.ts_ns), field_bytes(TP_TRACK_EVENT, event))


def gpu_state_packets(samples: np.ndarray, tracks: Tracks):
    """Each NVML sample's utilisations on its GPU's counter tracks (one a
    second per GPU: written one by one)."""
    for row in samples.tolist():
        sample = dict(zip(samples.dtype.names, row))
        for which, (key, _) in enumerate(GPU_COUNTERS):
            yield from tracks.gpu(sample["gpu"], which)
            event = (field_varint(TE_TYPE, COUNTER)
                     + field_varint(TE_TRACK_UUID, gpu_counter_uuid(sample["gpu"], which))
                     + varint(TE_DOUBLE_COUNTER_VALUE << 3 | 1)
                     + struct.pack("<d", sample[key] * 100.0))
            yield _packet(field_varint(TP_TIMESTAMP, sample["ts_ns"]),
                          field_bytes(TP_TRACK_EVENT, event))


def item_packets(item) -> bytes:
    return b"".join(_counter_packets(item) if isinstance(item, Counter) else _slice_packets(item))


def write_perfetto(slices: list[Slice], out) -> int:
    """Write slices (any order) as a binary Perfetto trace; returns their number."""
    slices = sorted(slices, key=lambda s: s.start_ns)
    for packet in _descriptors(slices):
        out.write(packet)
    for s in slices:
        for packet in _slice_packets(s):
            out.write(packet)
    return len(slices)


def _packet_rows(ts: np.ndarray, body: Rows) -> Rows:
    """TracePackets (timestamp, track event) around n track event bodies."""
    tag_ts = varint(TP_TIMESTAMP << 3)
    te_head = varint(TP_TRACK_EVENT << 3 | 2)
    event_len = body.lengths().copy()
    inner_len = (len(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID)) + len(tag_ts)
                 + varint_lengths(ts) + len(te_head) + varint_lengths(event_len) + event_len)
    return (Rows(body.n).const(varint(TRACE_PACKET << 3 | 2)).varint(inner_len)
            .const(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID) + tag_ts).varint(ts)
            .const(te_head).varint(event_len).rows(body))


def _event_rows(n: int, ts: np.ndarray, track: np.ndarray, kind: bytes, labels=b"",
                extra=None):
    """TracePackets for n events of one type: the track event is its type
    field (`kind`), the track uuid, then `labels` (fixed bytes, or (codes,
    entries) for labels that differ by row), then what `extra` (a function
    of the event body's Rows) adds."""
    body = Rows(n).const(kind).const(varint(TE_TRACK_UUID << 3)).varint(track)
    if isinstance(labels, bytes):
        body.const(labels)
    else:
        body.table(*labels)
    if extra is not None:
        body = extra(body)
    return _packet_rows(ts, body)


def _tracks_of(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    return np.uint64(1 << 62) | pid.astype(np.uint64) << np.uint64(32) | tid.astype(np.uint64)


def slice_rows(start_ns: np.ndarray, duration_ns: np.ndarray, pid: np.ndarray, tid: np.ndarray,
               labels, track: np.ndarray | None = None, extra=None) -> Rows:
    """A begin and an end packet per slice, as _slice_packets writes them,
    for a whole batch of slices (labels and extra as _event_rows takes them)."""
    n = len(start_ns)
    track = _tracks_of(pid, tid) if track is None else track
    begin = _event_rows(n, start_ns, track, field_varint(TE_TYPE, SLICE_BEGIN), labels, extra)
    end = _event_rows(n, start_ns + duration_ns, track, field_varint(TE_TYPE, SLICE_END))
    return begin.rows(end)


def counter_rows(ts: np.ndarray, track: np.ndarray, values: np.ndarray) -> Rows:
    """A counter packet per value, as _counter_packets writes it."""
    body = (Rows(len(ts)).const(field_varint(TE_TYPE, COUNTER))
            .const(varint(TE_TRACK_UUID << 3)).varint(track)
            .const(varint(TE_COUNTER_VALUE << 3)).varint(values))
    return _packet_rows(ts, body)


def labels(category: str, name: str) -> bytes:
    return field_str(TE_CATEGORIES, category) + field_str(TE_NAME, name)


MAX_PENDING_FLOWS = 1 << 16     # submissions awaiting their sync at once
WIDE_FLOWS = 8                  # a sync that ends more is encoded on its own
FLOW_TAG = varint(TE_FLOW_IDS << 3 | 1)
END_FLOW_TAG = varint(TE_TERMINATING_FLOW_IDS << 3 | 1)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """_mix over a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def flow_ids(pid: np.ndarray, op_id: np.ndarray) -> np.ndarray:
    """flow_id of each (pid, op_id)."""
    ids = _mix_array(_mix_array(pid.astype(np.uint64) ^ np.uint64(1 << 40)) ^ op_id)
    return np.where(ids == 0, np.uint64(1), ids)


def stream_uuids(pid: np.ndarray, handle: np.ndarray) -> np.ndarray:
    """stream_uuid of each (pid, handle)."""
    return np.uint64(1 << 63) | _mix_array(_mix_array(pid) ^ handle) >> np.uint64(1)


def _fixed64_rows(tag: bytes, values: np.ndarray) -> np.ndarray:
    """tag + 8 little-endian bytes per value, as a byte matrix."""
    return np.concatenate([np.broadcast_to(np.frombuffer(tag, np.uint8), (len(values), len(tag))),
                           values.astype("<u8").view(np.uint8).reshape(-1, 8)], axis=1)


class Flows:
    """Flow ids started on submissions, awaiting the sync that retired them.
    A sync retires what it covered when it returns, so the submissions of
    its process whose retired_ns is its return time, made before it, are
    its own. Events come in time order: what no later sync can end (retired
    before the newest event) is dropped, and at most `limit` wait besides."""

    def __init__(self, limit: int = MAX_PENDING_FLOWS):
        self.limit = limit
        self.pid = np.zeros(0, np.uint64)
        self.retired = np.zeros(0, np.uint64)
        self.fid = np.zeros(0, np.uint64)

    def __len__(self):
        return len(self.fid)

    def step(self, pid, op_id, ts, end_ns, retired, starts, ends):
        """One batch of calls in time order; `starts` marks the submissions
        that start a flow, `ends` the syncs that may end some. Returns
        (flow id per row, 0 where none; the rows of the syncs that end
        flows and the ids they end, grouped by row in submission order)."""
        fid = np.zeros(len(ts), np.uint64)
        at = np.flatnonzero(starts)
        fid[at] = flow_ids(pid[at], op_id[at])
        c_pid = np.concatenate([self.pid, pid[at].astype(np.uint64)])
        c_ret = np.concatenate([self.retired, retired[at].astype(np.uint64)])
        c_fid = np.concatenate([self.fid, fid[at]])
        c_pos = np.concatenate([np.full(len(self.fid), -1, np.int64), at])
        syncs = np.flatnonzero(ends)
        width = len(ts) + 2
        # One integer per (pid, time): pid and the time's rank among the times.
        times, time_rank = np.unique(np.concatenate([c_ret, end_ns[syncs].astype(np.uint64)]),
                                     return_inverse=True)
        rank = np.unique(np.concatenate([c_pid, pid[syncs].astype(np.uint64)]).astype(np.int64)
                         * len(times) + time_rank.reshape(-1), return_inverse=True)[1].reshape(-1)
        sync_key = rank[len(c_fid):] * width + syncs + 1
        order = np.argsort(sync_key)
        sync_key = sync_key[order]
        cand_rank = rank[:len(c_fid)]
        # The first sync of the same process and time after each submission.
        nxt = np.searchsorted(sync_key, cand_rank * width + c_pos + 1, side="right")
        found = nxt < len(sync_key)
        found[found] = sync_key[nxt[found]] // width == cand_rank[found]
        end_rows = syncs[order[nxt[found]]]
        by_row = np.argsort(end_rows, kind="stable")
        ended = (end_rows[by_row], c_fid[found][by_row])
        keep = ~found
        if len(ts):
            keep &= c_ret >= np.uint64(int(ts[-1]))
        kept = np.flatnonzero(keep)[-self.limit:]
        self.pid, self.retired, self.fid = c_pid[kept], c_ret[kept], c_fid[kept]
        return fid, ended


class DeviceEncoder:
    """The packets of each GPU/NPU call, as _slice_packets and
    _counter_packets write them: the call on its thread (the time inside it
    where measured, else an instant; named by op, else by API) with its
    flows; a retired submission's time in flight on its stream's track; a
    memcpy's running total on its process's counter. Built per batch; one
    bytes object per call. Keeps the pending flows and totals across calls."""

    def __init__(self):
        self.flows = Flows()
        self.copied: dict = {}

    def packets(self, rows) -> list[bytes]:
        ev = rows.events
        n = len(ev)
        codes, keys = rowtext_codes(list(zip(rows.stream, rows.kind, rows.op_name, rows.api)))
        entries = [labels(f"{s}.{k}", op or api) for s, k, op, api in keys]
        kinds = rows.kind.astype("U16")
        submission = np.isin(kinds, SUBMISSION_KINDS)
        returned = (ev["flags"] & 1) != 0       # FLAG_RETURNED
        end_ns = ev["ts_ns"] + ev["duration_ns"]
        retired = ev["retired_ns"] != NONE
        starts = submission & retired & ~(returned & (ev["retired_ns"].astype(np.uint64) == end_ns))
        fid, (end_rows, end_fids) = self.flows.step(
            ev["pid"], ev["op_id"], ev["ts_ns"], end_ns, ev["retired_ns"], starts,
            (kinds == "sync") & returned)
        # The fields that end flows, per sync row (a table entry each).
        end_codes = np.zeros(n, np.int64)
        end_entries = [b""]
        if len(end_rows):
            blob = _fixed64_rows(END_FLOW_TAG, end_fids).tobytes()
            size = len(END_FLOW_TAG) + 8
            rows_with, first, count = np.unique(end_rows, return_index=True, return_counts=True)
            end_entries += [blob[a * size:(a + c) * size]
                            for a, c in zip(first.tolist(), count.tolist())]
            end_codes[rows_with] = np.arange(1, len(rows_with) + 1)
        lengths = np.array([len(e) for e in end_entries], np.int64)[end_codes]
        out = [b""] * n
        # A sync that ends many flows would widen the whole batch's matrix:
        # such syncs are few (each ends more than WIDE_FLOWS flows that
        # as many submissions started) and are written one by one.
        limit = WIDE_FLOWS * (len(END_FLOW_TAG) + 8)
        wide = lengths > limit
        narrow = [e if len(e) <= limit else b"" for e in end_entries]   # the table's width
        self._calls(ev, np.flatnonzero(~wide), (codes, entries), starts, fid,
                    (end_codes, narrow), out)
        for i in np.flatnonzero(wide).tolist():     # a returned sync: a slice
            e = ev[i]
            track = field_varint(TE_TRACK_UUID, thread_uuid(int(e["pid"]), int(e["tid"])))
            begin = (field_varint(TE_TYPE, SLICE_BEGIN) + track + entries[codes[i]]
                     + end_entries[end_codes[i]])
            end = field_varint(TE_TYPE, SLICE_END) + track
            out[i] = (_packet(field_varint(TP_TIMESTAMP, int(e["ts_ns"])),
                              field_bytes(TP_TRACK_EVENT, begin))
                      + _packet(field_varint(TP_TIMESTAMP, int(e["ts_ns"] + e["duration_ns"])),
                                field_bytes(TP_TRACK_EVENT, end)))
        inflight = np.flatnonzero(submission & retired)
        if len(inflight):
            e = ev[inflight]
            made = slice_rows(e["ts_ns"], e["retired_ns"].astype(np.uint64) - e["ts_ns"],
                              e["pid"], e["tid"], (codes[inflight], entries),
                              stream_uuids(e["pid"], e["stream_handle"]))
            for i, packets in zip(inflight.tolist(), split(made)):
                out[i] += packets
        copies = np.flatnonzero(kinds == "memcpy")
        if len(copies):
            e = ev[copies]
            totals = np.zeros(len(e), np.uint64)
            for pid in np.unique(e["pid"]).tolist():
                mine = e["pid"] == pid
                totals[mine] = np.uint64(self.copied.get(pid, 0)) + np.cumsum(e["bytes"][mine])
                self.copied[pid] = int(totals[mine][-1])
            made = counter_rows(e["ts_ns"], np.uint64(1 << 60) | e["pid"].astype(np.uint64),
                                totals)
            for i, packets in zip(copies.tolist(), split(made)):
                out[i] += packets
        return out

    @staticmethod
    def _calls(ev, at: np.ndarray, labels, starts, fid, ends, out: list):
        if not len(at):
            return
        codes, entries = labels
        end_codes, end_entries = ends
        returned = (ev["flags"][at] & 1) != 0       # FLAG_RETURNED
        for sub, kind in ((at[returned], SLICE_BEGIN), (at[~returned], INSTANT)):
            if not len(sub):
                continue
            e = ev[sub]

            def flows(body: Rows, sub=sub) -> Rows:
                return (body.fixed(_fixed64_rows(FLOW_TAG, fid[sub]), starts[sub])
                        .table(end_codes[sub], end_entries))

            if kind == SLICE_BEGIN:
                made = slice_rows(e["ts_ns"], e["duration_ns"], e["pid"], e["tid"],
                                  (codes[sub], entries), extra=flows)
            else:
                made = _event_rows(len(e), e["ts_ns"], _tracks_of(e["pid"], e["tid"]),
                                   field_varint(TE_TYPE, INSTANT), (codes[sub], entries), flows)
            for i, packets in zip(sub.tolist(), split(made)):
                out[i] = packets


def device_packets(rows) -> list[bytes]:
    """DeviceEncoder's packets of `rows` on their own."""
    return DeviceEncoder().packets(rows)


class PerfettoWriter:
    """Writes the slices of each replay step (agent/recording/replay.py) as they come:
    run-queue waits a batch at a time, GPU/NPU calls one by one."""

    def __init__(self, out):
        self.out = out
        self.tracks = Tracks()
        self.device = DeviceEncoder()
        self.slices = 0

    def _write(self, packets):
        for packet in packets:
            self.out.write(packet)

    def _tracks(self, pids, tids, comms):
        for pid, tid, comm in zip(pids, tids, comms):
            if (pid, tid) not in self.tracks.threads:
                self._write(self.tracks.new(pid, tid, comm.decode(errors="replace")))

    def _device_tracks(self, device):
        ev = device.events
        submitted = np.array([k in SUBMISSION_KINDS for k in device.kind], bool) & (
            ev["retired_ns"] != NONE)
        keys = np.unique(np.stack([ev["pid"][submitted].astype(np.uint64),
                                   ev["stream_handle"][submitted]], axis=1), axis=0)
        stream_of = dict(zip(zip(ev["pid"].tolist(), ev["stream_handle"].tolist()),
                             device.stream.tolist()))
        for pid, handle in keys.tolist():
            self._write(self.tracks.stream(pid, stream_of[(pid, handle)], handle))
        for pid in np.unique(ev["pid"][device.kind == "memcpy"]).tolist():
            self._write(self.tracks.copied(pid))

    def step(self, step):
        runq, device = step.part("cpu.runq"), step.device_rows()
        gpus = step.part("gpu.state")
        if gpus is not None:
            self._write(gpu_state_packets(gpus, self.tracks))
        if runq is not None:
            start = wait_start_ns(runq)
            order = np.argsort(start, kind="stable")
            runq, start = runq[order], start[order]
            self._tracks(*first_per_thread(runq))
        others, other_keys = [], np.zeros(0, np.uint64)
        if device is not None:
            ev = device.events
            self._tracks(*first_per_thread(ev))
            self._device_tracks(device)
            others = [packets for part in device.batches(BATCH // 4)
                      for packets in self.device.packets(part)]
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


def write_recording(steps, out, source=None, detectors=None) -> int:
    """Write the slices of `steps` (a recording's replay) to the binary
    stream `out`; returns their number. With the recording (`source`),
    its anomalies follow: the one that made a flight recording, and those
    that `detectors` (fed each step, then finished) find over the same
    steps, as `report` lists them; then its hint audit log. Request
    latencies and entropy that dispatchers reported are counter tracks."""
    writer = PerfettoWriter(out)
    telemetry = Telemetry(source)
    for step in steps:
        writer.step(step)
        writer._write(telemetry.step(step))
        if detectors is not None:
            detectors.feed(step)
    if source is not None:
        found = [{**a, "source": "replay"} for a in detectors.finish()] if detectors else []
        for packet in anomaly_packets(recorded_anomalies(source) + found):
            out.write(packet)
        for packet in hint_packets(source):
            out.write(packet)
    return writer.slices


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
    pending, copied, out = {}, {}, []
    for i, row in enumerate(ev.tolist()):
        e = dict(zip(ev.dtype.names, row))
        pid, ts, kind = e["pid"], e["ts_ns"], rows.kind[i]
        returned = bool(e["flags"] & 1)    # FLAG_RETURNED
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
                           flow_ids=starts, terminating_flow_ids=ends))
        if in_flight:
            items.append(Slice(pid, e["tid"], thread, category, name, ts, retired - ts,
                               track=stream_uuid(pid, e["stream_handle"])))
        if kind == "memcpy":
            copied[pid] = copied.get(pid, 0) + e["bytes"]
            items.append(Counter(copied_uuid(pid), ts, copied[pid]))
        out.append(items)
    return out

