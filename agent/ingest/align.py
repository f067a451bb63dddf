"""Alignment of GPU/NPU submissions with the syncs that retire them.

The kernel already stamps each submission with its calling thread's latest
run-queue delay (`sched_delay_ns`, from the scheduler program's per-thread
map; 0 when that wake-up did not wait, or when the thread has not been
switched in since tracing began) and a per-process `op_id`. What needs
the events after it is done here:

- a sync retires the submissions of its process made before it started:
  a stream sync those on its stream, a device / context sync those on every
  stream, an event sync (cudaEventSynchronize) those on the stream of the
  event's latest cudaEventRecord, made before that record. A submission's
  `retired_ns` is when the first sync that covered it returned (the host
  knew then); a blocking submission (cudaMemcpy, aclrtMemcpy,
  aclmdlExecute) is retired when its own call returns;
- a sync's `op_id` is the highest op_id among the submissions it covers
  (whether or not an earlier sync covered them already); an event sync's
  stream_handle is its record's stream.

Streams are matched by handle value: the legacy default stream (0) is
treated as a stream of its own. Everything is vectorised over a batch:
`align` does a whole recording at once, `Aligner` keeps a bounded ring of
the recent past (by count and by age) and aligns each new batch against it.
"""

from dataclasses import dataclass

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.agent.ingest.event_ring import EventRing
from mmtrace.agent.ingest.packed_ring import PackedRing
from mmtrace.agent.ingest.record_arrays import concat, rows_of, take

NONE = device_stream.NOT_RETIRED
ALIGNED_EVENT = device_stream.ALIGNED_EVENT
FLAG_STREAM_FROM_RECORD = device_stream.FLAG_STREAM_FROM_RECORD

SCOPE_NONE, SCOPE_STREAM, SCOPE_DEVICE, SCOPE_EVENT = 0, 1, 2, 3
_SCOPES = {None: SCOPE_NONE, "stream": SCOPE_STREAM, "device": SCOPE_DEVICE,
           "event": SCOPE_EVENT}
_OP_BITS = 40   # op_id < 2^40 per process: a million submissions a second for 12 days


@dataclass(frozen=True)
class ApiRoles:
    """Per API id (index): what part it plays in alignment."""
    submission: np.ndarray      # bool
    blocking: np.ndarray        # bool
    scope: np.ndarray           # SCOPE_*
    record: np.ndarray          # bool: cudaEventRecord and kin

    @classmethod
    def from_infos(cls, infos: dict) -> "ApiRoles":
        size = max(infos, default=0) + 1
        submission = np.zeros(size, bool)
        blocking = np.zeros(size, bool)
        scope = np.zeros(size, np.int8)
        record = np.zeros(size, bool)
        for api_id, info in infos.items():
            submission[api_id] = info.kind in device_stream.SUBMISSION_KINDS
            blocking[api_id] = info.blocking
            scope[api_id] = _SCOPES.get(info.sync_scope, SCOPE_NONE) if info.kind == "sync" else 0
            record[api_id] = info.kind == "event_record"
        return cls(submission, blocking, scope, record)

    def of(self, api: np.ndarray):
        """(submission, blocking, scope, record) per event; unknown ids play no part."""
        api = api.astype(np.int64)
        known = api < len(self.submission)
        safe = np.where(known, api, 0)
        return (self.submission[safe] & known, self.blocking[safe] & known,
                np.where(known, self.scope[safe], SCOPE_NONE), self.record[safe] & known)

    def of_events(self, events: np.ndarray):
        """As `of`, for the events themselves: a submission has an op_id, and
        a call that failed plays no part (nothing was queued, nothing waited
        for)."""
        submission, blocking, scope, record = self.of(events["api"])
        ok = ~device_stream.failed(events)
        return (submission & (events["op_id"] > 0) & ok, blocking, np.where(ok, scope, SCOPE_NONE),
                record & ok)


def end_ns(events: np.ndarray) -> np.ndarray:
    """Return time where measured, else the entry time."""
    returned = (events["flags"] & device_stream.FLAG_RETURNED) != 0
    ts = events["ts_ns"].astype(np.int64)
    return np.where(returned, ts + events["duration_ns"].astype(np.int64), ts)


