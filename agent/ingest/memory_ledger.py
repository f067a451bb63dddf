"""Device memory per process, stream (gpu, npu) and device, from the
allocation and free records (bpf/device_memory.py): what each holds now,
how many allocations and frees succeeded, the failed ones by API and
return code (kept apart: they hold nothing), and the largest live
allocations. Fed device batches in time order, live or from a recording.

Live allocations are kept for the largest-first view, bounded
(`max_live`): past it the bytes still count, the pointer is not kept
(`live_overflow`). The kernel bounds its own map the same way."""

import heapq
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf import device_memory as dm

MAX_LIVE = 1 << 16
MAX_PROCESSES = 4096


@dataclass
class Holding:
    """One (process, stream, device)."""
    outstanding: int = 0        # bytes held now
    allocs: int = 0             # successful allocations
    frees: int = 0              # frees that gave memory back
    allocated_bytes: int = 0
    freed_bytes: int = 0
    last_alloc_ns: int = 0
    last_free_ns: int = 0


@dataclass
class Process:
    holdings: dict = field(default_factory=dict)    # (stream, device) -> Holding
    failed: Counter = field(default_factory=Counter)    # (api, ret) -> calls
    failed_bytes: int = 0                           # asked for by failed allocations
    first_alloc_ns: int = 0

    @property
    def outstanding(self) -> int:
        return sum(h.outstanding for h in self.holdings.values())


class MemoryLedger:
    def __init__(self, infos=None, max_live: int = MAX_LIVE,
                 max_processes: int = MAX_PROCESSES):
        self.infos = infos or device_stream.default_infos()
        self.max_live, self.max_processes = max_live, max_processes
        self.processes: dict[int, Process] = {}
        self.live: dict[tuple[int, int], tuple] = {}    # (pid, ptr) -> (bytes, ts, stream, device, api)
        self.live_overflow = 0
        self.skipped = 0        # records of processes past max_processes
        self.unmatched_frees = 0
        self.at_exit: list[dict] = []       # what exited processes still held (last 64)

    def feed(self, events: np.ndarray):
        """A batch of device records; only allocations and frees count. The
        columns are read out once: a record's fields one by one cost ten
        times more."""
        mine = events[np.isin(events["kind"], (dm.ALLOC, dm.FREE))]
        if not len(mine):
            return
        held, released = dm.held(mine), dm.released(mine)
        at = np.flatnonzero(held | released | dm.failed_allocations(mine))
        columns = [mine[f][at].tolist() for f in ("pid", "api", "ret", "bytes", "ts_ns",
                                                  "handle", "device")]
        for row in zip(*columns, held[at].tolist(), released[at].tolist()):
            self._one(*row)
        self.unmatched_frees += int(((mine["flags"] & dm.FLAG_FREE_UNMATCHED) != 0).sum())

    def _one(self, pid, api_id, ret, size, ts, ptr, device, held: bool, released: bool):
        proc = self.processes.get(pid)
        if proc is None:
            if len(self.processes) >= self.max_processes:
                self.skipped += 1
                return
            proc = self.processes[pid] = Process()
        info = self.infos.get(api_id)
        stream = info.stream if info is not None else "gpu"
        api = info.api if info is not None else str(api_id)
        if not held and not released:
            proc.failed[(api, ret)] += 1
            proc.failed_bytes += size
            return
        h = proc.holdings.get((stream, device))
        if h is None:
            h = proc.holdings[(stream, device)] = Holding()
        if held:
            proc.first_alloc_ns = proc.first_alloc_ns or ts
            h.outstanding += size
            h.allocs += 1
            h.allocated_bytes += size
            h.last_alloc_ns = ts
            if len(self.live) < self.max_live:
                self.live[(pid, ptr)] = (size, ts, stream, device, api)
            else:
                self.live_overflow += 1
        else:
            # A free counts what its allocation held, never more.
            size = min(size, h.outstanding)
            h.outstanding -= size
            h.frees += 1
            h.freed_bytes += size
            h.last_free_ns = ts
            self.live.pop((pid, ptr), None)

    # ------------------------------------------------------------ views

    def outstanding(self) -> dict[tuple[str, int], int]:
        """(stream, device) -> bytes the traced processes hold now."""
        out: Counter = Counter()
        for proc in self.processes.values():
            for key, h in proc.holdings.items():
                out[key] += h.outstanding
        return dict(out)

    def totals(self) -> dict[str, Counter]:
        """Counters for rates: allocs, frees and failed, by stream."""
        out = {"allocs": Counter(), "frees": Counter(), "failed": Counter()}
        for proc in self.processes.values():
            for (stream, _), h in proc.holdings.items():
                out["allocs"][stream] += h.allocs
                out["frees"][stream] += h.frees
            for (api, _), n in proc.failed.items():
                out["failed"][api] += n
        return out

    def largest(self, pid: int, n: int = 5) -> list[dict]:
        """A process's largest live allocations, largest first."""
        rows = [(v[0], ptr, v) for (p, ptr), v in self.live.items() if p == pid]
        return [{"bytes": size, "ptr": ptr, "ts_ns": v[1], "stream": v[2], "device": v[3],
                 "api": v[4]} for size, ptr, v in heapq.nlargest(n, rows)]

    def summary(self, pid: int) -> dict:
        proc = self.processes[pid]
        return {"pid": pid, "outstanding_bytes": proc.outstanding,
                "holdings": [{"stream": s, "device": d, "outstanding_bytes": h.outstanding,
                              "allocs": h.allocs, "frees": h.frees,
                              "allocated_bytes": h.allocated_bytes,
                              "freed_bytes": h.freed_bytes}
                             for (s, d), h in sorted(proc.holdings.items())],
                "failed": [{"api": a, "ret": r, "count": n}
                           for (a, r), n in proc.failed.most_common()],
                "largest": self.largest(pid)}

    def forget(self, pid: int, now_ns: int) -> dict | None:
        """A process has exited: what it still held (None when nothing),
        kept in `at_exit`; its state goes."""
        proc = self.processes.pop(pid, None)
        if proc is None:
            return None
        left = None
        if proc.outstanding > 0:
            left = {"pid": pid, "exit_ns": int(now_ns), "outstanding_bytes": proc.outstanding,
                    "holdings": {f"{s}:{d}": h.outstanding
                                 for (s, d), h in proc.holdings.items() if h.outstanding}}
            self.at_exit = (self.at_exit + [left])[-64:]
        for key in [k for k in self.live if k[0] == pid]:
            del self.live[key]
        return left
