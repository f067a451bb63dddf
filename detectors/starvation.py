"""Starved launchers, live: per process, the share of its launching threads'
wall time spent runnable but waiting for a CPU, one window at a time; and
the same watch on the other parts of that time (in device syncs, in
synchronous copies, on the CPU, asleep), each with its own kind.

P99 of run-queue delay misses starvation: the scheduler caps each wait near
a time slice, so p99 hardly moves while the time spent waiting triples. The
share of time does not saturate. A window is starved when its share is at
least the threshold:

    threshold = min(alarm_share, max(baseline * rise_factor, baseline + rise_share,
                                     noise + rise_share))

where the baseline is the median share of the process's last
`baseline_windows` windows that were not starved, capped at `baseline_cap`,
and the noise the `noise_quantile` of those windows, capped likewise. A
launcher's own seconds spread: alone on a virtual machine, one that
sleeps between 2 ms steps waits 15 % of a median second and 24 % of one
second in ten, so a threshold drawn from the median alone (about 0.25)
was crossed twice in a row within minutes, with nothing on the host;
the noise term keeps the threshold above the seconds the launcher
itself makes.
So a quiet launcher fires on a small rise (5 % -> 15 %), one that waits a
third of its time on a busy host fires when that grows by half, and no
baseline, however noisy the host, raises the threshold past `alarm_share`
(half the time waiting): nothing can blind the detector. Waking from a
sleep costs time on the run queue too: a launcher that sleeps a
millisecond between steps waited 10-13 % of its time on an otherwise idle
virtual machine (the CPU's wake from idle, its softirqs and kworkers
first), and 20-25 % in some seconds beside a compile job and disk
writes. A fixed level under that (`starved_share`, which makes the
verdict in explain) fired every few minutes on such a host while it was
busy. `consecutive` starved windows in a row fire (3 by default, as the
other detectors count: in two 30-minute runs of bench_detection, each
with one false alarm at two windows, the one listed was a quiet launcher
at 41 % beside nice-0 disk writes, while hogs starved the launchers
50-70 % for as long as they ran); `clear_windows` windows that are not
resolve. A window in which the threads lived less
than half the time is neutral.

The other parts are watched by the same rule without a level: a rise past
the process's own baseline fires (detectors/diagnosis.rise_level: by
`rise_factor`, or the rest of the time shrinking by it), since a
well-fed server spends most of its time in syncs and an idle one asleep.
A share is an average over every call of a window, so it stays steady
where a latency's p99 swings with a busy host's noise.
"""

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from mmtrace.detectors.diagnosis import rise_level


def sorted_median(ordered: list[float]) -> float:
    """np.median of these values (sorted, at least one), to the bit for
    the finite shares a watch holds (numpy's -0.0 and inf cases aside): a
    closing window asks each launcher's baselines of every watch, and
    numpy's set-up cost 15-20 us a call for a few dozen values (a
    millisecond a second on a host of ten launchers)."""
    if any(v != v for v in ordered):        # NaN: numpy's answer, whatever the order
        return float(np.median(ordered))
    n = len(ordered)
    middle = n // 2
    return ordered[middle] if n % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def sorted_quantile(ordered: list[float], q: float) -> float:
    """np.quantile(values, q) (the default, linear method) of these values
    (sorted, at least one), as numpy interpolates: to the bit for finite
    values (numpy gives NaN where it interpolates inf - inf)."""
    if any(v != v for v in ordered):
        return float(np.quantile(ordered, q))
    n = len(ordered)
    at = (n - 1) * q
    if at >= n - 1:
        return ordered[-1]
    low = max(math.floor(at), 0)
    a, b = ordered[low], ordered[low + 1]
    gamma = at - low
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


@dataclass
class _State:
    comm: str = ""
    shares: deque = field(default_factory=deque)     # normal windows' shares
    median: float | None = None     # of the shares, until they change (asked each window)
    noise: float | None = None      # their noise_quantile, likewise
    run: int = 0            # starved windows in a row
    calm: int = 0           # windows in a row that were not, while firing
    firing: bool = False
    last: dict = field(default_factory=dict)          # the latest window's figures


# part of the time -> (the anomaly's detector, its kind)
WATCHED = {"runnable": ("starvation", "cpu_starved"),
           "sync": ("time_share", "device_bound"),
           "copy": ("time_share", "bus_bound"),
           "on_cpu": ("time_share", "host_bound"),
           "blocked": ("time_share", "blocked")}


