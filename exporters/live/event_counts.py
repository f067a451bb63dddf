"""What the metrics count of the event streams: a sink of the daemon's one
ingest path, fed a batch at a time with numpy (no per-event Python work).

- device submissions per API, memcpy bytes per (API, direction), of the
  calls that did not fail; failed calls per (API, return code);
- sync-wait and submit-to-retire histograms per stream (gpu, npu);
- run-queue delay histograms per process that does GPU/NPU work.

Everything only grows, as Prometheus counters must. `snapshot()` hands a
scrape a copy taken under the lock; the ingest thread holds the same lock
for the few array additions of a batch.
"""

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.return_codes import BY_LIBRARY

SYNC = device_stream.KIND_IDS["sync"]
MEMCPY = device_stream.KIND_IDS["memcpy"]
SUBMISSION_KINDS = device_stream.id_table(device_stream.KIND_IDS[k]
                                          for k in device_stream.SUBMISSION_KINDS)
# Upper bounds in seconds, powers of two of a microsecond: 1 µs .. ~1 s for
# run-queue delays, 1 µs .. ~16 s for sync waits and submit-to-retire.
RUNQ_BOUNDS = tuple(2.0 ** k * 1e-6 for k in range(21))
DEVICE_BOUNDS = tuple(2.0 ** k * 1e-6 for k in range(25))
MAX_PROCESSES = 4096


@dataclass
class Histogram:
    """Counts per bucket (`bounds` upper bounds, then +Inf) and the sum."""
    bounds: tuple
    counts: np.ndarray = None
    sum: float = 0.0

    def __post_init__(self):
        if self.counts is None:
            self.counts = np.zeros(len(self.bounds) + 1, np.int64)

    def add(self, values_s: np.ndarray):
        if len(values_s):
            index = np.searchsorted(self.bounds, values_s, side="left")
            self.counts += np.bincount(index, minlength=len(self.counts))
            self.sum += float(values_s.sum())

    def merge(self, other: "Histogram"):
        self.counts += other.counts
        self.sum += other.sum

    def copy(self) -> "Histogram":
        return Histogram(self.bounds, self.counts.copy(), self.sum)

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus buckets: (le, cumulative count), +Inf last."""
        running = np.cumsum(self.counts).tolist()
        les = [f"{b:.9g}" for b in self.bounds] + ["+Inf"]
        return list(zip(les, running))


@dataclass
class ProcessRunq:
    name: str
    hist: Histogram = field(default_factory=lambda: Histogram(RUNQ_BOUNDS))


@dataclass
class CountsSnapshot:
    submissions: dict          # (stream, kind, api) -> count
    memcpy_bytes: dict         # (stream, direction) -> bytes
    sync_wait: dict            # stream -> Histogram
    submit_to_retire: dict     # stream -> Histogram
    processes: dict            # pid -> ProcessRunq
    failures: dict = field(default_factory=dict)   # (stream, api, code, error) -> calls


class EventCounts:
    """Fed by the daemon (on_runq, on_device); read by the Prometheus
    collector (snapshot). The /proc root is injectable for process names."""

    def __init__(self, infos: dict | None = None, proc_root: Path = Path("/proc"),
                 max_processes: int = MAX_PROCESSES):
        self.infos = infos if infos is not None else device_stream.default_infos()
        self.proc_root = Path(proc_root)
        self.max_processes = max_processes
        size = max(self.infos, default=0) + 1
        self._known = np.zeros(size, bool)
        self._known[list(self.infos)] = True
        # Per stream, which API ids are its own.
        self._of_stream = {s: np.array([i in self.infos and self.infos[i].stream == s
                                        for i in range(size)], bool) for s in ("gpu", "npu")}
        self._lock = threading.Lock()
        self._submissions = np.zeros(size, np.int64)
        self._memcpy = np.zeros((size, 256), np.float64)
        self._sync_wait = {s: Histogram(DEVICE_BOUNDS) for s in ("gpu", "npu")}
        self._retire = {s: Histogram(DEVICE_BOUNDS) for s in ("gpu", "npu")}
        self._processes: dict[int, ProcessRunq] = {}
        self._failures: dict[tuple[int, int], int] = {}     # (api id, code) -> calls
        self.processes_dropped = 0

    # ------------------------------------------------------------- ingest

    def on_runq(self, batch: np.ndarray, submitters):
        """Run-queue events; those of threads that do device work count per process."""
        mine = submitters.select(batch)
        if not len(mine):
            return
        pids, first, inverse = np.unique(mine["pid"], return_index=True, return_inverse=True)
        delays = mine["delay_ns"] / 1e9
        with self._lock:
            for k, pid in enumerate(pids.tolist()):
                proc = self._process(pid, mine["comm"][first[k]])
                if proc is not None:
                    proc.hist.add(delays[inverse == k])

    def on_device(self, aligned: np.ndarray, retired: np.ndarray):
        """Aligned device events of a batch, and the submissions it retired.
        Each column is read with a mask of the calls it counts: a copy of
        the rows themselves (248-byte records with byte-string fields) goes
        field by field, and cost more than the counting."""
        api = np.minimum(aligned["api"].astype(np.int64), len(self._known) - 1)
        known = self._known[api] & (aligned["api"] < len(self._known))
        failed = device_stream.failed(aligned) & known
        if failed.any():
            codes = aligned["ret"][failed]
            keys = device_stream.api_code_keys(api[failed], codes)
            _, first, calls = np.unique(keys, return_index=True, return_counts=True)
            pairs = zip(api[failed][first].tolist(), codes[first].tolist(), calls.tolist())
            with self._lock:
                for api_id, code, n in pairs:
                    self._failures[(api_id, code)] = self._failures.get((api_id, code), 0) + n
        worked = known & ~failed            # a failed call did no work
        kind = aligned["kind"]
        submitted = device_stream.in_table(kind, SUBMISSION_KINDS) & worked
        memcpy = (kind == MEMCPY) & worked
        syncs = (kind == SYNC) & ((aligned["flags"] & device_stream.FLAG_RETURNED) != 0) & worked
        with self._lock:
            self._submissions += np.bincount(api[submitted], minlength=len(self._submissions))
            if memcpy.any():
                # float64 (as Prometheus counts): a garbled length beyond 2^63
                # cannot turn the total negative
                np.add.at(self._memcpy, (api[memcpy], aligned["direction"][memcpy]),
                          aligned["bytes"][memcpy].astype(np.float64))
            if syncs.any():
                for stream, hist in self._sync_wait.items():
                    mask = syncs & self._of_stream[stream][api]
                    hist.add(aligned["duration_ns"][mask] / 1e9)
            if len(retired):
                r_api = np.minimum(retired["api"].astype(np.int64), len(self._known) - 1)
                latency = np.maximum(retired["retired_ns"] - retired["ts_ns"].astype(np.int64),
                                     0) / 1e9
                for stream, hist in self._retire.items():
                    hist.add(latency[self._of_stream[stream][r_api]])

    def forget_exited(self):
        """Drop processes that have exited (their counts leave with them)."""
        with self._lock:
            for pid in [p for p in self._processes if not (self.proc_root / str(p)).exists()]:
                del self._processes[pid]

    def process_name(self, pid: int) -> str | None:
        """The process's name as the metrics label it (/proc/PID/comm when
        it was first seen), if its run-queue delay was counted."""
        proc = self._processes.get(pid)
        return proc.name if proc is not None else None

    def _process(self, pid: int, thread_comm: bytes) -> ProcessRunq | None:
        proc = self._processes.get(pid)
        if proc is None:
            if len(self._processes) >= self.max_processes:
                self.processes_dropped += 1
                return None
            proc = self._processes[pid] = ProcessRunq(self._name(pid, thread_comm))
        return proc

    def _name(self, pid: int, thread_comm: bytes) -> str:
        """The process's name; for one gone already, that of a thread of it."""
        try:
            name = (self.proc_root / str(pid) / "comm").read_text().strip()
        except OSError:
            name = ""
        return name or thread_comm.decode(errors="replace").rstrip("\0") or "unknown"

    # --------------------------------------------------------------- read

    def snapshot(self) -> CountsSnapshot:
        with self._lock:
            submissions = self._submissions.copy()
            memcpy = self._memcpy.copy()
            sync_wait = {s: h.copy() for s, h in self._sync_wait.items()}
            retire = {s: h.copy() for s, h in self._retire.items()}
            processes = {pid: ProcessRunq(p.name, p.hist.copy())
                         for pid, p in self._processes.items()}
            failures = dict(self._failures)
        subs, bytes_, failed = {}, {}, {}
        for (api_id, code), n in failures.items():
            info = self.infos[api_id]
            name = BY_LIBRARY.get(info.library, {}).get(code, "unknown")
            key = (info.stream, info.api, str(code), name)
            failed[key] = failed.get(key, 0) + n
        for api_id in np.flatnonzero(submissions).tolist():
            info = self.infos[api_id]
            key = (info.stream, info.kind, info.api)
            subs[key] = subs.get(key, 0) + int(submissions[api_id])
        for api_id, direction in zip(*np.nonzero(memcpy)):
            info = self.infos[int(api_id)]
            name = device_stream.direction_names(info.stream).get(int(direction), "unknown")
            key = (info.stream, name)
            bytes_[key] = bytes_.get(key, 0) + int(memcpy[api_id, direction])
        return CountsSnapshot(subs, bytes_, sync_wait, retire, processes, failed)


