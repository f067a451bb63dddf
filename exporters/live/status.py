"""The daemon's live state as one JSON-able snapshot, for `mmtrace top` (over
the hint socket's `status` request): per process doing GPU/NPU work, its
run-queue p99, launches/s, sync-wait p99 and memcpy rate over the last
seconds, where its launching threads' time went in the latest window (the
runnable share against the starvation detector's threshold) and the P99
detector's baseline and threshold of its run-queue delay; the active
anomalies, the latest hints, and what was lost.

Computed on request from the daemon's rings, so a daemon nobody asks pays
nothing for it."""

import numpy as np

from mmtrace.bpf import device as device_stream

MAX_PROCESSES = 32
MAX_ANOMALIES = 32
MAX_HINTS = 16
_LAUNCH_KINDS = [device_stream.KIND_IDS["launch"], device_stream.KIND_IDS["graph_launch"]]
_SYNC = device_stream.KIND_IDS["sync"]
_MEMCPY = device_stream.KIND_IDS["memcpy"]
# What the table reads of an aligned GPU/NPU record: a status request keeps
# these fields of each sealed block of its window (PackedRing.extracts), 52
# of the record's 248 bytes, and unpacks a block once while nothing the
# table reads changes in it, not at every ask.
DEVICE_FIELDS = ("ts_ns", "pid", "kind", "flags", "ret", "api", "duration_ns", "bytes", "comm")
DEVICE_ROWS = np.dtype([(f, device_stream.ALIGNED_EVENT.fields[f][0]) for f in DEVICE_FIELDS])


def device_rows(records: np.ndarray) -> np.ndarray:
    """The fields of `records` the table reads (a copy)."""
    out = np.empty(len(records), DEVICE_ROWS)
    for f in DEVICE_FIELDS:
        out[f] = records[f]
    return out


def process_table(runq: np.ndarray, device: np.ndarray, device_tids: np.ndarray,
                  span_s: float, names=None, launches_traced: bool = True,
                  infos: dict | None = None) -> list[dict]:
    """One row per process with device work in `device` (or with device
    threads in `runq`), busiest first. `runq` and `device` cover the last
    `span_s` seconds; `device_tids` are the threads known to do device work.
    `names(pid)` is the process's name where known (else its last event's
    thread name); with the per-launch probes off, launches_per_s is None:
    not measured, which is not zero. Failed calls count apart, per API and
    code (`infos`: the API table, to name them), not as work."""
    infos = infos if infos is not None else device_stream.default_infos()
    runq = runq[np.isin(runq["tid"], device_tids)] if len(runq) else runq
    pids = np.union1d(np.unique(device["pid"]), np.unique(runq["pid"])).tolist()
    rows = []
    for pid in pids:
        mine = device[device["pid"] == pid]
        waits = runq["delay_ns"][runq["pid"] == pid]
        failed = device_stream.failed(mine)
        bad, mine = mine[failed], mine[~failed]       # failed calls did no work
        syncs = mine[(mine["kind"] == _SYNC) & device_stream.returned(mine)]
        copies = mine[mine["kind"] == _MEMCPY]
        comm = (names(pid) if names else None) or _comm(mine) or _comm(bad) \
            or _comm(runq[runq["pid"] == pid])
        launches = float(np.isin(mine["kind"], _LAUNCH_KINDS).sum() / span_s)
        rows.append({
            "pid": int(pid), "comm": comm,
            "runq_p99_us": _p99(waits, 1e3), "runq_wakeups": int(len(waits)),
            "launches_per_s": launches if launches_traced else None,
            "sync_wait_p99_ms": _p99(syncs["duration_ns"], 1e6),
            "memcpy_gb_per_s": float(copies["bytes"].sum() / span_s / 1e9),
            "failed_per_s": float(len(bad) / span_s),
            "failed_calls": _failures(bad, infos),
        })
    rows.sort(key=lambda r: (r["launches_per_s"] or 0.0, r["runq_wakeups"]), reverse=True)
    return rows[:MAX_PROCESSES]


def with_launchers(rows: list[dict], launchers: dict, runq_levels: dict) -> list[dict]:
    """The process rows with, where measured (else None): `shares`, the
    latest closed window's time split of the launching threads (state ->
    share); `runnable_share`, `runnable_threshold` and `runnable_baseline`,
    the starvation detector's figures; `runq_p99_baseline_us` and
    `runq_p99_threshold_us`, the P99 detector's for the run-queue delay.
    `launchers`: pid -> LauncherTime.table()'s row; `runq_levels`: pid ->
    (baseline s, threshold s)."""
    for row in rows:
        launcher = launchers.get(row["pid"]) or {}
        shares = launcher.get("shares")
        base, limit = runq_levels.get(row["pid"], (None, None))
        row.update(shares=dict(shares) if shares else None,
                   runnable_share=shares.get("runnable") if shares else None,
                   runnable_threshold=launcher.get("threshold"),
                   runnable_baseline=launcher.get("baseline"),
                   runq_p99_baseline_us=None if base is None else base * 1e6,
                   runq_p99_threshold_us=None if limit is None else limit * 1e6)
    return rows


def active_anomalies(anomalies: list[dict]) -> list[dict]:
    """The latest record of each alarm (detector, series or kind, modality
    and the process its key names: two starved processes are two alarms),
    kept when it is not resolved: what is wrong now. Each names its process
    (pid, comm) where it is about one, and the verdict its evidence names."""
    latest = {}
    for a in anomalies:
        about = a.get("key") if isinstance(a.get("key"), dict) else {}
        pid = about.get("pid") if about.get("pid") is not None else a.get("pid")
        key = (a.get("detector"), a.get("series") or a.get("kind"), a.get("modality"), pid)
        latest[key] = a
    out = []
    for (detector, what, modality, pid), a in latest.items():
        if a.get("state") in ("resolved", "normal", "cleared"):
            continue
        ev = a.get("evidence") if isinstance(a.get("evidence"), dict) else {}
        out.append({"detector": detector, "what": what, "modality": modality,
                    "state": a.get("state"), "ts_ns": a.get("ts_ns"),
                    "pid": pid, "comm": a.get("comm"), "verdict": ev.get("verdict"),
                    "p99": ev.get("p99"), "baseline": ev.get("baseline"),
                    "share": ev.get("share"), "threshold": ev.get("threshold"),
                    "part": ev.get("part"),
                    "flight_recording": a.get("flight_recording")})
    return out[-MAX_ANOMALIES:]


def _failures(bad: np.ndarray, infos: dict) -> list[dict]:
    """A process's failed calls per (API, code), most first."""
    if not len(bad):
        return []
    _, first, calls = np.unique(device_stream.api_code_keys(bad["api"], bad["ret"]),
                                return_index=True, return_counts=True)
    pairs = sorted(zip(calls.tolist(), bad["api"][first].tolist(), bad["ret"][first].tolist()),
                   key=lambda p: (-p[0], p[1], p[2]))      # most first, then by API and code
    return [{"api": infos[a].api if a in infos else str(a),
             "error": device_stream.error_text(infos.get(a), code), "count": int(n)}
            for n, a, code in pairs]


def _p99(values: np.ndarray, unit: float) -> float | None:
    return float(np.percentile(values, 99) / unit) if len(values) else None


def _comm(rows: np.ndarray) -> str | None:
    if not len(rows):
        return None
    return bytes(rows["comm"][-1]).rstrip(b"\0").decode("utf-8", "replace") or None
