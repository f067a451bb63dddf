"""The detectors over a recording: the same series and rules as the daemon,
replayed in time order. `mmtrace report` lists what they find."""

import numpy as np

from mmtrace.detectors.entropy_drift import EntropyDriftDetector
from mmtrace.detectors.p99_drift import P99Drift

from . import latency_series as ls
from .align import ApiRoles, align
from .config import DaemonConfig, EntropySettings, P99Settings
from .device_view import DeviceContext
from .recording import Recording


def settings_of(rec: Recording) -> DaemonConfig:
    """A flight recording carries the daemon's settings; others get defaults."""
    cfg = DaemonConfig()
    for doc in rec.meta:
        conf = doc.get("config")
        if isinstance(conf, dict):
            try:
                cfg.p99 = P99Settings(**conf.get("p99", {}))
                cfg.entropy = EntropySettings(**conf.get("entropy", {}))
            except TypeError:
                pass     # written by another version: defaults
    return cfg


def p99_anomalies(rec: Recording, settings: P99Settings) -> list[dict]:
    p = settings
    detector = P99Drift(window_s=p.window_s, baseline_windows=p.baseline_windows,
                        min_baseline_windows=p.min_baseline_windows, factor=p.factor,
                        floor=p.floor_s, consecutive=p.consecutive, min_samples=p.min_samples,
                        clear_factor=p.clear_factor, clear_windows=p.clear_windows)
    sid = detector.series_id
    parts = []
    device = rec.events.get("dev.event")
    submitters = ls.Submitters()
    if device is not None and len(device):
        infos = DeviceContext.from_meta(rec.meta).infos
        aligned = align(device, ApiRoles.from_infos(infos))
        submitters.learn(device)
        parts += [ls.sync_series(sid, aligned), ls.retire_series(sid, aligned)]
    runq = rec.events.get("cpu.runq")
    if runq is not None and len(runq):
        parts.append(ls.runq_series(sid, runq, submitters))
    requests = rec.events.get("request.latency")
    if requests is not None and len(requests):
        names = _table(rec, "request_series")
        keys = np.array([sid(names[i]) if i < len(names) else sid(f"request_latency{{id={i}}}")
                         for i in requests["series"].tolist()], np.int64)
        parts.append(ls.Series(keys, requests["ts_ns"].astype(np.int64), requests["value_s"],
                               np.zeros(len(keys), np.int64)))
    series = ls.concat(parts)
    if not len(series):
        return []
    order = np.argsort(series.ts_ns, kind="stable")
    found = []
    # Replay in slices of one window, so windows close as they would live.
    window_ns = int(p.window_s * 1e9)
    ts = series.ts_ns[order]
    edges = np.searchsorted(ts, np.arange(ts[0], ts[-1] + window_ns, window_ns))
    for lo, hi in zip(edges[:-1], np.append(edges[1:-1], len(ts))):
        if hi > lo:
            idx = order[lo:hi]
            found += detector.observe(series.ids[idx], series.ts_ns[idx], series.values_s[idx],
                                      series.contributors[idx])
    found += detector.advance(int(ts[-1]) + (p.consecutive + 2) * window_ns)
    return found


def entropy_anomalies(rec: Recording, settings: EntropySettings) -> list[dict]:
    samples = rec.events.get("model.entropy")
    if samples is None or not len(samples):
        return []
    layers, modalities = _table(rec, "entropy_layers"), _table(rec, "modalities")
    detector = EntropyDriftDetector(tau=settings.tau, consecutive=settings.consecutive,
                                    delta_sigma=settings.delta_sigma)
    found = []
    ordered = samples[np.argsort(samples["ts_ns"], kind="stable")]
    stamps, starts = np.unique(ordered["ts_ns"], return_index=True)
    bounds = np.append(starts, len(ordered))
    for ts, lo, hi in zip(stamps.tolist(), bounds[:-1], bounds[1:]):
        batch = [{"layer": _at(layers, int(r["layer"])), "head": int(r["head"]),
                  "value": float(r["value"]), "modality": _at(modalities, int(r["modality"]))}
                 for r in ordered[lo:hi]]
        found += detector.update(batch, ts_ns=ts)
    return found


def detect(rec: Recording) -> list[dict]:
    cfg = settings_of(rec)
    found = p99_anomalies(rec, cfg.p99) + entropy_anomalies(rec, cfg.entropy)
    return sorted(found, key=lambda a: a.get("ts_ns", 0))


def _table(rec: Recording, key: str) -> list[str]:
    for doc in rec.meta:
        if isinstance(doc.get(key), list):
            return [str(x) for x in doc[key]]
    return []


def _at(table: list[str], i: int) -> str:
    return table[i] if i < len(table) else str(i)


