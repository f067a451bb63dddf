"""Where a launcher's time goes: each thread's wall time, per slice of time,
split into on-CPU, runnable (waiting on the run queue), blocked in a device
sync, blocked in a synchronous copy, and blocked elsewhere.

Fed by the one ingest path's batches (live) or a recording's replay steps,
in any order within a few slices. Each run-queue record is a switch-in that
ends a wait: `delay_ns` runnable before it, and `blocked_ns` asleep before
that (bpf/sched.c), so the gap between two switch-ins of a thread is its
sleep, its wait and its time on the CPU. The device stream's syncs and
blocking copies say which part of that sleep (or spin) was the device's.

Everything is summed per (thread, slice) in numpy tables that are reduced
by key as they grow, so memory follows threads x slices, not events.
"""

from dataclasses import dataclass, field

import numpy as np

SLICE_NS = 1_000_000_000
# A wait, sleep or call longer than this is a damaged record, not time a
# thread spent: dropped, and counted (a stamp past 2**63 likewise).
MAX_INTERVAL_NS = 86400 * 10**9
MAX_TS_NS = (1 << 62)
# Rows held in all: past them, slices double in length (a long recording
# is read at a coarser grain, in memory that does not grow with it).
MAX_ROWS = 1 << 19
CULPRIT_FLOOR_NS = 20_000       # shorter waits name no culprit: no one held the CPU long

# Per (thread, slice): what its switch-in records say.
THREAD_SLICE = np.dtype([("key", "<u8"), ("runnable", "<i8"), ("blocked", "<i8"),
                         ("first", "<i8"), ("last", "<i8")])
# Per (thread, slice): what its GPU/NPU calls say.
DEVICE_SLICE = np.dtype([("key", "<u8"), ("sync", "<i8"), ("copy", "<i8"), ("calls", "<i8"),
                         ("submissions", "<i8"), ("failed", "<i8"), ("bytes", "<i8"),
                         ("npu", "<i8"), ("queue", "<i8"), ("first", "<i8"), ("last", "<i8")])
# Per (waiting thread, slice, thread that held the CPU): the wait it ended.
CULPRIT_SLICE = np.dtype([("key", "<u8"), ("holder", "<u4"), ("wait", "<i8")])

# What add_device reads of an aligned device event.
_DEVICE_FIELDS = ("ts_ns", "duration_ns", "flags", "api", "kind", "ret", "retired_ns", "tid",
                  "pid", "comm", "bytes")
_SUMMED = {"runnable", "blocked", "sync", "copy", "calls", "submissions", "failed", "bytes",
           "npu", "queue", "wait"}


def _key(tid: np.ndarray, slice_index: np.ndarray) -> np.ndarray:
    return (tid.astype(np.uint64) << np.uint64(32)) | slice_index.astype(np.uint64)


def key_tid(key: np.ndarray) -> np.ndarray:
    return (key >> np.uint64(32)).astype(np.int64)


