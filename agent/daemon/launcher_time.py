"""Where the launchers' time goes, live: the time split of every thread that
does GPU/NPU work (fed by the ingest path through Streams), the starvation
detector that reads it each closed window, the verdict a firing anomaly's
evidence names, and `mmtrace explain --pid` answered from the reach the
daemon holds (ring_seconds)."""

import time
from pathlib import Path

from mmtrace.detectors.diagnosis import DiagnosisRules, window_shares
from mmtrace.detectors.starvation import Starvation
from mmtrace.detectors.time_split import ThreadInfo, TimeSplit

from mmtrace.agent.config.settings import DiagnosisSettings
from mmtrace.agent.recording.explain import anomaly_verdict, device_roles, explain_split
from mmtrace.agent.recording.wall_clock import WallClock

GRACE_NS = 250_000_000          # a window closes this long after its end: its events are in
MAX_EXPLAIN_S = 3600.0


class LauncherTime:
    def __init__(self, settings: DiagnosisSettings, infos, reach_s: float,
                 proc_root: Path = Path("/proc"), clock=time.monotonic_ns):
        self.rules = DiagnosisRules.of(settings)
        self.starvation = Starvation.of(settings)
        # The other parts of the launchers' time, watched alike.
        self.watches = [self.starvation] + [Starvation.of(settings, part)
                                            for part in ("sync", "copy", "on_cpu", "blocked")]
        self.split = TimeSplit(device_roles(infos))
        self.split.resolve = self._from_proc
        self.reach_ns = int(reach_s * 1e9)
        self.window_ns = self.starvation.window_ns
        self.proc_root = proc_root
        self.clock = clock
        self.next_window_ns: int | None = None
        # pid -> its latest closed window with calls: time split and end (metrics, top).
        self.latest: dict[int, dict] = {}

    # ---------------------------------------------------------- intake

    def on_runq(self, submitters_runq):
        """The run-queue records of threads known to do GPU/NPU work."""
        if len(submitters_runq):
            self.split.add_runq(submitters_runq)

    def on_device(self, aligned):
        if len(aligned):
            self.split.add_device(aligned)

    # ------------------------------------------------------------ ticks

    def tick(self, now_ns: int) -> list[dict]:
        """Close the windows that ended a grace ago; the anomalies they raise,
        each with the verdict of its process over the last seconds."""
        if self.next_window_ns is None:
            self.next_window_ns = (now_ns // self.window_ns + 1) * self.window_ns
            return []
        found = []
        while self.next_window_ns + GRACE_NS <= now_ns:
            end = self.next_window_ns
            shares = window_shares(self.split, end - self.window_ns, end)
            # Each process's latest window in which it launched, for as long
            # as the daemon's reach: a launcher idle for a moment keeps its
            # figures (with their time), one idle longer drops out.
            self.latest.update({pid: {"comm": comm, "shares": split, "end_ns": end}
                                for pid, (split, _, comm) in shares.items()})
            for pid in [p for p, row in self.latest.items()
                        if row["end_ns"] < end - self.reach_ns]:
                del self.latest[pid]
            # A window out of the ordinary in any part teaches no part's baseline.
            disturbed = {pid for pid, (split, _, _) in shares.items()
                         if any(w.disturbed(pid, split[w.part]) for w in self.watches)}
            for watch in self.watches:
                found += watch.observe(end, {
                    pid: (split[watch.part], lived, comm)
                    for pid, (split, lived, comm) in shares.items()}, disturbed)
            self.next_window_ns += self.window_ns
            # The window's CPU holders, named while they still run.
            self.split.name_holders(end - self.window_ns)
        if found or self.split.first_ns is not None and \
                self.split.first_ns < now_ns - self.reach_ns - 2 * self.split.slice_ns:
            self.split.forget_before(now_ns - self.reach_ns)
        for anomaly in found:
            if anomaly["state"] == "firing":
                self.add_verdict(anomaly, now_ns)
        return found

    def add_verdict(self, anomaly: dict, now_ns: int | None = None):
        """The evidence of a firing anomaly about a process names its verdict
        (and the culprits, for a starved one), over the last seconds."""
        anomaly_verdict(self.split, anomaly, self.rules, now_ns or self.clock())

    # ---------------------------------------------------------- answers

    def explain(self, pids: list[int], window: tuple[int, int] | None, last_s: float,
                anomalies=(), entropy_until_ns: int | None = None) -> dict:
        """`mmtrace explain --pid`: the window asked for, or the last seconds;
        `anomalies`: the daemon's (an entropy shift, a P99 symptom)."""
        now = self.clock()
        if window is None:
            last_s = min(max(float(last_s), 1.0), MAX_EXPLAIN_S)
            window = (now - int(last_s * 1e9), now)
        return explain_split(self.split, window, pids, anomalies, self.rules, WallClock.now(),
                             timeline_s=None, entropy_until_ns=entropy_until_ns)

    def table(self) -> list[dict]:
        """Per process with launching threads: the latest closed window's
        time split, the starvation detector's share (of the latest window
        it judged: one its threads lived at least half of), and the
        threshold and baseline it holds now (the threshold is the default
        until a baseline is learnt, the baseline None), for top and the
        metrics."""
        rows = {r["pid"]: r for r in self.starvation.table()}
        out = []
        for pid, latest in self.latest.items():
            row = dict(rows.get(pid) or {"pid": pid, "comm": latest["comm"], "firing": False})
            row["shares"] = latest["shares"]
            base = self.starvation.baseline(pid)
            row["threshold"] = round(self.starvation.threshold(pid), 4)
            row["baseline"] = None if base is None else round(base, 4)
            out.append(row)
        return out

    def forget(self, pids):
        for watch in self.watches:
            watch.forget(pids)
        for pid in pids:
            self.latest.pop(pid, None)

    # ------------------------------------------------------------ /proc

    def _from_proc(self, tid: int) -> ThreadInfo | None:
        """A thread's process and name from /proc (a CPU holder no record named)."""
        try:
            status = (self.proc_root / str(tid) / "status").read_text(errors="replace")
        except OSError:
            return None
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        try:
            return ThreadInfo(int(fields["Tgid"].strip()), fields.get("Name", "?").strip())
        except (KeyError, ValueError):
            return None
