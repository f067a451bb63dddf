"""`mmtrace explain`: the diagnosis (detectors/diagnosis.py) of a recording,
or of what the live daemon holds, as the spec's JSON and as one screen of
text. A recording is replayed once; the time split is fed beside the
report's aggregates, so `report` carries the verdict table for little more."""

import numpy as np

from mmtrace.detectors.device_faults import fault_end, fault_start, faults
from mmtrace.detectors.device_faults import merge as merge_faults
from mmtrace.detectors.diagnosis import DiagnosisRules, diagnose
from mmtrace.bpf import device as device_stream
from mmtrace.detectors.time_split import CULPRIT_FLOOR_NS, DeviceRoles, TimeSplit

from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.recording.device_view import DeviceContext
from mmtrace.agent.recording.wall_clock import WallClock

VERDICT_WINDOW_NS = 5_000_000_000      # what an anomaly's verdict is read over
MAX_HOLDERS = 1 << 16                  # threads named as holders of a launcher's CPU
TIMELINE_MAX_SLICES = 60


def device_roles(infos: dict) -> DeviceRoles:
    """What the time split reads of the device stream, from the API table
    the events were recorded with (ApiInfo by id)."""
    size = max(infos, default=0) + 2           # the last: any id the table lacks
    blocking, npu = np.zeros(size, bool), np.zeros(size, bool)
    for api_id, info in infos.items():
        blocking[api_id] = info.blocking
        npu[api_id] = info.stream == "npu"
    kinds = device_stream.KIND_IDS
    return DeviceRoles(kinds["sync"], kinds["memcpy"],
                       device_stream.id_table(kinds[k] for k in device_stream.SUBMISSION_KINDS),
                       device_stream.id_table(kinds[k] for k in device_stream.EXPORTED_KINDS),
                       device_stream.FLAG_RETURNED, blocking, npu)


class DiagnosisReplay:
    """The time split of a recording, fed step by step from its replay: the
    switch-ins of the threads that made GPU/NPU calls (`submitters`, known
    from a first look at the device events alone) and of the processes
    asked for; and the names of the threads that held their CPUs, from
    those threads' own switch-ins (naming every thread of a busy host
    cost a sixth of the report)."""

    def __init__(self, rec, submitters: ls.Submitters | None = None, pids=()):
        self.split = TimeSplit(device_roles(DeviceContext.from_meta(rec.meta).infos))
        self.last_entropy_ns: int | None = None     # an entropy shift lasts no longer
        if submitters is None:
            submitters = ls.Submitters()
            for pieces in rec.pieces("dev.event"):
                submitters.learn(pieces)
        self.submitters = submitters
        self.pids = np.array(sorted(pids or ()), np.int64)
        self.holders = np.zeros(0, np.int64)        # sorted: threads a launcher waited behind
        self.unnamed = np.zeros(0, np.int64)        # sorted: those no switch-in has named yet

    def feed(self, step):
        entropy = step.part("model.entropy")
        if entropy is not None:
            self.last_entropy_ns = max(self.last_entropy_ns or 0, int(entropy["ts_ns"].max()))
        runq = step.part("cpu.runq")
        if runq is not None:
            mine = self.submitters.mask(runq["tid"])
            if len(self.pids):
                mine |= np.isin(runq["pid"], self.pids)
            launchers = runq[mine]
            self.split.add_runq(launchers)
            behind = launchers["prev_tid"][launchers["delay_ns"] >= CULPRIT_FLOOR_NS]
            if len(behind) and len(self.holders) < MAX_HOLDERS:
                new = np.setdiff1d(behind.astype(np.int64), self.holders)
                if len(new):
                    self.holders = np.union1d(self.holders, new)
                    self.unnamed = np.union1d(self.unnamed, new)
            if len(self.unnamed):
                # A holder is named by its first switch-in after it was
                # seen holding a CPU (and keeps that name): once every
                # holder has one, the host's other threads cost nothing.
                at = np.minimum(np.searchsorted(self.unnamed, runq["tid"]),
                                len(self.unnamed) - 1)
                found = runq[self.unnamed[at] == runq["tid"]]
                if len(found):
                    self.split.names.learn(found)
                    self.unnamed = np.setdiff1d(self.unnamed, found["tid"].astype(np.int64),
                                                assume_unique=False)
        rows = step.device_rows()
        if rows is not None:
            self.split.add_device(rows.events)