def _groups(*columns) -> np.ndarray:
    """Dense group index of each row's key (one or more columns), in key order."""
    n = len(columns[0])
    if not n:
        return np.zeros(0, np.int64)
    order = np.lexsort(columns[::-1])
    new = np.zeros(n, bool)
    new[0] = True
    for column in columns:
        ordered = np.asarray(column)[order]
        new[1:] |= ordered[1:] != ordered[:-1]
    out = np.empty(n, np.int64)
    out[order] = np.cumsum(new) - 1
    return out


def _dense_rank(values: np.ndarray, *more: np.ndarray):
    """Ranks of every array's values among all of them (equal values, equal rank)."""
    uniq = np.unique(np.concatenate([values, *more]))
    return [np.searchsorted(uniq, v).astype(np.int64) for v in (values, *more)], len(uniq) + 1


def _event_sync_targets(pid, handle, stream, ts, record, event_sync):
    """For each event sync: its record's stream, time and row, or NONE
    where no record of that event came before it."""
    rec_idx = np.flatnonzero(record)
    sync_idx = np.flatnonzero(event_sync)
    out_stream = np.zeros(len(sync_idx), np.uint64)
    out_ts = np.full(len(sync_idx), NONE, np.int64)
    out_row = np.full(len(sync_idx), NONE, np.int64)
    if not len(sync_idx) or not len(rec_idx):
        return sync_idx, out_stream, out_ts, out_row
    both = np.concatenate([rec_idx, sync_idx])
    is_rec = np.concatenate([np.ones(len(rec_idx), bool), np.zeros(len(sync_idx), bool)])
    group = _groups(pid[both], handle[both])
    # A record at the same instant as the sync counts as before it.
    order = np.lexsort((~is_rec, ts[both], group))
    pos = np.where(is_rec[order], np.arange(len(order)), NONE)
    last_rec = np.maximum.accumulate(pos)
    sorted_syncs = np.flatnonzero(~is_rec[order])
    found = last_rec[sorted_syncs]
    ok = found >= 0
    ok[ok] = group[order][found[ok]] == group[order][sorted_syncs[ok]]
    rec_rows = both[order][np.where(ok, found, 0)]
    # map back to sync_idx order
    which = order[sorted_syncs] - len(rec_idx)
    out_stream[which] = np.where(ok, stream[rec_rows], 0)
    out_ts[which] = np.where(ok, ts[rec_rows], NONE)
    out_row[which] = np.where(ok, rec_rows, NONE)
    return sync_idx, out_stream, out_ts, out_row


def _earliest_cover(sub_group, sub_rank, sync_group, sync_rank, sync_end, width):
    """For each submission: the earliest return among the syncs of its group
    that started strictly after it; NONE if none."""
    out = np.full(len(sub_group), NONE, np.int64)
    if not len(sub_group) or not len(sync_group):
        return out
    key = sync_group * width + sync_rank
    order = np.argsort(key, kind="stable")
    key, group = key[order], sync_group[order]
    ends = np.unique(sync_end)
    span = len(ends) + 1
    # Minimum over each group's suffix in one pass: group g's values live in
    # [g * span, (g + 1) * span), below every later group's, so the running
    # minimum from the end restarts at each group.
    ranked = group * span + np.searchsorted(ends, sync_end[order])
    suffix = np.minimum.accumulate(ranked[::-1])[::-1] - group * span
    k = np.searchsorted(key, sub_group * width + sub_rank, side="right")
    inside = k < len(key)
    safe = np.where(inside, k, 0)
    ok = inside & (group[safe] == sub_group)
    out[ok] = ends[suffix[safe[ok]]]
    return out


def _highest_before(sub_group, sub_rank, sub_op, sync_group, sync_rank, width):
    """For each sync: the highest op_id of its group's submissions that
    started strictly before it; NONE if none."""
    out = np.full(len(sync_group), NONE, np.int64)
    if not len(sub_group) or not len(sync_group):
        return out
    key = sub_group * width + sub_rank
    order = np.argsort(key, kind="stable")
    key = key[order]
    group = sub_group[order]
    op = np.minimum(sub_op[order].astype(np.int64), (1 << _OP_BITS) - 1)
    running = np.maximum.accumulate(group * (1 << _OP_BITS) + op) - group * (1 << _OP_BITS)
    j = np.searchsorted(key, sync_group * width + sync_rank, side="left") - 1
    ok = j >= 0
    safe = np.where(ok, j, 0)
    ok &= group[safe] == sync_group
    ok &= running[safe] > 0
    out[ok] = running[safe][ok]
    return out


