"""Thread -> process resolution for events whose process the kernel had not
learnt yet (threads that have not switched out since tracing began)."""

from pathlib import Path

import numpy as np


class ThreadProcesses:
    """Caches /proc/<tid>/status Tgid lookups; the /proc root is injectable."""

    def __init__(self, proc_root: Path = Path("/proc"), max_entries: int = 1 << 16):
        self.proc_root = Path(proc_root)
        self.max_entries = max_entries
        self._tgid: dict[int, int] = {}
        self.unresolved = 0

    def tgid(self, tid: int) -> int:
        cached = self._tgid.get(tid)
        if cached is not None:
            return cached
        tgid = 0
        try:
            with open(self.proc_root / str(tid) / "status") as status:
                for line in status:
                    if line.startswith("Tgid:"):
                        tgid = int(line.split()[1])
                        break
        except (OSError, ValueError):
            pass  # gone already, or unreadable: stays 0 (unknown)
        if len(self._tgid) >= self.max_entries:
            self._tgid.clear()
        self._tgid[tid] = tgid
        return tgid

    def fill(self, records: np.ndarray) -> dict[int, int]:
        """Fill pid == 0 in place, once per distinct thread of the batch.
        Returns what it learnt, for the kernel's map."""
        unknown = records["pid"] == 0
        if not unknown.any():
            return {}
        tids, inverse = np.unique(records["tid"][unknown], return_inverse=True)
        found = np.array([self.tgid(int(t)) for t in tids], dtype=records["pid"].dtype)
        records["pid"][unknown] = found[inverse]
        self.unresolved += int(np.count_nonzero(found[inverse] == 0))
        return {int(t): int(g) for t, g in zip(tids, found) if g}