def entropy_windows(anomalies: list[dict], end_ns: int) -> list[tuple[int, int]]:
    """The stretches an attention-entropy alarm was firing: to its
    resolution, or to `end_ns` (the last sample: once the model reports no
    more, nothing says its inputs are still shifted)."""
    open_at, out = {}, []
    for a in sorted(anomalies, key=lambda a: a.get("ts_ns", 0)):
        if a.get("detector") != "attention_entropy":
            continue
        key = (a.get("kind"), a.get("modality"))
        if a.get("state") == "firing":
            open_at.setdefault(key, int(a.get("ts_ns", 0)))
        elif key in open_at:
            out.append((open_at.pop(key), int(a.get("ts_ns", 0))))
    out += [(start, end_ns) for start in open_at.values()]
    return out


def symptoms(anomalies: list[dict]) -> dict[int, str]:
    """pid -> the first P99 alarm on one of its series, as a chain's first link."""
    out = {}
    for a in anomalies:
        pid = (a.get("key") or {}).get("pid") if isinstance(a.get("key"), dict) else None
        if a.get("state") == "firing" and isinstance(pid, int) and pid not in out:
            ev = a.get("evidence") or {}
            if ev.get("p99") is not None and ev.get("baseline"):
                out[pid] = (f"{a.get('series')}: p99 {ev['p99'] * 1e3:.2f} ms against a baseline "
                            f"of {ev['baseline'] * 1e3:.2f} ms ({ev['p99'] / ev['baseline']:.1f}x)")
    return out


def anomaly_verdict(split: TimeSplit, anomaly: dict, rules: DiagnosisRules,
                    now_ns: int | None = None):
    """A firing anomaly about a process: its evidence names the process's
    verdict over the seconds before it (and the culprits, if starved)."""
    pid = (anomaly.get("key") or {}).get("pid")
    if anomaly.get("state") != "firing" or not isinstance(pid, int) or split.first_ns is None:
        return
    end = now_ns if now_ns is not None else int(anomaly.get("ts_ns") or split.last_ns)
    answer = diagnose(split, end - VERDICT_WINDOW_NS, end, rules, [pid])
    for p in answer["processes"]:
        if p["pid"] == pid:
            evidence = anomaly.setdefault("evidence", {})
            evidence.update(verdict=p["verdict"], shares=p["shares"],
                            causes=[c["verdict"] for c in p["causes"]])
            if p["culprits"]:
                evidence["culprits"] = p["culprits"]