def key_slice(key: np.ndarray) -> np.ndarray:
    return (key & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _reduce(rows: np.ndarray, by: tuple[str, ...] = ("key",)) -> np.ndarray:
    """One row per distinct `by`: summed fields add, first/last take the extremes."""
    if len(rows) < 2:
        return rows
    order = np.lexsort([rows[name] for name in reversed(by)])
    rows = rows[order]
    edge = np.ones(len(rows), bool)
    edge[1:] = np.logical_or.reduce([rows[name][1:] != rows[name][:-1] for name in by])
    starts = np.flatnonzero(edge)
    out = rows[starts].copy()
    for name in rows.dtype.names:
        if name in _SUMMED:
            out[name] = np.add.reduceat(rows[name], starts)
        elif name == "first":
            out[name] = np.minimum.reduceat(rows[name], starts)
        elif name == "last":
            out[name] = np.maximum.reduceat(rows[name], starts)
    return out


def split_intervals(start: np.ndarray, end: np.ndarray, slice_ns: int):
    """Intervals [start, end) cut at slice edges: (row, slice, length) for
    each piece. Most intervals lie in one slice; only the long ones loop."""
    start = start.astype(np.int64)
    end = np.maximum(end.astype(np.int64), start)
    first, last = start // slice_ns, np.maximum(end - 1, start) // slice_ns
    one = first == last
    rows = [np.flatnonzero(one)]
    slices = [first[one]]
    lengths = [(end - start)[one]]
    for i in np.flatnonzero(~one).tolist():
        ks = np.arange(first[i], last[i] + 1)
        lo = np.maximum(ks * slice_ns, start[i])
        hi = np.minimum((ks + 1) * slice_ns, end[i])
        rows.append(np.full(len(ks), i))
        slices.append(ks)
        lengths.append(hi - lo)
    return np.concatenate(rows), np.concatenate(slices), np.concatenate(lengths)


class _Table:
    """Rows of one dtype, reduced by key whenever they double."""

    def __init__(self, dtype: np.dtype, by: tuple[str, ...] = ("key",)):
        self.dtype, self.by = dtype, by
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.reduced = 0

    def add(self, rows: np.ndarray):
        if not len(rows):
            return
        self.parts.append(rows)
        self.size += len(rows)
        if self.size > max(2 * self.reduced, 1 << 14):
            self.rows()

    def rows(self) -> np.ndarray:
        if len(self.parts) != 1 or self.size != self.reduced:
            joined = np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
            self.parts = [_reduce(joined, self.by)]
            self.size = self.reduced = len(self.parts[0])
        return self.parts[0]

    def keep(self, mask_of):
        """Only the rows `mask_of(rows)` holds (the live daemon's forgetting)."""
        rows = self.rows()
        self.parts = [rows[mask_of(rows)]]
        self.size = self.reduced = len(self.parts[0])


class RecentWaits:
    """The latest run-queue waits of the launching threads (a few seconds of
    them), to find the wait inside a device call. The wake-up that ends a
    sync or a blocking copy waits for a CPU like any other: on a busy host
    that wait is most of the call, and it is the CPU's time, not the
    device's. Left in the call, it took the thread's sleep (and then its
    time on the CPU) from the other parts, and a starved launcher read as
    device-bound."""

    def __init__(self, keep_ns: int = 2 * SLICE_NS, limit: int = 1 << 18):
        self.keep_ns, self.limit = keep_ns, limit      # keep_ns < 2**32: see _keys
        self.tid = np.zeros(0, np.int64)
        self.ts = np.zeros(0, np.int64)                 # switch-in
        self.start = np.zeros(0, np.int64)              # when the wait began
        self.base = 0
        self.keys = np.zeros(0, np.uint64)

    def _keys(self, tid: np.ndarray, ts: np.ndarray) -> np.ndarray:
        offset = np.clip(ts - self.base, 0, (1 << 32) - 1)
        return (tid.astype(np.uint64) << np.uint64(32)) | offset.astype(np.uint64)

    def add(self, tid: np.ndarray, ts: np.ndarray, wait_start: np.ndarray):
        if not len(tid):
            return
        tid, ts, start = (np.concatenate(pair) for pair in
                          ((self.tid, tid), (self.ts, ts), (self.start, wait_start)))
        recent = ts >= ts.max() - self.keep_ns
        if recent.sum() > self.limit:
            recent &= ts >= np.sort(ts[recent])[-self.limit]
        tid, ts, start = tid[recent], ts[recent], start[recent]
        self.base = int(ts.min())
        self.keys = self._keys(tid, ts)
        order = np.argsort(self.keys, kind="stable")
        self.keys, self.tid, self.ts, self.start = (a[order] for a in
                                                    (self.keys, tid, ts, start))

    def inside(self, tid: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
        """Per call [start, end) of thread `tid`: the run-queue wait of the
        thread's last switch-in within it (0 where none is known)."""
        out = np.zeros(len(tid), np.int64)
        if not len(self.keys) or not len(tid):
            return out
        at = np.searchsorted(self.keys, self._keys(tid, end), side="right") - 1
        found = at >= 0
        at = np.maximum(at, 0)
        found &= (self.tid[at] == tid) & (self.ts[at] > start) & (self.ts[at] <= end) & \
            (end >= self.base)
        out[found] = self.ts[at][found] - np.maximum(self.start[at], start)[found]
        return np.maximum(out, 0)


@dataclass
class DeviceRoles:
    """What the time split needs of the device stream's records (the agent
    fills it from bpf/device.py: this layer reads no kernel layout)."""
    sync_kind: int
    memcpy_kind: int
    # By kind id, the last slot for any kind past the table (np.isin sets
    # up and sorts afresh for every batch):
    submission_kinds: np.ndarray    # bool: submissions
    exported_kinds: np.ndarray      # bool: the kinds that are calls a user sees
    returned_flag: int          # flags bit: the call's return was probed
    blocking: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))  # by API id
    npu: np.ndarray = field(default_factory=lambda: np.zeros(1, bool))       # by API id


