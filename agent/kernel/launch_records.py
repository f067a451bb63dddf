"""Compact launch records (bpf/device.py DEV_LAUNCH) widened into DEV_EVENT.

The kernel sends a kernel launch whose return is not probed in one cache
line (struct dev_launch), leaving out what userspace already has:
- its pid, which is its thread's (the caller passes it in, from the thread
  records: agent/kernel/device_ring.py ThreadComms);
- the high half of its op id: each process's op ids count up from 1, so
  the low half and the process's latest op id give the whole;
- its outer caller, which is its call site's: the kernel sends a launch
  whole the first time a CPU sees its (process, handle, return address),
  and compact after that, so the whole record came first.
Kind launch, no direction, no flags: a launch that did not fit (a failed
read, an odd shape) came whole.
"""

from collections import Counter

import numpy as np

from mmtrace.bpf import device as device_stream

DEV_EVENT = device_stream.DEV_EVENT
DEV_LAUNCH = device_stream.DEV_LAUNCH
LAUNCH = device_stream.KIND_IDS["launch"]
MAX_PROCESSES = 1 << 15
MAX_CALL_SITES = 1 << 16
_LOW = 1 << 32
_HALF = 1 << 31
# The fields a compact record gives as they are.
_COPIED = tuple(name for name in DEV_LAUNCH.names if name != "op_id")
_SITE = np.dtype([("pid", "<u4"), ("handle", "<u8"), ("return_ip", "<u8")])


def _bounded(table: dict, limit: int):
    while len(table) > limit:
        del table[next(iter(table))]


class LaunchFacts:
    """What compact launches leave to earlier records: each process's latest
    op id, and each call site's outer caller."""

    def __init__(self, max_processes: int = MAX_PROCESSES, max_sites: int = MAX_CALL_SITES,
                 table: device_stream.ApiTable | None = None):
        self.max_processes = max_processes
        self.max_sites = max_sites
        # By API id: its launches' sites are the ones compact launches name.
        # Others carry a return address too when their return is timed (an
        # aclnn op's, whose handle is an executor made for each call): kept,
        # they filled the table with sites no compact launch asks for.
        self._site_apis = device_stream.id_table(
            api.id for api in (table or device_stream.default_table()).apis if api.reads_callers)
        self._op: dict[int, int] = {}               # pid -> latest op id
        self._sites: dict[tuple, int] = {}          # (pid, handle, return_ip) -> outer caller
        self._by_handle: dict[int, tuple] = {}      # handle -> its latest (pid, return_ip, outer)
        self.counters: Counter[str] = Counter()

    @property
    def known_sites(self) -> int:
        return len(self._sites)

    def learn(self, events: np.ndarray):
        """DEV_EVENT records read whole: their op ids and launch call sites.
        Column by column: a row copy of these 240-byte records costs more
        than all the rest."""
        if not len(events):
            return
        ops = events["op_id"]
        submitted = np.flatnonzero(ops)
        if submitted.size:
            self._note_ops(events["pid"][submitted], ops[submitted].astype(np.int64))
        at = np.flatnonzero((events["kind"] == LAUNCH) & (events["return_ip"] != 0) &
                            device_stream.in_table(events["api"], self._site_apis))
        if not at.size:
            return
        pids, handles, rets = events["pid"][at], events["handle"][at], events["return_ip"][at]
        outers = events["outer_return_ip"][at]
        for i in self._latest_of_each_site(pids, handles, rets).tolist():
            pid, handle, ret, outer = int(pids[i]), int(handles[i]), int(rets[i]), int(outers[i])
            if self._by_handle.get(handle) == (pid, ret, outer):
                continue                # known already (most batches, where all go whole)
            self._sites.pop((pid, handle, ret), None)
            self._sites[(pid, handle, ret)] = outer
            self._by_handle.pop(handle, None)
            self._by_handle[handle] = (pid, ret, outer)
        _bounded(self._sites, self.max_sites)
        _bounded(self._by_handle, self.max_sites)

    @staticmethod
    def _latest_of_each_site(pids, handles, rets) -> np.ndarray:
        """Index of the latest launch of each (pid, handle, return_ip): by
        handle alone where each handle has one site here (a sort of one
        word), else by the three."""
        back = slice(None, None, -1)
        _, first, inverse = np.unique(handles[back], return_index=True, return_inverse=True)
        if (np.array_equal(pids[back][first][inverse], pids[back]) and
                np.array_equal(rets[back][first][inverse], rets[back])):
            return len(handles) - 1 - first
        sites = np.empty(len(handles), _SITE)
        sites["pid"], sites["handle"], sites["return_ip"] = pids, handles, rets
        _, first = np.unique(sites[back], return_index=True)
        return len(handles) - 1 - first

    def widen(self, records: np.ndarray, pids: np.ndarray) -> np.ndarray:
        """DEV_EVENT copies of DEV_LAUNCH records; `pids`: each one's
        process (its thread's)."""
        n = len(records)
        out = np.zeros(n, DEV_EVENT)
        if not n:
            return out
        for name in _COPIED:
            out[name] = records[name]
        out["pid"] = pids
        out["kind"] = LAUNCH
        out["direction"] = device_stream.NO_DIRECTION
        out["op_id"] = self._op_ids(pids, records["op_id"].astype(np.int64))
        out["outer_return_ip"] = self._outer(pids, records)
        return out

    def _note_ops(self, pids: np.ndarray, ops: np.ndarray):
        for pid in np.unique(pids).tolist():
            latest = int(ops[pids == pid].max())
            self._op[pid] = max(latest, self._op.pop(pid, 0))
        _bounded(self._op, self.max_processes)

    def _op_ids(self, pids: np.ndarray, low: np.ndarray) -> np.ndarray:
        """Whole op ids: each the nearest to the one before it (in ring
        order) with this low half, starting from its process's latest."""
        out = np.empty(len(low), np.int64)
        for pid in np.unique(pids).tolist():
            mine = np.flatnonzero(pids == pid)
            ref = self._op.get(pid, 0)
            steps = np.empty(len(mine), np.int64)
            steps[0] = low[mine[0]] - (ref % _LOW)
            steps[1:] = np.diff(low[mine])
            steps = (steps + _HALF) % _LOW - _HALF
            out[mine] = ref + np.cumsum(steps)
        self._note_ops(pids, out)
        return out

    def _outer(self, pids: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Each launch's outer caller, from its call site's whole record."""
        rets = records["return_ip"]
        outer = np.zeros(len(records), np.uint64)
        if not rets.any():
            return outer            # driver launches: no callers read
        handles, inverse = np.unique(records["handle"], return_inverse=True)
        site_pid = np.zeros(len(handles), np.uint32)
        site_ret = np.zeros(len(handles), np.uint64)
        site_outer = np.zeros(len(handles), np.uint64)
        for i, handle in enumerate(handles.tolist()):
            site = self._by_handle.get(handle)
            if site is not None:
                site_pid[i], site_ret[i], site_outer[i] = site
        same = (site_pid[inverse] == pids) & (site_ret[inverse] == rets)
        outer[same] = site_outer[inverse][same]
        # Rare: a handle launched from two call sites or processes.
        for i in np.flatnonzero(~same & (rets != 0)).tolist():
            key = (int(pids[i]), int(records["handle"][i]), int(rets[i]))
            found = self._sites.get(key)
            if found is None:
                self.counters["outer_caller_unknown"] += 1
            else:
                outer[i] = found
        return outer