class Starvation:
    def __init__(self, window_s: float = 1.0, level: float | None = 0.5,
                 rise_factor: float = 1.5, rise_share: float = 0.1, consecutive: int = 3,
                 clear_windows: int = 3, baseline_windows: int = 60,
                 baseline_cap: float = 0.35, max_processes: int = 4096,
                 state: str = "runnable", noise_quantile: float | None = None):
        """`level`: the part's level (None: only a rise fires);
        `noise_quantile`: the quantile of the normal windows the threshold
        stays rise_share above (None: the median's rule alone)."""
        self.noise_quantile = noise_quantile
        self.part = state
        self.detector, self.kind = WATCHED[state]
        self.window_ns = int(window_s * 1e9)
        self.level = level
        self.rise_factor, self.rise_share = rise_factor, rise_share
        self.consecutive, self.clear_windows = consecutive, clear_windows
        self.baseline_windows, self.baseline_cap = baseline_windows, baseline_cap
        self.max_processes = max_processes
        self.states: dict[int, _State] = {}

    @classmethod
    def of(cls, d, state: str = "runnable") -> "Starvation":
        """The watch on one part of the time, from the daemon's [diagnosis]
        settings. Only waiting for a CPU has a level live: a server that
        spends 60 % of its time in syncs is well fed, and one on the CPU
        80 % may be built so; their watches fire on a rise alone."""
        level = d.alarm_share if state == "runnable" else None
        cap = d.baseline_cap if state == "runnable" else 1.0
        noise = d.noise_quantile if state == "runnable" and d.noise_quantile > 0 else None
        return cls(window_s=d.window_s, level=level,
                   rise_factor=d.rise_factor, rise_share=d.rise_share,
                   consecutive=d.consecutive, clear_windows=d.clear_windows,
                   baseline_windows=d.baseline_windows, baseline_cap=cap, state=state,
                   noise_quantile=noise)

    def baseline(self, pid: int) -> float | None:
        state = self.states.get(pid)
        if state is None or not state.shares:
            return None
        if state.median is None:
            state.median = sorted_median(sorted(state.shares))
        return min(state.median, self.baseline_cap)

    def noise(self, pid: int) -> float | None:
        """The noise_quantile of the normal windows, capped as the baseline."""
        state = self.states.get(pid)
        if self.noise_quantile is None or state is None or not state.shares:
            return None
        if state.noise is None:
            state.noise = sorted_quantile(sorted(state.shares), self.noise_quantile)
        return min(state.noise, self.baseline_cap)

    def threshold(self, pid: int) -> float | None:
        """None: nothing fires yet (a part with no level, before its baseline)."""
        base = self.baseline(pid)
        level = self.level
        if base is None:
            return level
        rise = rise_level(base, self.rise_factor, self.rise_share)
        noise = self.noise(pid)
        if noise is not None:
            rise = max(rise, noise + self.rise_share)
        return rise if level is None else min(level, rise)

    def disturbed(self, pid: int, share: float) -> bool:
        """This window of the process is no normal one for this part: over
        its threshold, or while its alarm fires."""
        state = self.states.get(pid)
        threshold = self.threshold(pid)
        return (state is not None and (state.firing or state.run > 0)) or \
            (threshold is not None and share >= threshold)

    def observe(self, end_ns: int, windows: dict, disturbed=frozenset()) -> list[dict]:
        """One closed window ending at end_ns: pid -> (runnable share, the
        share of the window its threads lived, comm). Returns anomalies.
        A firing process that made no call in the window has stopped
        launching: that window is calm for it. A process in `disturbed`
        (another part of its time is out of the ordinary now) does not
        teach this part's baseline: a starved launcher spends less time on
        its CPU, and that is not its usual."""
        out = []
        idle = {pid: (0.0, 1.0, state.comm) for pid, state in self.states.items()
                if state.firing and pid not in windows}
        for pid, (share, lived, comm) in {**windows, **idle}.items():
            state = self.states.get(pid)
            if state is None:
                if len(self.states) >= self.max_processes:
                    continue
                state = self.states[pid] = _State()
            state.comm = comm
            if lived < 0.5:
                continue
            threshold, base = self.threshold(pid), self.baseline(pid)
            starved = threshold is not None and share >= threshold
            state.last = {"share": round(share, 4),
                          "threshold": None if threshold is None else round(threshold, 4),
                          "baseline": None if base is None else round(base, 4),
                          "end_ns": int(end_ns)}
            if starved:
                state.run += 1
                state.calm = 0
                if not state.firing and state.run >= self.consecutive:
                    state.firing = True
                    out.append(self._record(pid, state, "firing", end_ns))
                continue
            state.run = 0
            if pid not in disturbed:
                state.shares.append(share)
                state.median = state.noise = None
                while len(state.shares) > self.baseline_windows:
                    state.shares.popleft()
            if state.firing:
                state.calm += 1
                if state.calm >= self.clear_windows:
                    state.firing = False
                    out.append(self._record(pid, state, "resolved", end_ns))
        return out

    def _record(self, pid: int, state: _State, what: str, end_ns: int) -> dict:
        return {"detector": self.detector, "kind": self.kind, "state": what,
                "ts_ns": int(end_ns), "pid": pid, "comm": state.comm,
                "key": {"kind": f"{'runq' if self.part == 'runnable' else self.part}_share",
                        "pid": pid},
                "evidence": {**state.last, "part": self.part, "windows": state.run,
                             "window_s": self.window_ns / 1e9}}

    def forget(self, pids):
        for pid in pids:
            self.states.pop(pid, None)

    def table(self) -> list[dict]:
        """Per process: its latest share, baseline and threshold (top, metrics)."""
        return [{"pid": pid, "comm": s.comm, "firing": s.firing, **s.last}
                for pid, s in self.states.items() if s.last]
