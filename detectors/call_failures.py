"""Storms of failed GPU/NPU calls: a process whose calls return error
codes at a rate no accident explains (a sticky CUDA error after a fault, a
missing driver, an allocation retried in a loop). Such calls do no work,
so every output counts them apart; this says when they became the story.

Per process, in windows of `window_s`: a window is bad when at least
`min_failures` of its calls failed and they were at least `min_share` of
them. `consecutive` bad windows fire; `clear_windows` windows that are not
bad (with or without calls) resolve it. Fed batches in time order: (pid,
ts_ns, failed, api name, error text) per call."""

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

DETECTOR = "call_failures"
TOP_ERRORS = 5
MAX_PROCESSES = 4096


@dataclass
class _Process:
    window: int = -1                # the window being counted
    calls: int = 0
    failed: int = 0
    errors: Counter = field(default_factory=Counter)    # (api, error) -> calls, this window
    bad_run: int = 0
    good_run: int = 0
    firing: bool = False
    storm: Counter = field(default_factory=Counter)     # (api, error) -> calls, while bad
    first_bad_ns: int = 0
    good_from: int = 0              # the first window of the good run


def _count_pairs(errors: Counter, bad: np.ndarray, keys: np.ndarray, api, error):
    """errors.update of the (api[i], error[i]) of the calls `bad`, from one
    key a call: the pairs are added in the order they first come, as a
    call-by-call update adds them (most_common breaks its ties so)."""
    _, first, counts = np.unique(keys, return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    for i, n in zip(bad[first[order]].tolist(), counts[order].tolist()):
        errors[(api[i], error[i])] += n


class CallFailures:
    def __init__(self, window_s: float = 1.0, min_failures: int = 10, min_share: float = 0.5,
                 consecutive: int = 3, clear_windows: int = 5,
                 max_processes: int = MAX_PROCESSES):
        if window_s <= 0 or min_failures < 1 or not 0 < min_share <= 1 or consecutive < 1 \
                or clear_windows < 1:
            raise ValueError(
                f"expected window_s > 0, min_failures >= 1, 0 < min_share <= 1, "
                f"consecutive >= 1 and clear_windows >= 1, got {window_s}, {min_failures}, "
                f"{min_share}, {consecutive}, {clear_windows}")
        self.window_ns = int(window_s * 1e9)
        self.min_failures, self.min_share = min_failures, min_share
        self.consecutive, self.clear_windows = consecutive, clear_windows
        self.max_processes = max_processes
        self.processes: dict[int, _Process] = {}
        self.skipped = 0        # calls of processes past max_processes

    def feed(self, pid: np.ndarray, ts_ns: np.ndarray, failed: np.ndarray, api, error,
             pairs: np.ndarray | None = None) -> list:
        """Calls of one batch (time order); the anomalies their windows say.
        `pairs` (optional): an integer per call, equal where its (api,
        error) is: the failed calls are then counted per pair with numpy,
        and their names looked at once per pair, not once per call."""
        out = []
        if not len(pid):
            return out
        window = (np.asarray(ts_ns, np.int64) // self.window_ns)
        failed = np.asarray(failed, bool)
        pids = np.asarray(pid).astype(np.int64)
        for p in np.unique(pids).tolist():
            mine = np.flatnonzero(pids == p)
            proc = self.processes.get(p)
            if proc is None:
                if len(self.processes) >= self.max_processes:
                    self.skipped += len(mine)
                    continue
                proc = self.processes[p] = _Process()
            w = window[mine]
            for win in np.unique(w).tolist():
                at = mine[w == win]
                if win != proc.window:
                    out += self._close(p, proc, win)
                proc.calls += len(at)
                bad = at[failed[at]]
                proc.failed += len(bad)
                if pairs is None:
                    bad_calls = bad.tolist()        # looked up by map's C loop
                    proc.errors.update(zip(map(api.__getitem__, bad_calls),
                                           map(error.__getitem__, bad_calls)))
                elif len(bad):
                    _count_pairs(proc.errors, bad, np.asarray(pairs)[bad], api, error)
        return out

    def tick(self, now_ns: int) -> list:
        """Close the windows that time has passed (a process gone quiet)."""
        out = []
        current = int(now_ns) // self.window_ns
        for p, proc in list(self.processes.items()):
            if proc.window < current:
                out += self._close(p, proc, current)
            if not proc.firing and not proc.bad_run and proc.calls == 0:
                del self.processes[p]       # nothing pending: forget it
        return out

    def _close(self, pid: int, proc: _Process, next_window: int) -> list:
        """End the window being counted, and the empty ones (good ones) up
        to `next_window`; open `next_window`."""
        out = []
        if proc.window >= 0:
            if proc.failed >= self.min_failures and proc.failed >= self.min_share * proc.calls:
                out += self._bad(pid, proc)
            else:
                out += self._good(pid, proc, proc.window, 1)
            empty = next_window - proc.window - 1
            if empty > 0:
                out += self._good(pid, proc, proc.window + 1, empty)
        proc.window, proc.calls, proc.failed = next_window, 0, 0
        proc.errors = Counter()
        return out

    def _bad(self, pid: int, proc: _Process) -> list:
        if not proc.bad_run:
            proc.first_bad_ns = proc.window * self.window_ns
        proc.bad_run += 1
        proc.good_run = 0
        proc.storm.update(proc.errors)
        if proc.firing or proc.bad_run < self.consecutive:
            return []
        proc.firing = True
        return [self._anomaly(pid, proc, "firing", (proc.window + 1) * self.window_ns)]

    def _good(self, pid: int, proc: _Process, first: int, windows: int) -> list:
        """`windows` good windows from window `first` on."""
        if not proc.good_run:
            proc.good_from = first
        proc.good_run += windows
        proc.bad_run = 0
        if not proc.firing:
            proc.storm.clear()
            return []
        if proc.good_run < self.clear_windows:
            return []
        proc.firing = False
        found = self._anomaly(pid, proc, "resolved",
                              (proc.good_from + self.clear_windows) * self.window_ns)
        proc.storm.clear()
        return [found]

    def _anomaly(self, pid: int, proc: _Process, state: str, ts_ns: int) -> dict:
        top = [{"api": a, "error": e, "count": int(n)}
               for (a, e), n in proc.storm.most_common(TOP_ERRORS)]
        return {"detector": DETECTOR, "series": f"failed_calls{{pid={pid}}}", "state": state,
                "ts_ns": int(ts_ns),
                "evidence": {"pid": pid, "since_ns": int(proc.first_bad_ns),
                             "failed": int(sum(proc.storm.values())), "errors": top,
                             "min_failures": self.min_failures, "min_share": self.min_share,
                             "window_s": self.window_ns / 1e9}}
