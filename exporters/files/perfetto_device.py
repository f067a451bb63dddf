"""The Perfetto packets of GPU/NPU calls, a batch at a time: each call on
its thread, with the flow from a submission to the sync that retired it;
a retired submission's time in flight on its stream's track; a memcpy's
running total on its process's counter track."""

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.device import NOT_RETIRED as NONE
from mmtrace.bpf.device import SUBMISSION_KINDS

from mmtrace.exporters.files.perfetto_call_annotations import (call_bytes, call_fields,
                                                               call_rows, fields_at)
from mmtrace.exporters.files.perfetto_fields import (
    TP_TIMESTAMP, TP_TRACK_EVENT, TE_TYPE, TE_TRACK_UUID, TE_FLOW_IDS, TE_TERMINATING_FLOW_IDS,
    SLICE_BEGIN, SLICE_END, INSTANT, packet)
from mmtrace.exporters.files.perfetto_rows import (counter_rows, event_rows, fixed64_rows, labels,
                                                   slice_rows_apart)
from mmtrace.exporters.files.perfetto_tracks import flow_ids, stream_uuids, thread_uuid, thread_uuids
from mmtrace.exporters.files.protowire import field_bytes, field_varint, varint
from mmtrace.exporters.files.rowtext import Rows, records_at, row_codes