def align(events: np.ndarray, roles: ApiRoles, copy: bool = True,
          parts: tuple | None = None) -> np.ndarray:
    """ALIGNED_EVENT copies of `events` (any order, DEV_EVENT or aligned)
    with retired_ns, sync op_ids and event-sync streams filled in
    (`copy=False`: aligned input is filled in place). `parts`: what
    roles.of_events(events) gives, where the caller has it already (the
    alignment changes no event's part)."""
    out = _as_aligned(events, copy=copy)
    if not len(events):
        return out
    submission, blocking, scope, record = parts or roles.of_events(events)
    pid = out["pid"].astype(np.uint64)
    stream = out["stream_handle"].astype(np.uint64)
    ts = out["ts_ns"].astype(np.int64)
    ends = end_ns(out)

    # Event syncs become stream syncs at the time of their record.
    event_rows, event_stream, event_ts, event_record = _event_sync_targets(
        pid, out["handle"], stream, ts, record, scope == SCOPE_EVENT)
    stream_rows = np.concatenate([np.flatnonzero(scope == SCOPE_STREAM),
                                  event_rows[event_ts != NONE]])
    cover_stream = np.concatenate([stream[scope == SCOPE_STREAM],
                                   event_stream[event_ts != NONE]])
    cover_ts = np.concatenate([ts[scope == SCOPE_STREAM], event_ts[event_ts != NONE]])
    device_rows = np.flatnonzero(scope == SCOPE_DEVICE)
    sub_rows = np.flatnonzero(submission)
    # A record stores the highest op_id before it on its stream (in its own
    # op_id, unused otherwise): an event sync arriving batches later, when
    # those submissions are no longer at hand, takes it from there.
    record_rows = np.flatnonzero(record & (out["op_id"] == 0))

    (sub_rank, stream_rank, device_rank, record_rank), width = _dense_rank(
        ts[sub_rows], cover_ts, ts[device_rows], ts[record_rows])

    # Stream syncs (and records): group by (pid, stream); device syncs: by pid.
    g = _groups(np.concatenate([pid[sub_rows], pid[stream_rows], pid[record_rows]]),
                np.concatenate([stream[sub_rows], cover_stream, stream[record_rows]]))
    sub_sg = g[:len(sub_rows)]
    sync_sg = g[len(sub_rows):len(sub_rows) + len(stream_rows)]
    record_sg = g[len(sub_rows) + len(stream_rows):]
    g = _groups(np.concatenate([pid[sub_rows], pid[device_rows]]))
    sub_dg, sync_dg = g[:len(sub_rows)], g[len(sub_rows):]

    s_end = _earliest_cover(sub_sg, sub_rank, sync_sg, stream_rank, ends[stream_rows], width)
    d_end = _earliest_cover(sub_dg, sub_rank, sync_dg, device_rank, ends[device_rows], width)
    retired = np.where((s_end == NONE) | ((d_end != NONE) & (d_end < s_end)), d_end, s_end)
    retired = np.where(blocking[sub_rows] & ((out["flags"][sub_rows]
                                              & device_stream.FLAG_RETURNED) != 0),
                       ends[sub_rows], retired)
    out["retired_ns"][sub_rows] = retired

    sub_op = out["op_id"][sub_rows]
    out["op_id"][stream_rows] = np.maximum(
        _highest_before(sub_sg, sub_rank, sub_op, sync_sg, stream_rank, width), 0)
    out["op_id"][device_rows] = np.maximum(
        _highest_before(sub_dg, sub_rank, sub_op, sync_dg, device_rank, width), 0)
    out["op_id"][record_rows] = np.maximum(
        _highest_before(sub_sg, sub_rank, sub_op, record_sg, record_rank, width), 0)
    found = event_rows[event_ts != NONE]
    out["op_id"][found] = out["op_id"][event_record[event_ts != NONE]]
    out["stream_handle"][found] = event_stream[event_ts != NONE]
    out["flags"][found] |= FLAG_STREAM_FROM_RECORD
    return out


