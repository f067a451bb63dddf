"""The device stream's three rings read as one stream of DEV_EVENT records.

The kernel sends most kernel launches in one cache line on `dev_launches`
(bpf/device.py DEV_LAUNCH, 64 bytes), each other call as a 144-byte struct
dev_event (DEV_RECORD) on `dev_events`, and what belongs to a thread or a
handle rather than to a call on `dev_names` (DEV_NAMED, 240 bytes): a
thread's comm and process once (DEV_THREAD records, again after exec or a
rename), a kernel handle's name, an aclop call with its opType. A reader of
the device stream gets what it always had, DEV_EVENT records (the recorded
layout): the per-call records widened by two block copies, the launches
by agent/kernel/launch_records.py, each with its thread's comm, in time
order; the named ones in place among them by time; the thread records
consumed here.

The names ring is read first, then the launches, then the other calls: a
name or comm sent before a call is read no later than the call, and so is
the whole record that told a compact launch's call site. A thread whose
comm never came (the names ring was full when it was sent; the kernel
sends it again with its next call) is named from /proc/TID/comm, and
counted.
"""

from collections import Counter
from pathlib import Path

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.agent.kernel.launch_records import LaunchFacts
from mmtrace.agent.kernel.ringbuf import RingReader

DEV_EVENT = device_stream.DEV_EVENT
DEV_RECORD = device_stream.DEV_RECORD
DEV_NAMED = device_stream.DEV_NAMED
DEV_LAUNCH = device_stream.DEV_LAUNCH
THREAD = device_stream.KIND_IDS["thread"]
MAX_THREADS = 1 << 17       # comms kept: twice the kernel's thread map


def copy_runs(narrow: np.dtype, wide: np.dtype) -> list[tuple[int, int, int]]:
    """(start, end, wide_start): the byte runs of `narrow` that sit in a row
    of `wide` too, in the same order; together they cover all of `narrow`."""
    runs = []
    for name in narrow.names:
        _, lo = narrow.fields[name][:2]
        _, at = wide.fields[name][:2]
        size = narrow.fields[name][0].itemsize
        if wide.fields[name][0] != narrow.fields[name][0]:
            raise TypeError(f"{name}: {narrow.fields[name][0]} here, "
                            f"{wide.fields[name][0]} in the wide layout")
        if runs and runs[-1][1] == lo and runs[-1][2] + (lo - runs[-1][0]) == at:
            runs[-1] = (runs[-1][0], lo + size, runs[-1][2])
        else:
            runs.append((lo, lo + size, at))
    return runs


_RECORD_RUNS = copy_runs(DEV_RECORD, DEV_EVENT)


def widen(records: np.ndarray) -> np.ndarray:
    """DEV_EVENT copies of DEV_RECORD records, comm, name and the named
    addresses empty."""
    n = len(records)
    out = np.zeros(n, DEV_EVENT)
    if n:
        src = np.ascontiguousarray(records).view(np.uint8).reshape(n, DEV_RECORD.itemsize)
        dst = out.view(np.uint8).reshape(n, DEV_EVENT.itemsize)
        for lo, hi, at in _RECORD_RUNS:
            dst[:, at:at + hi - lo] = src[:, lo:hi]
    return out


def from_named(records: np.ndarray) -> np.ndarray:
    """DEV_EVENT copies of DEV_NAMED records (rare: field by field)."""
    out = np.zeros(len(records), DEV_EVENT)
    for name in DEV_NAMED.names:
        out[name] = records[name]
    return out