MAX_PENDING_FLOWS = 1 << 16     # submissions awaiting their sync at once
WIDE_FLOWS = 8                  # a sync that ends more is encoded on its own
FLOW_TAG = varint(TE_FLOW_IDS << 3 | 1)
END_FLOW_TAG = varint(TE_TERMINATING_FLOW_IDS << 3 | 1)


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
    """The packets of each GPU/NPU call, as perfetto_events' slice_packets
    and counter_packets write them: the call on its thread (the time inside it
    where measured, else an instant; named by op, else by API) with its
    flows; a retired submission's time in flight on its stream's track; a
    memcpy's running total on its process's counter. Built per batch: per
    call its packets and their timestamps. Keeps the pending flows and
    totals across calls."""

    def __init__(self):
        self.flows = Flows()
        self.copied: dict = {}

    def packets(self, rows) -> list[bytes]:
        """One bytes object per call: its packets."""
        return [b"".join(packet for _, packet in call) for call in self.timed(rows)]

    def timed_packets(self, rows) -> tuple[np.ndarray, np.ndarray, bytes, np.ndarray]:
        """Every packet of the calls, call by call: (timestamps, lengths,
        the packets' bytes, where each starts in them), with no Python
        object per packet (PacketOrder.add takes them)."""
        pieces = self._pieces(rows)
        if not pieces:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64), b"", np.zeros(0, np.int64)
        at = np.concatenate([p[0] for p in pieces])
        slot = np.concatenate([np.full(len(p[0]), p[1], np.int64) for p in pieces])
        ts = np.concatenate([np.asarray(p[2], np.uint64) for p in pieces])
        lengths = np.concatenate([p[3] for p in pieces])
        starts = np.cumsum(lengths) - lengths
        order = np.argsort(at * _SLOTS + slot, kind="stable")
        return ts[order], lengths[order], b"".join(p[4] for p in pieces), starts[order]

    def timed(self, rows) -> list[list[tuple[int, bytes]]]:
        """Per call, its packets as (timestamp, bytes)."""
        out = [[] for _ in range(len(rows.events))]
        for at, _, ts, lengths, blob in self._pieces(rows):
            ends = np.cumsum(lengths).tolist()
            for i, t, a, b in zip(at.tolist(), np.asarray(ts).tolist(), [0] + ends[:-1], ends):
                out[i].append((t, blob[a:b]))
        return out

    def _pieces(self, rows) -> list:
        """The calls' packets as pieces (calls, slot, timestamps, lengths,
        bytes): a call's packets are those of its rows in the pieces, in
        the order of their slots (0, 1: the call on its thread; 2, 3: its
        time in flight; 4: the bytes its process has copied)."""
        ev = rows.events
        n = len(ev)
        codes, keys = row_codes(rows.stream, rows.kind, rows.op_name, rows.api)
        entries = [labels(f"{s}.{k}", op or api) for s, k, op, api in keys]
        by_api = rows.api_groups()
        submission = by_api.of_kinds(*SUBMISSION_KINDS)
        returned = (ev["flags"] & device_stream.FLAG_RETURNED) != 0
        end_ns = ev["ts_ns"] + ev["duration_ns"]
        retired = ev["retired_ns"] != NONE
        starts = submission & retired & ~(returned & (ev["retired_ns"].astype(np.uint64) == end_ns))
        fid, (end_rows, end_fids) = self.flows.step(
            ev["pid"], ev["op_id"], ev["ts_ns"], end_ns, ev["retired_ns"], starts,
            by_api.of_kinds("sync") & returned)
        # The fields that end flows, per sync row (a table entry each).
        end_codes = np.zeros(n, np.int64)
        end_entries = [b""]
        if len(end_rows):
            blob = fixed64_rows(END_FLOW_TAG, end_fids).tobytes()
            size = len(END_FLOW_TAG) + 8
            rows_with, first, count = np.unique(end_rows, return_index=True, return_counts=True)
            end_entries += [blob[a * size:(a + c) * size]
                            for a, c in zip(first.tolist(), count.tolist())]
            end_codes[rows_with] = np.arange(1, len(rows_with) + 1)
        lengths = np.array([len(e) for e in end_entries], np.int64)[end_codes]
        pieces = []
        # A sync that ends many flows would widen the whole batch's matrix:
        # such syncs are few (each ends more than WIDE_FLOWS flows that
        # as many submissions started) and are written one by one.
        limit = WIDE_FLOWS * (len(END_FLOW_TAG) + 8)
        wide = lengths > limit
        narrow = [e if len(e) <= limit else b"" for e in end_entries]   # the table's width
        fields = call_fields(rows)
        self._calls(ev, np.flatnonzero(~wide), (codes, entries), starts, fid,
                    (end_codes, narrow), fields, pieces)
        for i in np.flatnonzero(wide).tolist():     # a returned sync: a slice
            e = ev[i]
            track = field_varint(TE_TRACK_UUID, thread_uuid(int(e["pid"]), int(e["tid"])))
            begin = (field_varint(TE_TYPE, SLICE_BEGIN) + track + entries[codes[i]]
                     + end_entries[end_codes[i]] + call_bytes(fields, i))
            end = field_varint(TE_TYPE, SLICE_END) + track
            t0, t1 = int(e["ts_ns"]), int(e["ts_ns"] + e["duration_ns"])
            for slot, t, made in ((0, t0, packet(field_varint(TP_TIMESTAMP, t0),
                                                 field_bytes(TP_TRACK_EVENT, begin))),
                                  (1, t1, packet(field_varint(TP_TIMESTAMP, t1),
                                                 field_bytes(TP_TRACK_EVENT, end)))):
                pieces.append((np.array([i]), slot, [t], np.array([len(made)]), made))
        inflight = np.flatnonzero(submission & retired)
        if len(inflight):
            e = records_at(ev, inflight)
            begins, ends_ = slice_rows_apart(
                e["ts_ns"], e["retired_ns"].astype(np.uint64) - e["ts_ns"], e["pid"], e["tid"],
                (codes[inflight], entries), stream_uuids(e["pid"], e["stream_handle"]))
            _append(pieces, inflight, 2, e["ts_ns"], begins, e["retired_ns"], ends_)
        copies = np.flatnonzero(by_api.of_kinds("memcpy"))
        if len(copies):
            e = records_at(ev, copies)
            totals = np.zeros(len(e), np.uint64)
            for pid in np.unique(e["pid"]).tolist():
                mine = e["pid"] == pid
                totals[mine] = np.uint64(self.copied.get(pid, 0)) + np.cumsum(e["bytes"][mine])
                self.copied[pid] = int(totals[mine][-1])
            made = counter_rows(e["ts_ns"], np.uint64(1 << 60) | e["pid"].astype(np.uint64),
                                totals)
            _append(pieces, copies, 4, e["ts_ns"], made)
        return pieces

    @staticmethod
    def _calls(ev, at: np.ndarray, labels, starts, fid, ends, fields: list, pieces: list):
        if not len(at):
            return
        codes, entries = labels
        end_codes, end_entries = ends
        returned = (ev["flags"][at] & 1) != 0       # FLAG_RETURNED
        for sub, kind in ((at[returned], SLICE_BEGIN), (at[~returned], INSTANT)):
            if not len(sub):
                continue
            e = records_at(ev, sub)

            def flows(body: Rows, sub=sub) -> Rows:
                return (body.fixed(fixed64_rows(FLOW_TAG, fid[sub]), starts[sub])
                        .table(end_codes[sub], end_entries)
                        .rows(call_rows(fields_at(fields, sub), len(sub))))

            if kind == SLICE_BEGIN:
                begins, ends_ = slice_rows_apart(e["ts_ns"], e["duration_ns"], e["pid"],
                                                 e["tid"], (codes[sub], entries), extra=flows)
                _append(pieces, sub, 0, e["ts_ns"], begins, e["ts_ns"] + e["duration_ns"], ends_)
            else:
                made = event_rows(len(e), e["ts_ns"], thread_uuids(e["pid"], e["tid"]),
                                   field_varint(TE_TYPE, INSTANT), (codes[sub], entries), flows)
                _append(pieces, sub, 0, e["ts_ns"], made)


_SLOTS = 8


def _append(pieces: list, at: np.ndarray, slot: int, ts, made: Rows, end_ts=None,
            ends: Rows | None = None):
    """The calls `at`: each one's packet of `made` (stamped ts) in `slot`,
    then its packet of `ends` (stamped end_ts) in the next."""
    pieces.append((at, slot, ts, made.lengths(), made.bytes()))
    if ends is not None:
        pieces.append((at, slot + 1, end_ts, ends.lengths(), ends.bytes()))


def device_packets(rows) -> list[bytes]:
    """DeviceEncoder's packets of `rows` on their own."""
    return DeviceEncoder().packets(rows)