class Aligner:
    """The recent past, aligned: a ring of at most `capacity` events no
    older than `max_age_ns` behind the newest. Memory is fixed at creation
    whatever the event rate; evicted events are counted.

    push() aligns a batch against what the past can still change or tell:
    submissions not yet retired, the latest submission of each (process,
    stream) (a sync's op_id), and recent event records. Those are kept
    apart from the ring, each bounded, so a batch costs in proportion to
    itself, not to the ring. window() returns the ring's events, oldest
    first, with retired_ns as known now."""

    def __init__(self, roles: ApiRoles, capacity: int = 1 << 18,
                 max_age_ns: int = 60_000_000_000, max_pending: int = 1 << 16,
                 max_records: int = 1 << 14, max_streams: int = 1 << 14, on_retired=None,
                 compress: bool = False):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.roles = roles
        self.capacity = capacity
        self.max_age_ns = max_age_ns
        self.max_pending = max_pending
        self.max_records = max_records
        self.max_streams = max_streams
        self.on_retired = on_retired    # (seq, retired_ns) of events retired after their push
        # compress: the daemon's flight ring, held compressed (PackedRing);
        # a replay keeps none worth compressing.
        self._ring = (PackedRing if compress else EventRing)(ALIGNED_EVENT, capacity, max_age_ns)
        self._pending = np.zeros(0, ALIGNED_EVENT)
        self._pending_seq = np.zeros(0, np.int64)
        self._records = np.zeros(0, ALIGNED_EVENT)
        self._latest = np.zeros(0, ALIGNED_EVENT)
        self.unretired_dropped = 0
        self.last_retired = np.zeros(0, ALIGNED_EVENT)

    def __len__(self):
        return len(self._ring)

    @property
    def evicted(self) -> int:
        return self._ring.evicted

    def window(self, since_ns: int | None = None) -> np.ndarray:
        return self._ring.window(since_ns)

    def pieces(self, since_ns: int | None = None):
        """window(since_ns) a piece at a time (PackedRing: a block at a time)."""
        return self._ring.pieces(since_ns)

    def extracts(self, since_ns: int | None, key, extract):
        """extract(records) of window(since_ns), kept a block at a time
        (PackedRing.extracts)."""
        return self._ring.extracts(since_ns, key, extract)

    def push(self, batch: np.ndarray) -> np.ndarray:
        """Align `batch` (DEV_EVENT records, any order); return it aligned."""
        if not len(batch):
            return np.zeros(0, ALIGNED_EVENT)
        ts = batch["ts_ns"]
        # Two CPUs share the rings: a batch is nearly in time order, and
        # sorted while it is copied into place behind the past.
        order = None if (ts[1:] >= ts[:-1]).all() else np.argsort(ts, kind="stable")
        n_pending = len(self._pending)
        # What the past can change or tell, and the batch made aligned behind it (one copy).
        joined = _joined([self._pending, self._records, self._latest], batch, order)
        parts = self.roles.of_events(joined)
        aligned = align(joined, self.roles, copy=False, parts=parts)
        settled = aligned["retired_ns"][:n_pending] != NONE
        self._set_retired(self._pending_seq[settled], aligned["retired_ns"][:n_pending][settled])
        first = len(aligned) - len(batch)
        new = aligned[first:]
        submission, record = parts[0][first:], parts[3][first:]
        # What this push retired: earlier submissions and the batch's own.
        self.last_retired = concat([take(aligned[:n_pending], settled),
                                    take(new, submission & (new["retired_ns"] != NONE))])
        first_seq = self._ring.push(new)
        self._remember(new, first_seq, ~settled, submission, record)
        return new

    def unretired(self, pid: int, stream_handle: int | None = None) -> tuple[int, int | None]:
        """A process's submissions still waiting for a sync (on one stream,
        or on all when None), and when the oldest was made: what a hung
        device has stopped retiring."""
        mine = self._pending["pid"] == pid
        if stream_handle is not None:
            mine &= self._pending["stream_handle"] == stream_handle
        ts = self._pending["ts_ns"][mine]
        return int(mine.sum()), (int(ts.min()) if len(ts) else None)

    @property
    def oldest_pending(self) -> int | None:
        """Number of the oldest submission still waiting for its sync."""
        return int(self._pending_seq.min()) if len(self._pending_seq) else None

    def _set_retired(self, seq: np.ndarray, retired: np.ndarray):
        self._ring.update(seq, "retired_ns", retired)
        if self.on_retired is not None and len(seq):
            self.on_retired(seq, retired)

    def _remember(self, new: np.ndarray, first_seq: int, keep_pending: np.ndarray,
                  submission: np.ndarray, record: np.ndarray):
        waiting = submission & (new["retired_ns"] == NONE)
        seq = first_seq + np.arange(len(new))
        pending = concat([take(self._pending, keep_pending), take(new, waiting)])
        pending_seq = np.concatenate([self._pending_seq[keep_pending], seq[waiting]])
        if len(pending) > self.max_pending:
            # Never synced (a process that polls events instead): stop waiting.
            self.unretired_dropped += len(pending) - self.max_pending
            pending, pending_seq = pending[-self.max_pending:], pending_seq[-self.max_pending:]
        self._pending, self._pending_seq = pending, pending_seq
        self._records = concat([self._records, take(new, record)])[-self.max_records:]
        # `new` is in time order (push sorts it).
        latest = concat([self._latest, take(new, _latest_of_each_stream(new, submission))])
        if len(latest):
            group = _groups(latest["pid"], latest["stream_handle"])
            order = np.lexsort((latest["ts_ns"], group))
            last = np.ones(len(order), bool)
            last[:-1] = group[order][1:] != group[order][:-1]
            latest = take(latest, order[last])
            latest = take(latest, np.argsort(latest["ts_ns"], kind="stable"))[-self.max_streams:]
        self._latest = latest