def _of_kinds(kind: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which of `kind` the bool `table` (by kind id) holds."""
    return table[np.minimum(kind, len(table) - 1)]


@dataclass
class ThreadInfo:
    pid: int
    comm: str


class ThreadNames:
    """Each thread's process and name, as its latest record has them (a
    thread renamed after exec or prctl takes its new name), in sorted numpy
    arrays: a batch is learnt without a loop over its threads. Past `limit`
    threads, the half seen longest ago is forgotten."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self.tid = np.zeros(0, np.int64)
        self.pid = np.zeros(0, np.int64)
        self.comm = np.zeros(0, "S16")
        self.seen = np.zeros(0, np.int64)

    def __len__(self):
        return len(self.tid)

    def _find(self, tids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.searchsorted(self.tid, tids)
        hit = at < len(self.tid)
        hit[hit] = self.tid[at[hit]] == tids[hit]
        return at, hit

    def learn(self, records: np.ndarray):
        """Records (or a dict of columns) with tid, pid, comm and ts_ns."""
        if not len(records["tid"]):
            return
        # The last record of each run of one thread's records (launches come
        # in bursts), then each thread's latest; only those rows' fields are
        # gathered, never whole records.
        tid = records["tid"]
        ends = np.flatnonzero(np.append(tid[1:] != tid[:-1], True))
        tids, last = np.unique(tid[ends][::-1].astype(np.int64), return_index=True)
        latest = ends[len(ends) - 1 - last]
        pid, comm, seen = (records[f][latest] for f in ("pid", "comm", "ts_ns"))
        at, hit = self._find(tids)
        self.pid[at[hit]] = pid[hit]
        self.comm[at[hit]] = comm[hit]
        self.seen[at[hit]] = seen[hit]
        if not hit.all():
            new = ~hit
            self.tid = np.concatenate([self.tid, tids[new]])
            self.pid = np.concatenate([self.pid, pid[new].astype(np.int64)])
            self.comm = np.concatenate([self.comm, comm[new].astype("S16")])
            self.seen = np.concatenate([self.seen, seen[new].astype(np.int64)])
            if len(self.tid) > self.limit:
                keep = np.argsort(self.seen, kind="stable")[-(self.limit // 2):]
                self.tid, self.pid, self.comm, self.seen = (
                    a[keep] for a in (self.tid, self.pid, self.comm, self.seen))
            order = np.argsort(self.tid, kind="stable")
            self.tid, self.pid, self.comm, self.seen = (
                a[order] for a in (self.tid, self.pid, self.comm, self.seen))

    def known(self, tids: np.ndarray) -> np.ndarray:
        """Which of `tids` have a name."""
        return self._find(np.asarray(tids, np.int64))[1]

    def get(self, tid: int) -> ThreadInfo | None:
        at, hit = self._find(np.array([tid], np.int64))
        if not hit[0]:
            return None
        return ThreadInfo(int(self.pid[at[0]]),
                          bytes(self.comm[at[0]]).decode("utf-8", "replace"))

    def pids(self, tids: np.ndarray) -> np.ndarray:
        """The process of each of `tids` (0 where unknown)."""
        at, hit = self._find(np.asarray(tids, np.int64))
        out = np.zeros(len(at), np.int64)
        out[hit] = self.pid[at[hit]]
        return out


class TimeSplit:
    """The sums a diagnosis reads, per thread and slice of time."""

    def __init__(self, roles: DeviceRoles, slice_ns: int = SLICE_NS,
                 max_threads: int = 1 << 16, max_rows: int = MAX_ROWS):
        """`roles`: the device stream's kinds, and per API id (of the table
        the events were recorded with) whether a call is complete when it
        returns (a synchronous copy) and whether it is an NPU's."""
        self.slice_ns = slice_ns
        self.roles = roles
        self.threads_table = _Table(THREAD_SLICE)
        self.device_table = _Table(DEVICE_SLICE)
        self.culprit_table = _Table(CULPRIT_SLICE, ("key", "holder"))
        self.names = ThreadNames(max_threads)        # tid -> its process and name
        self.waits = RecentWaits()
        self.max_rows = max_rows
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.has_blocked = True
        self.dropped = 0            # records whose stamps or lengths no thread could have
        # tid -> ThreadInfo or None, for a thread no record named (the live
        # daemon reads /proc): the holders of CPUs are no launchers.
        self.resolve = lambda tid: None

    # ------------------------------------------------------------ intake

    def _seen(self, low: int, high: int):
        self.first_ns = low if self.first_ns is None else min(self.first_ns, low)
        self.last_ns = high if self.last_ns is None else max(self.last_ns, high)

    def add_runq(self, runq: np.ndarray):
        """Switch-in records (bpf/sched.py RUNQ_EVENT; a recording made
        before blocked_ns has none, and its sleeps count as on-CPU)."""
        with_blocked = "blocked_ns" in runq.dtype.names
        self.has_blocked &= with_blocked
        sane = (runq["ts_ns"] < MAX_TS_NS) & (runq["delay_ns"] < MAX_INTERVAL_NS)
        if with_blocked:
            sane &= runq["blocked_ns"] < MAX_INTERVAL_NS
        if not sane.all():
            self.dropped += int((~sane).sum())
            runq = runq[sane]
        if not len(runq):
            return
        ts = runq["ts_ns"].astype(np.int64)
        delay = np.minimum(runq["delay_ns"].astype(np.int64), ts)
        blocked = np.minimum(runq["blocked_ns"].astype(np.int64), ts - delay) if with_blocked \
            else np.zeros(len(runq), np.int64)
        tid = runq["tid"].astype(np.int64)
        self._seen(int((ts - delay - blocked).min()), int(ts.max()))
        self.names.learn(runq)
        wait_start = ts - delay
        self.waits.add(tid, ts, wait_start)
        parts = []
        for start, end, field in ((wait_start, ts, "runnable"),
                                  (wait_start - blocked, wait_start, "blocked")):
            rows, slices, lengths = split_intervals(start, end, self.slice_ns)
            piece = np.zeros(len(rows), THREAD_SLICE)
            piece["key"] = _key(tid[rows], slices)
            piece[field] = lengths
            # A thread's first and last evidence, for the part of a slice it lived.
            piece["first"] = np.maximum(start[rows], slices * self.slice_ns)
            piece["last"] = np.minimum(ts[rows], (slices + 1) * self.slice_ns)
            parts.append(piece)
        self.threads_table.add(np.concatenate(parts))
        self._bound()
        if "prev_tid" in runq.dtype.names:
            long_wait = (delay >= CULPRIT_FLOOR_NS) & (runq["prev_tid"] != 0) & \
                (runq["prev_tid"] != runq["tid"])
            if long_wait.any():
                rows, slices, lengths = split_intervals(wait_start[long_wait], ts[long_wait],
                                                        self.slice_ns)
                piece = np.zeros(len(rows), CULPRIT_SLICE)
                piece["key"] = _key(tid[long_wait][rows], slices)
                piece["holder"] = runq["prev_tid"][long_wait][rows]
                piece["wait"] = lengths
                self.culprit_table.add(piece)

    def add_device(self, events: np.ndarray):
        """Aligned GPU/NPU events (align.ALIGNED_EVENT): time in syncs and
        blocking copies, submissions, failed calls, bytes, and the NPU's
        submit-to-retire."""
        r = self.roles
        keep = _of_kinds(events["kind"], r.exported_kinds)
        sane = (events["ts_ns"] < MAX_TS_NS) & (events["duration_ns"] < MAX_INTERVAL_NS)
        self.dropped += int((keep & ~sane).sum())
        keep &= sane
        # The fields read, each gathered alone: a whole record is 256 bytes.
        whole = keep.all()
        events = {name: events[name] if whole else events[name][keep] for name in _DEVICE_FIELDS}
        if not len(events["ts_ns"]):
            return
        ts = events["ts_ns"].astype(np.int64)
        returned = (events["flags"] & r.returned_flag) != 0
        duration = np.where(returned, events["duration_ns"].astype(np.int64), 0)
        end = ts + duration
        self._seen(int(ts.min()), int(end.max()))
        tid = events["tid"].astype(np.int64)
        api = np.minimum(events["api"].astype(np.int64), len(r.blocking) - 1)
        kind = events["kind"]
        is_sync = kind == r.sync_kind
        is_copy = (kind == r.memcpy_kind) & r.blocking[api]
        submission = _of_kinds(kind, r.submission_kinds)
        npu = r.npu[api]
        failed = returned & (events["ret"] != 0)      # did no work
        retired = events["retired_ns"].astype(np.int64)
        queue = np.where(npu & submission & (retired > ts), retired - ts, 0)
        # A sync or copy is the device's time less the wait for a CPU that
        # ended it (its tail: the call returns at once on the CPU).
        waited = (is_sync | is_copy) & (duration > 0)
        end[waited] -= self.waits.inside(tid[waited], ts[waited], end[waited])
        rows, slices, lengths = split_intervals(ts, np.maximum(end, ts + 1), self.slice_ns)
        key = _key(tid[rows], slices)
        timed = np.where(duration[rows] > 0, lengths, 0)
        # Counted once, in the slice the call began.
        began = slices == ts[rows] // self.slice_ns
        ok = ~failed[rows]
        columns = {
            "sync": np.where(is_sync[rows], timed, 0),
            "copy": np.where(is_copy[rows], timed, 0),
            "calls": began,
            "submissions": began & submission[rows] & ok,
            "failed": began & failed[rows],
            "bytes": np.where(began & ok & (kind[rows] == r.memcpy_kind),
                              events["bytes"][rows].astype(np.int64), 0),
            "npu": began & npu[rows],
            "queue": np.where(began, queue[rows], 0)}
        # One row per run of a thread's calls in one slice (a launch burst is
        # one row), summed here without a sort; the table sorts what is left.
        runs = np.flatnonzero(np.append(True, key[1:] != key[:-1]))
        piece = np.zeros(len(runs), DEVICE_SLICE)
        piece["key"] = key[runs]
        for name, column in columns.items():
            piece[name] = np.add.reduceat(column.astype(np.int64), runs)
        piece["first"] = np.minimum.reduceat(np.maximum(ts[rows], slices * self.slice_ns), runs)
        piece["last"] = np.maximum.reduceat(np.minimum(end[rows], (slices + 1) * self.slice_ns),
                                            runs)
        self.device_table.add(piece)
        self._bound()
        # A thread known only by its GPU/NPU calls still has a process.
        self.names.learn(events)

    def _bound(self):
        """Past max_rows, slices double until the rows fit; when a doubling
        frees nothing (as many threads as rows), the threads past the bound
        seen longest ago go instead."""
        tables = (self.threads_table, self.device_table, self.culprit_table)
        while sum(t.size for t in tables) > self.max_rows:
            before = sum(len(t.rows()) for t in tables)
            if before <= self.max_rows // 2:
                return
            self.slice_ns *= 2
            for table in tables:
                rows = table.rows().copy()
                rows["key"] = _key(key_tid(rows["key"]), key_slice(rows["key"]) // 2)
                table.parts = [_reduce(rows, table.by)]
                table.size = table.reduced = len(table.parts[0])
            if sum(t.size for t in tables) >= before:
                for table in tables:
                    rows = table.rows()
                    keep = np.argsort(rows["last"] if "last" in rows.dtype.names
                                      else rows["key"], kind="stable")[-(self.max_rows // 6):]
                    table.parts = [rows[np.sort(keep)]]
                    table.size = table.reduced = len(table.parts[0])
                    self.dropped += len(rows) - len(keep)
                return

    def aligned(self, start_ns: int, end_ns: int) -> tuple[int, int]:
        """The window the sums can answer for: the whole slices that hold
        [start_ns, end_ns), at least one."""
        step = self.slice_ns
        lo = start_ns // step * step
        hi = max(lo + step, -(-end_ns // step) * step)
        return lo, hi

    def name_holders(self, since_ns: int, limit: int = 256) -> int:
        """Name the threads that held a launcher's CPU since `since_ns` and
        no record named, through `resolve` (the live daemon's /proc), while
        they still run: a hog that has exited by the time someone asks
        would stay nameless. At most `limit` a call; how many were named."""
        if self.last_ns is None or self.last_ns < since_ns // self.slice_ns * self.slice_ns:
            return 0                # nothing since: no holder to name
        rows = self.culprit_table.rows()
        holders = np.unique(rows["holder"][key_slice(rows["key"]) >= since_ns // self.slice_ns]
                            .astype(np.int64))
        named = 0
        for tid in holders[~self.names.known(holders)][:limit].tolist():
            info = self.resolve(tid)
            if info is not None:
                self.names.learn({"tid": np.array([tid]), "pid": np.array([info.pid]),
                                  "comm": np.array([info.comm.encode()[:16]], "S16"),
                                  "ts_ns": np.array([since_ns])})
                named += 1
        return named

    def forget_before(self, ts_ns: int):
        """Drop every slice that ends before ts_ns (a live daemon's reach)."""
        oldest = ts_ns // self.slice_ns
        for table in (self.threads_table, self.device_table, self.culprit_table):
            table.keep(lambda rows: key_slice(rows["key"]) >= oldest)
        if self.first_ns is not None:
            self.first_ns = max(self.first_ns, oldest * self.slice_ns)

    # ------------------------------------------------------------ reading

    def slices(self, start_ns: int, end_ns: int):
        """The three tables' rows whose slice lies in [start_ns, end_ns)
        (slice-aligned ends: see aligned())."""
        lo, hi = start_ns // self.slice_ns, max(start_ns, end_ns - 1) // self.slice_ns

        def within(rows):
            s = key_slice(rows["key"])
            return rows[(s >= lo) & (s <= hi)]
        return (within(self.threads_table.rows()), within(self.device_table.rows()),
                within(self.culprit_table.rows()))