class ThreadComms:
    """Thread id -> comm and process, from the kernel's DEV_THREAD records;
    a thread missing from them is read from /proc once (the root is
    injectable)."""

    def __init__(self, proc_root: Path = Path("/proc"), max_threads: int = MAX_THREADS):
        self.proc_root = Path(proc_root)
        self.max_threads = max_threads
        self._comm: dict[int, bytes] = {}
        self._pid: dict[int, int] = {}      # a thread's process never changes
        self.counters: Counter[str] = Counter()

    def learn_pids(self, threads: np.ndarray):
        """The process of each thread of these DEV_THREAD records."""
        for tid, pid in zip(threads["tid"].tolist(), threads["pid"].tolist()):
            self._pid.pop(tid, None)
            self._pid[tid] = pid
        while len(self._pid) > self.max_threads:
            del self._pid[next(iter(self._pid))]

    def pids(self, tids: np.ndarray) -> np.ndarray:
        """Each thread's process; 0 for one gone before it was known."""
        distinct, inverse = np.unique(tids, return_inverse=True)
        pids = np.array([self._pid_of(t) for t in distinct.tolist()], np.uint32)
        return pids[inverse]

    def _pid_of(self, tid: int) -> int:
        pid = self._pid.get(tid)
        if pid is None:
            pid = self._pid[tid] = self._pid_from_proc(tid)
        return pid

    def _pid_from_proc(self, tid: int) -> int:
        try:
            status = (self.proc_root / str(tid) / "status").read_text()
        except OSError:
            self.counters["pid_unknown"] += 1
            return 0
        self.counters["pid_from_proc"] += 1
        for line in status.splitlines():
            if line.startswith("Tgid:"):
                return int(line.split()[1])
        return 0

    def learn(self, threads: np.ndarray):
        """DEV_THREAD records, oldest first: the latest comm of each wins."""
        for tid, comm in zip(threads["tid"].tolist(), threads["comm"].tolist()):
            self._comm.pop(tid, None)           # renamed: to the young end
            self._comm[tid] = comm
        while len(self._comm) > self.max_threads:
            del self._comm[next(iter(self._comm))]
        self.counters["threads_sent"] += len(threads)

    def knows(self, tid: int) -> bool:
        """Whether the thread's comm is known (sent, or read from /proc)."""
        return tid in self._comm

    def get(self, tid: int) -> bytes:
        comm = self._comm.get(tid)
        if comm is None:
            comm = self._from_proc(tid)
            self._comm[tid] = comm
        return comm

    def _fill_around(self, events: np.ndarray, threads: np.ndarray):
        threads = threads[np.argsort(threads["ts_ns"], kind="stable")]
        named = np.isin(events["tid"], threads["tid"])
        if (~named).any():
            rest = events[~named]
            self.fill(rest)
            events["comm"][~named] = rest["comm"]
        for tid in np.unique(threads["tid"]).tolist():
            mine = np.flatnonzero(events["tid"] == tid)
            own = threads[threads["tid"] == tid]        # oldest first
            # Before its first record here: the comm it had (a thread new
            # here has none: its record came with its first event).
            events["comm"][mine] = self._comm.get(tid, own["comm"][0])
            for record in own:          # then each comm from its record's time on
                later = mine[events["ts_ns"][mine] >= record["ts_ns"]]
                events["comm"][later] = record["comm"]
        self.learn(threads)

    def _from_proc(self, tid: int) -> bytes:
        try:
            text = (self.proc_root / str(tid) / "comm").read_bytes().rstrip(b"\n")
        except OSError:
            self.counters["comm_unknown"] += 1      # gone: its events say ""
            return b""
        self.counters["comm_from_proc"] += 1
        return text[:15]

    def fill(self, events: np.ndarray, threads: np.ndarray | None = None):
        """Each event's comm, from its thread id (in place); `threads`: the
        DEV_THREAD records read with them. A thread renamed (an exec, a
        prctl) among these events keeps its old comm on the events before
        the rename and takes the new one from there on."""
        if threads is not None and len(threads):
            self._fill_around(events, threads)
            return
        if not len(events):
            return
        tids = events["tid"]
        first = int(tids[0])
        if np.all(tids == first):               # the usual batch: one launching thread
            events["comm"] = self.get(first)
            return
        distinct, inverse = np.unique(tids, return_inverse=True)
        comms = np.array([self.get(t) for t in distinct.tolist()], DEV_EVENT.fields["comm"][0])
        events["comm"] = comms[inverse]