def process_labels(processes: dict, k: int, with_pid: bool = False) -> dict[int, tuple]:
    """pid -> its label values under bounded labels: the k busiest workloads
    by wake-ups, keyed by process name (or name and pid when `with_pid`),
    and the rest `other`. Ranked by wake-ups since the daemon started, the
    set changes only when one workload overtakes another. Every family that
    labels a workload takes its labels from here, so that they name the
    same processes."""
    keys = {pid: (proc.name, str(pid)) if with_pid else (proc.name,)
            for pid, proc in processes.items()}
    wakeups: dict[tuple, int] = {}
    for pid, proc in processes.items():
        wakeups[keys[pid]] = wakeups.get(keys[pid], 0) + int(proc.hist.counts.sum())
    ranked = sorted(wakeups, key=lambda key: (-wakeups[key], key))
    other = OTHER_LABELS[with_pid]
    named = {key for key in ranked[:k] if key != other}
    return {pid: key if key in named else other for pid, key in keys.items()}


OTHER_LABELS = {False: ("other",), True: ("other", "other")}


def top_k(processes: dict, k: int, with_pid: bool = False) -> list[tuple[tuple, Histogram]]:
    """Per-process histograms under bounded labels (process_labels), busiest
    first, `other` last. When the set changes, `other` may step down once,
    which Prometheus takes for a counter reset."""
    groups: dict[tuple, Histogram] = {}
    for pid, key in process_labels(processes, k, with_pid).items():
        if key in groups:
            groups[key].merge(processes[pid].hist)
        else:
            groups[key] = processes[pid].hist.copy()
    other = OTHER_LABELS[with_pid]
    return sorted(groups.items(), key=lambda kv: (kv[0] == other, -int(kv[1].counts.sum()),
                                                  kv[0]))
