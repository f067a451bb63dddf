"""The detectors over a recording: the same series and rules as the daemon,
replayed in time order, one step of the replay at a time (agent/recording/replay.py),
in memory that does not grow with the recording. `mmtrace report` lists
what they find."""

import numpy as np

from mmtrace.detectors.call_failures import CallFailures
from mmtrace.detectors.entropy_drift import EntropyDriftDetector
from mmtrace.detectors.p99_drift import P99Drift

from mmtrace.agent.ingest import latency_series as ls
from mmtrace.agent.config.settings import (DaemonConfig, EntropySettings, FailureSettings,
                                          P99Settings, build)
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.recording.memory_replay import MemoryReplay
from mmtrace.agent.recording.replay import Step, replay
from mmtrace.agent.recording.report_telemetry import latest_list, latest_table, name_at
from mmtrace.agent.ingest.series_keys import SeriesKey

# A recording naming more (crafted pids, layers) gets the first ones: the
# detectors' state is per series, about 23 KiB for a latency series.
MAX_SERIES = 1024
MAX_ENTROPY_KEYS = 4096


def settings_of(rec) -> DaemonConfig:
    """A flight recording carries the daemon's settings; others get
    defaults. The detectors' sections are checked by the configuration's own
    rules: a file written by another version, or crafted, falls back to the
    defaults rather than feeding a detector a string or a negative window."""
    for doc in rec.meta:
        conf = doc.get("config")
        if isinstance(conf, dict):
            sections = {name: conf[name] for name in DETECTOR_SECTIONS
                        if isinstance(conf.get(name), dict)}
            try:
                return build(sections)
            except MmtraceError:
                return DaemonConfig()
    return DaemonConfig()


DETECTOR_SECTIONS = ("p99", "entropy", "failures", "memory", "hangs", "diagnosis")


def _finite(series: ls.Series) -> ls.Series:
    keep = (series.ids >= 0) & np.isfinite(series.values_s) & (series.values_s >= 0)
    if keep.all():
        return series
    return ls.Series(series.ids[keep], series.ts_ns[keep], series.values_s[keep],
                     series.contributors[keep])