def _latest_of_each_stream(events: np.ndarray, which: np.ndarray) -> np.ndarray:
    """The rows of the last of `which` (a mask over `events`, in time order)
    on each (process, stream): what _remember keeps of a batch, found on
    two columns before any record is copied."""
    at = np.flatnonzero(which)
    if len(at) < 2:
        return at
    pid, stream = events["pid"][at], events["stream_handle"][at]
    order = np.lexsort((stream, pid))           # stable: time order within a stream
    pid, stream = pid[order], stream[order]
    last = np.ones(len(order), bool)
    last[:-1] = (pid[1:] != pid[:-1]) | (stream[1:] != stream[:-1])
    return np.sort(at[order[last]])


def _as_aligned(events: np.ndarray, copy: bool = False) -> np.ndarray:
    """ALIGNED_EVENT records of DEV_EVENT (or ALIGNED_EVENT) ones. The
    aligned layout is the device layout and one field more, so the
    conversion is one strided byte copy, not one per field."""
    if events.dtype == ALIGNED_EVENT:
        return take(events, slice(None)) if copy else events
    out = np.empty(len(events), ALIGNED_EVENT)
    _aligned_into(events, out)
    return out


def _aligned_into(events: np.ndarray, out: np.ndarray, order: np.ndarray | None = None):
    """`events` (DEV_EVENT or ALIGNED_EVENT), or events[order], written into
    `out` (ALIGNED_EVENT, as long)."""
    n = len(events)
    rows = out.view(np.uint8).reshape(n, ALIGNED_EVENT.itemsize)
    source = rows_of(events) if order is None else rows_of(events)[order]
    if events.dtype == ALIGNED_EVENT:
        rows[:] = source
        return
    if events.dtype != device_stream.DEV_EVENT:
        raise TypeError(f"expected device events ({device_stream.DEV_EVENT.itemsize}-byte "
                        f"records), got {events.dtype}")
    rows[:, :device_stream.DEV_EVENT.itemsize] = source
    out["retired_ns"] = NONE


def _joined(prior: list[np.ndarray], batch: np.ndarray,
            order: np.ndarray | None = None) -> np.ndarray:
    """concat(prior + [_as_aligned(batch)]) (prior: aligned), the batch
    (batch[order], where given) converted straight into its place."""
    n = sum(len(p) for p in prior)
    out = np.empty(n + len(batch), ALIGNED_EVENT)
    rows = out.view(np.uint8).reshape(len(out), ALIGNED_EVENT.itemsize)
    at = 0
    for part in prior:
        rows[at:at + len(part)] = rows_of(part)
        at += len(part)
    _aligned_into(batch, out[n:], order)
    return out