def explain_split(split: TimeSplit, window=None, pids=None, anomalies=(),
                  rules: DiagnosisRules | None = None, clock: WallClock | None = None,
                  timeline_s: float | None = None, entropy_until_ns: int | None = None) -> dict:
    """The diagnosis of `split` over `window` (default: all it holds), with
    wall-clock stamps and, per process, a timeline of verdicts.
    `entropy_until_ns`: the last attention-entropy sample."""
    rules = rules or DiagnosisRules()
    clock = clock or WallClock(None)
    anomalies = list(anomalies)
    if split.first_ns is None:
        if not fault_end(anomalies):
            return {"processes": [], "window": None, "reference": None,
                    "note": "no run-queue or GPU/NPU events to explain"}
        return _faults_only(anomalies, window or (fault_start(anomalies),
                                                  fault_end(anomalies) + 1), pids, clock)
    # By default, up to the last hang or leak too: a stuck thread leaves no events.
    start, end = window or (split.first_ns, max(split.last_ns, fault_end(anomalies)) + 1)
    held = {"start_ns": int(split.first_ns), "end_ns": int(split.last_ns)}
    if end <= split.first_ns or start > split.last_ns:
        if faults(anomalies, start, end):
            return _faults_only(anomalies, (start, end), pids, clock, held)
        raise MmtraceError(f"--window {start / 1e9:.3f}:{end / 1e9:.3f} s is outside what "
                           f"there is to explain: {held['start_ns'] / 1e9:.3f} .. "
                           f"{held['end_ns'] / 1e9:.3f} s")
    shifted = entropy_windows(anomalies, entropy_until_ns or split.last_ns)
    answer = merge_faults(diagnose(split, start, end, rules, pids, shifted, symptoms(anomalies)),
                          anomalies, pids)
    answer["held"] = held
    missing = sorted(set(pids or ()) - {p["pid"] for p in answer["processes"]})
    if missing:
        raise MmtraceError(f"--pid {', '.join(map(str, missing))}: no GPU/NPU call or "
                           f"switch-in of {'that process' if len(missing) == 1 else 'those'} "
                           f"in {start / 1e9:.3f} .. {end / 1e9:.3f} s")
    answer["window"].update(started=clock.stamp(start), ended=clock.stamp(end))
    if answer["reference"]:
        ref = answer["reference"]
        ref.update(started=clock.stamp(ref["start_ns"]), ended=clock.stamp(ref["end_ns"]))
    if timeline_s and answer["processes"]:
        step = max(int(timeline_s * 1e9), split.slice_ns)
        lo, hi = max(start, split.first_ns), min(end, split.last_ns + 1)
        step = max(step, -(-(hi - lo) // TIMELINE_MAX_SLICES))
        pids_here = [p["pid"] for p in answer["processes"]]
        by_pid = {pid: [] for pid in pids_here}
        for s in range(lo, hi, step):
            part = diagnose(split, s, min(hi, s + step), rules, pids_here, shifted)
            for p in part["processes"]:
                by_pid[p["pid"]].append({"start_ns": s, "end_ns": min(hi, s + step),
                                         "wall_time": clock.stamp(s),
                                         "verdict": p["verdict"], "shares": p["shares"]})
        for p in answer["processes"]:
            p["timeline"] = by_pid[p["pid"]]
    return answer


def _faults_only(anomalies, window, pids, clock: WallClock, held=None) -> dict:
    """The answer where no events fall in the window, but hangs or leaks
    do: a stuck thread and a leak leave no events to split."""
    start, end = window
    answer = {"processes": [], "reference": None, "held": held,
              "note": "no run-queue or GPU/NPU events in the window: the verdicts are the "
                      "hangs' and leaks' alone",
              "window": {"start_ns": int(start), "end_ns": int(end),
                         "started": clock.stamp(start), "ended": clock.stamp(end)}}
    return merge_faults(answer, anomalies, pids)


def with_recorded_faults(rec, found: list[dict]) -> list[dict]:
    """The detectors' anomalies, and the hang or leak that made a flight
    recording when the replay does not find it again: the daemon saw it
    (a leak measured from before the recording's reach, a hang it read in
    flight)."""
    from mmtrace.exporters.files.perfetto_anomalies import recorded_anomalies
    known = {(a.get("detector"), a.get("series")) for a in found if a.get("state") == "firing"}
    return found + [a for a in recorded_anomalies(rec)
                    if a.get("detector") in ("device_hang", "memory_leak")
                    and a.get("state") == "firing"
                    and (a.get("detector"), a.get("series")) not in known]


def explain_recording(rec, window=None, pids=None, rules=None, timeline_s: float = 5.0) -> dict:
    """One replay of `rec`: its time split and its detectors' anomalies."""
    from mmtrace.agent.recording.offline_detectors import Detectors, settings_of
    from mmtrace.agent.recording.replay import replay
    rules = rules or DiagnosisRules.of(settings_of(rec).diagnosis)
    detectors = Detectors(rec)
    diagnosis = DiagnosisReplay(rec, detectors.p99.submitters, pids or ())
    for step in replay(rec):
        diagnosis.feed(step)
        detectors.feed(step)
    answer = explain_split(diagnosis.split, window, pids, with_recorded_faults(rec, detectors.finish()),
                           rules, WallClock.of(rec), timeline_s, diagnosis.last_entropy_ns)
    answer["file"] = str(rec.path)
    return answer