class P99Replay:
    """P99 drift of run-queue delay, sync waits, submit-to-retire latency and
    request latencies, fed step by step and replayed one window at a time,
    so that windows close as they would live."""

    def __init__(self, rec, settings: P99Settings):
        p = settings
        self.detector = P99Drift.of(p)
        self.window_ns = max(1, int(p.window_s * 1e9))
        self.consecutive = p.consecutive
        self.request_names = latest_table(rec, "request_series")
        self.request_keys = _keys(rec)
        self.keys: dict[str, dict] = {}     # series name -> what it is about
        self.submitters = ls.Submitters()
        for pieces in rec.pieces("dev.event"):      # threads that ever did device work
            self.submitters.learn(pieces)
        self.skipped_series = 0
        self._pending: list[ls.Series] = []
        self._start = None
        self._last_ts = None
        self.found: list[dict] = []

    def sid(self, key) -> int:
        """The detector's id of a SeriesKey (or a recorded series' name)."""
        name = str(key)
        if name not in self.detector._ids and len(self.detector._names) >= MAX_SERIES:
            self.skipped_series += 1
            return -1
        if isinstance(key, SeriesKey):
            self.keys.setdefault(name, key.as_dict())
        return self.detector.series_id(name)

    def _request_sid(self, i: int) -> int:
        names = self.request_names
        name = names[i] if i < len(names) else f"request_latency{{id={i}}}"
        if i < len(self.request_keys) and name not in self.keys:
            self.keys[name] = self.request_keys[i]
        return self.sid(name)

    def feed(self, step: Step):
        parts = []
        if step.device is not None and len(step.device):
            parts += [ls.sync_series(self.sid, step.device.events),
                      ls.retire_series(self.sid, step.device.events)]
        runq = step.records.get("cpu.runq")
        if runq is not None and len(runq):
            parts.append(ls.runq_series(self.sid, runq, self.submitters))
        requests = step.records.get("request.latency")
        if requests is not None and len(requests):
            keys = np.array([self._request_sid(i) for i in requests["series"].tolist()],
                            np.int64)
            parts.append(ls.Series(keys, requests["ts_ns"].astype(np.int64),
                                   requests["value_s"], np.zeros(len(keys), np.int64)))
        series = _finite(ls.concat(parts))
        if not len(series):
            return
        self._pending.append(series)
        if self._start is None:
            self._start = int(series.ts_ns.min())
        newest = int(series.ts_ns.max())
        self._last_ts = newest if self._last_ts is None else max(self._last_ts, newest)
        # Windows before the newest one are complete: nothing later lands in them.
        self._observe_before(self._start + (newest - self._start) // self.window_ns
                             * self.window_ns)

    def _observe_before(self, limit: int | None):
        series = ls.concat(self._pending)
        if not len(series):
            return
        order = np.argsort(series.ts_ns, kind="stable")
        ts = series.ts_ns[order]
        stop = len(ts) if limit is None else int(np.searchsorted(ts, limit))
        w = self.window_ns
        lo = 0
        while lo < stop:
            edge = self._start + ((int(ts[lo]) - self._start) // w + 1) * w
            hi = min(stop, int(np.searchsorted(ts, edge)))
            hi = max(hi, lo + 1)
            idx = order[lo:hi]
            self.found += self.detector.observe(series.ids[idx], series.ts_ns[idx],
                                                series.values_s[idx], series.contributors[idx])
            lo = hi
        rest = order[stop:]
        self._pending = [ls.Series(series.ids[rest], series.ts_ns[rest],
                                   series.values_s[rest], series.contributors[rest])]

    def finish(self) -> list[dict]:
        self._observe_before(None)
        if self._last_ts is not None:
            self.found += self.detector.advance(
                self._last_ts + (self.consecutive + 2) * self.window_ns)
        for anomaly in self.found:          # what each series is about, as the daemon says
            key = self.keys.get(anomaly.get("series"))
            if key:
                anomaly["key"] = dict(key)
        return self.found

    def baselines(self, limit: int = 20) -> list[dict]:
        """Each series' baseline and threshold at the end (None: never
        learnt), the highest thresholds first, at most `limit`."""
        rows = []
        for name in self.detector.names:
            snap = self.detector.snapshot(name)
            rows.append({"series": name, "state": snap["state"],
                         "baseline_s": snap["baseline"], "threshold_s": snap["threshold"],
                         "windows_needed": self.detector.min_baseline_windows})
        rows.sort(key=lambda r: -(r["threshold_s"] or 0.0))
        return rows[:limit]


class EntropyReplay:
    """Attention-entropy drift over the recorded samples, one round per stamp."""

    def __init__(self, rec, settings: EntropySettings):
        self.layers = latest_table(rec, "entropy_layers")
        self.modalities = latest_table(rec, "modalities")
        self.detector = EntropyDriftDetector(tau=settings.tau, consecutive=settings.consecutive,
                                             delta_sigma=settings.delta_sigma)
        self.found: list[dict] = []
        self.keys: set = set()
        self.skipped = 0

    def feed(self, step: Step):
        samples = step.records.get("model.entropy")
        if samples is None or not len(samples):
            return
        value = samples["value"]
        samples = samples[np.isfinite(value) & (value >= 0) & (value <= 1)]
        stamps, starts = np.unique(samples["ts_ns"], return_index=True)
        bounds = np.append(starts, len(samples))
        for ts, lo, hi in zip(stamps.tolist(), bounds[:-1], bounds[1:]):
            batch = [{"layer": name_at(self.layers, int(r["layer"])), "head": int(r["head"]),
                      "value": float(r["value"]),
                      "modality": name_at(self.modalities, int(r["modality"]))}
                     for r in samples[lo:hi] if self._known(r)]
            if batch:
                self.found += self.detector.update(batch, ts_ns=ts)

    def _known(self, sample) -> bool:
        key = (int(sample["layer"]), int(sample["head"]), int(sample["modality"]))
        if key not in self.keys and len(self.keys) >= MAX_ENTROPY_KEYS:
            self.skipped += 1
            return False
        self.keys.add(key)
        return True

    def finish(self) -> list[dict]:
        return self.found


class FailuresReplay:
    """Storms of failed calls (detectors/call_failures.py), as the daemon
    sees them: the decoded device rows of each step."""

    def __init__(self, settings: FailureSettings):
        f = settings
        self.detector = CallFailures(window_s=f.window_s, min_failures=f.min_failures,
                                     min_share=f.min_share, consecutive=f.consecutive,
                                     clear_windows=f.clear_windows)
        self.found: list[dict] = []
        self.last_ns = 0

    def feed(self, step: Step):
        rows = step.device_rows()
        if rows is None:
            return
        ev = rows.events
        # Counted per (api, error) key: a name and an error text looked at
        # once per key, not a Python step per call.
        self.found += self.detector.feed(ev["pid"], ev["ts_ns"], rows.failed, rows.api,
                                         rows.error, rows.failure_keys)
        self.last_ns = max(self.last_ns, int(ev["ts_ns"].max()))

    def finish(self) -> list[dict]:
        # The windows after the last call: a storm the recording ends in
        # stays firing; one that ended before the recording did resolves.
        return self.found + self.detector.tick(self.last_ns)


class Detectors:
    """Every detector over one replay: feed() each step, then finish()."""

    def __init__(self, rec):
        cfg = settings_of(rec)
        self.p99 = P99Replay(rec, cfg.p99)
        self.memory = MemoryReplay(rec, cfg)
        self.parts = [self.p99, EntropyReplay(rec, cfg.entropy), FailuresReplay(cfg.failures),
                      self.memory]

    def feed(self, step: Step):
        for part in self.parts:
            part.feed(step)

    def finish(self) -> list[dict]:
        found = [a for part in self.parts for a in part.finish()]
        return sorted(found, key=lambda a: a.get("ts_ns", 0))


def detect(rec) -> list[dict]:
    """Anomalies in a recording (a Recording or a RecordingReader)."""
    detectors = Detectors(rec)
    for step in replay(rec):
        detectors.feed(step)
    return detectors.finish()


def _keys(rec) -> list[dict]:
    """The request series' keys, in the order of their table."""
    return [k if isinstance(k, dict) else {} for k in latest_list(rec, "request_series_keys")]