def merge(events: np.ndarray, named: np.ndarray) -> np.ndarray:
    """`named` (few) put among `events` (about in time order) by ts_ns."""
    if not len(named):
        return events
    if not len(events):
        return named
    named = named[np.argsort(named["ts_ns"], kind="stable")]
    at = np.searchsorted(events["ts_ns"], named["ts_ns"], side="right")
    return np.insert(events, at, named)


def in_time_order(whole: np.ndarray, compact: np.ndarray) -> np.ndarray:
    """Two batches, each about in time order, as one."""
    if not len(compact):
        return whole
    if not len(whole):
        return compact
    both = np.concatenate([whole, compact])
    return both[np.argsort(both["ts_ns"], kind="stable")]


class DeviceRing:
    """The device rings, read as one: `read()` gives DEV_EVENT records."""

    def __init__(self, events: RingReader, names: RingReader,
                 comms: ThreadComms | None = None, launches: RingReader | None = None):
        if events.dtype != DEV_RECORD or names.dtype != DEV_NAMED or (
                launches is not None and launches.dtype != DEV_LAUNCH):
            got = [r.dtype.itemsize for r in (events, names, launches) if r is not None]
            raise TypeError(f"DeviceRing: expected rings of DEV_RECORD, DEV_NAMED and "
                            f"DEV_LAUNCH records ({DEV_RECORD.itemsize}, {DEV_NAMED.itemsize}, "
                            f"{DEV_LAUNCH.itemsize} bytes), got records of {got} bytes")
        self.events = events
        self.names = names
        self.launches = launches
        self.comms = comms if comms is not None else ThreadComms()
        self.facts = LaunchFacts()
        self.dtype = DEV_EVENT
        self._empty = np.empty(0, DEV_EVENT)
        self.records_read = 0
        self.batches = 0

    def _rings(self) -> tuple:
        return tuple(r for r in (self.events, self.names, self.launches) if r is not None)

    def fileno(self) -> int:
        return self.events.fileno()

    def filenos(self) -> tuple[int, ...]:
        """Every ring's descriptor: each is readable (epoll) when its
        programs wake their reader, once per batch."""
        return tuple(r.fileno() for r in self._rings())

    def pending_bytes(self) -> int:
        return sum(r.pending_bytes() for r in self._rings())

    def filled(self) -> float:
        """The largest share of one of its rings written and not yet read."""
        return max(r.filled() for r in self._rings())

    def read(self, max_records: int | None = None) -> np.ndarray:
        """Every record committed now, names first; DEV_EVENT records."""
        if not self.pending_bytes():
            return self._empty      # nothing written: no decoding step to run
        named = self.names.read(max_records)
        compact = self.launches.read(max_records) if self.launches is not None else None
        records = self.events.read(max_records)
        late = self._names_committed_since(named, (records, compact), max_records)
        if late is not None:
            named = np.concatenate([named, late])
        threads = named[:0]
        if len(named):
            thread = named["kind"] == THREAD
            if thread.any():
                threads, named = named[thread], named[~thread]
                self.comms.learn_pids(threads)
        events = widen(records)
        if compact is not None and len(compact):
            self.facts.learn(events)
            compact = self.facts.widen(compact, self.comms.pids(compact["tid"]))
            events = in_time_order(events, compact)
        elif len(events):
            self.facts.learn(events)
        self.comms.fill(events, threads)
        batch = merge(events, from_named(named)) if len(named) else events
        if len(batch):
            self.records_read += len(batch)
            self.batches += 1
        return batch

    def _names_committed_since(self, named: np.ndarray, batches, max_records):
        """The names ring read again when a thread of `batches` is new: its
        comm record is committed before its first event, but after the
        names were read here it is in the ring only now. Without it, a
        thread that has exited since would have its events named "". None
        when every thread is known."""
        tids = [b["tid"] for b in batches if b is not None and len(b)]
        if not tids:
            return None
        sent = set(named["tid"][named["kind"] == THREAD].tolist()) if len(named) else set()
        new = [t for t in np.unique(np.concatenate(tids)).tolist()
               if t not in sent and not self.comms.knows(t)]
        return self.names.read(max_records) if new else None

    def close(self):
        for ring in self._rings():
            ring.close()
