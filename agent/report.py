"""`mmtrace report`: a summary of one recording, as text or JSON."""

import numpy as np

from .offline import detect
from .recording import Recording
from .report_telemetry import telemetry_lines, telemetry_summary


def log2_buckets_us(delays_ns: np.ndarray) -> np.ndarray:
    """runqlat's bucket index per value: 0 for 0–1 µs, k for [2^k, 2^(k+1)) µs."""
    us = delays_ns // 1000
    _, exponent = np.frexp(np.maximum(us, 1).astype(np.float64))
    return np.where(us < 2, 0, exponent - 1).astype(np.int64)


def log2_hist(delays_ns: np.ndarray) -> list[dict]:
    if len(delays_ns) == 0:
        return []
    counts = np.bincount(log2_buckets_us(delays_ns))
    return [{"low_us": 0 if k == 0 else 1 << k, "high_us": (1 << (k + 1)) - 1,
             "count": int(c)} for k, c in enumerate(counts)]


def runq_summary(runq: np.ndarray) -> dict:
    delays = runq["delay_ns"] if len(runq) else np.empty(0, np.uint64)
    out = {"count": int(len(delays)), "p50_us": None, "p99_us": None, "max_us": None,
           "hist_log2_us": log2_hist(delays)}
    if len(delays):
        p50, p99 = np.percentile(delays, [50, 99])
        out.update(p50_us=round(float(p50) / 1e3, 3), p99_us=round(float(p99) / 1e3, 3),
                   max_us=round(float(delays.max()) / 1e3, 3))
    return out


def top_threads(runq: np.ndarray, limit: int = 10) -> list[dict]:
    """Threads with the largest total run-queue delay."""
    if len(runq) == 0:
        return []
    tids, inverse = np.unique(runq["tid"], return_inverse=True)
    total = np.bincount(inverse, weights=runq["delay_ns"].astype(np.float64))
    count = np.bincount(inverse)
    order = np.argsort(total)[::-1][:limit]
    # The thread's latest name: a process renames itself at exec.
    latest = np.zeros(len(tids), dtype=np.int64)
    np.maximum.at(latest, inverse, np.arange(len(runq)))
    out = []
    for i in order:
        row = runq[latest[i]]
        out.append({"pid": int(row["pid"]), "tid": int(tids[i]),
                    "comm": row["comm"].decode(errors="replace"),
                    "count": int(count[i]), "total_ms": round(float(total[i]) / 1e6, 3)})
    return out


def duration_s(rec: Recording) -> float:
    if rec.footer and "duration_s" in rec.footer:
        return float(rec.footer["duration_s"])
    stamps = [a["ts_ns"] for a in rec.events.values() if len(a)]
    if not stamps:
        return 0.0
    lo = min(int(s.min()) for s in stamps)
    hi = max(int(s.max()) for s in stamps)
    return (hi - lo) / 1e9


def lost_events(rec: Recording) -> int:
    if rec.footer and "lost_events" in rec.footer:
        return int(rec.footer["lost_events"])
    return 0


def device_rows(rec: Recording):
    events = rec.events.get("dev.event")
    if events is None or not len(events):
        return None
    from .device_view import DeviceContext, decode
    return decode(events, DeviceContext.from_meta(rec.meta))


def event_counts(rec: Recording, rows) -> dict[str, int]:
    """Events by "<stream>.<kind>" (cpu.runq, gpu.launch, npu.sync, ...);
    other recorded samples by their schema name."""
    counts = {}
    for name, records in rec.events.items():
        if name != "dev.event" and len(records):
            counts[name] = int(len(records))
    if rows is not None:
        keys, n = np.unique(np.char.add(np.char.add(rows.stream.astype(str), "."),
                                        rows.kind.astype(str)), return_counts=True)
        counts.update({str(k): int(c) for k, c in zip(keys, n)})
    return dict(sorted(counts.items()))


def top_ops(rows, limit: int = 20) -> list[dict]:
    """Submissions (not syncs, not copies) by (stream, api, op_name), most first."""
    if rows is None:
        return []
    counts: dict[tuple, int] = {}
    for stream, kind, api, name in zip(rows.stream, rows.kind, rows.api, rows.op_name):
        if kind in ("launch", "graph_launch", "model_exec"):
            key = (stream, kind, api, name)
            counts[key] = counts.get(key, 0) + 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], str(item[0])))[:limit]
    return [{"stream": s, "kind": k, "api": a, "op_name": n, "count": c}
            for (s, k, a, n), c in ranked]


def sync_waits(rows) -> list[dict]:
    """Time the host spent blocked in each sync API."""
    if rows is None:
        return []
    out = []
    is_sync = rows.kind == "sync"
    returned = (rows.events["flags"] & 1) != 0
    for stream, api in sorted({(s, a) for s, a in zip(rows.stream[is_sync], rows.api[is_sync])}):
        at = is_sync & (rows.stream == stream) & (rows.api == api) & returned
        waits = rows.events["duration_ns"][at].astype(np.float64)
        if not len(waits):
            continue
        p50, p99 = np.percentile(waits, [50, 99])
        out.append({"stream": stream, "api": api, "count": int(len(waits)),
                    "total_ms": round(float(waits.sum()) / 1e6, 3),
                    "p50_us": round(float(p50) / 1e3, 3), "p99_us": round(float(p99) / 1e3, 3),
                    "max_us": round(float(waits.max()) / 1e3, 3)})
    return out


def bytes_by_direction(rows) -> list[dict]:
    if rows is None:
        return []
    is_copy = rows.kind == "memcpy"
    out = []
    for stream, direction in sorted({(s, str(d)) for s, d in zip(rows.stream[is_copy],
                                                                  rows.direction[is_copy])}):
        at = is_copy & (rows.stream == stream) & (rows.direction.astype(str) == direction)
        out.append({"stream": stream, "direction": None if direction == "None" else direction,
                    "count": int(at.sum()),
                    "bytes": int(rows.events["bytes"][at].astype(np.uint64).sum())})
    return out


def device_probes(rec: Recording) -> dict:
    footer = rec.footer or {}
    return {"summary": footer.get("device_probe_summary", {}),
            "name_resolution": footer.get("name_resolution", {})}


def summarize(rec: Recording) -> dict:
    runq = rec.events.get("cpu.runq", np.empty(0))
    rows = device_rows(rec)
    return {
        "file": str(rec.path),
        "format_version": "%d.%d" % rec.version,
        "complete": rec.complete,
        "warnings": list(rec.warnings),
        "duration_s": round(duration_s(rec), 6),
        "events": event_counts(rec, rows),
        "lost_events": lost_events(rec),
        "kernel_counters": (rec.footer or {}).get("counters", {}),
        "runq": runq_summary(runq),
        "top_runq_threads": top_threads(runq),
        "ops": top_ops(rows),
        "sync_waits": sync_waits(rows),
        "bytes_by_direction": bytes_by_direction(rows),
        "device_probes": device_probes(rec),
        "anomalies": detect(rec),
        "telemetry": telemetry_summary(rec),
    }


def format_text(summary: dict) -> str:
    lines = [f"recording   {summary['file']} (format {summary['format_version']}"
             f"{'' if summary['complete'] else ', cut short'})",
             f"duration    {summary['duration_s']:.3f} s",
             f"lost        {summary['lost_events']:,} events"]
    for name, count in summary["events"].items():
        lines.append(f"events      {name:<20} {count:>12,}")
    runq = summary["runq"]
    lines.append("")
    if runq["count"]:
        lines.append(f"run-queue delay: {runq['count']:,} wake-ups, p50 {runq['p50_us']} µs, "
                     f"p99 {runq['p99_us']} µs, max {runq['max_us']} µs")
        lines.extend(hist_lines(runq["hist_log2_us"]))
    else:
        lines.append("run-queue delay: no events")
    if summary["top_runq_threads"]:
        lines.append("")
        lines.append(f"{'pid':>8} {'tid':>8} {'comm':<16} {'wake-ups':>9} {'total ms':>10}")
        for t in summary["top_runq_threads"]:
            lines.append(f"{t['pid']:>8} {t['tid']:>8} {t['comm']:<16} {t['count']:>9} "
                         f"{t['total_ms']:>10.3f}")
    lines.extend(device_lines(summary))
    lines.append("")
    lines.append(f"anomalies: {len(summary['anomalies'])}")
    for anomaly in summary["anomalies"]:
        lines.append("  " + anomaly_line(anomaly))
    lines.extend(telemetry_lines(summary["telemetry"]))
    return "\n".join(lines)


def anomaly_line(a: dict) -> str:
    """One line per anomaly; the evidence is in --json."""
    ev = a.get("evidence", {})
    what = a.get("series") or f"{a.get('kind')} ({a.get('modality')})"
    line = f"{a.get('ts_ns', 0) / 1e9:14.3f} s  {a.get('detector')} {what} {a.get('state')}"
    if ev.get("p99") is not None and ev.get("baseline"):
        line += (f": p99 {ev['p99'] * 1e6:.1f} µs vs baseline {ev['baseline'] * 1e6:.1f} µs "
                 f"({ev['p99'] / ev['baseline']:.1f}x)")
    if ev.get("top_contributors"):
        line += "; top threads " + ", ".join(str(c[0]) for c in ev["top_contributors"][:3])
    return line


def device_lines(summary: dict) -> list[str]:
    lines = []
    if summary["ops"]:
        lines += ["", f"{'stream':<6} {'kind':<12} {'api':<28} {'count':>9}  op"]
        for op in summary["ops"]:
            lines.append(f"{op['stream']:<6} {op['kind']:<12} {op['api']:<28} {op['count']:>9}  "
                         f"{op['op_name'] or '-'}")
    if summary["sync_waits"]:
        lines += ["", f"{'sync waits':<36} {'count':>7} {'total ms':>10} {'p50 µs':>10} "
                      f"{'p99 µs':>10} {'max µs':>10}"]
        for w in summary["sync_waits"]:
            lines.append(f"{w['stream'] + ' ' + w['api']:<36} {w['count']:>7} "
                         f"{w['total_ms']:>10.3f} {w['p50_us']:>10.1f} {w['p99_us']:>10.1f} "
                         f"{w['max_us']:>10.1f}")
    if summary["bytes_by_direction"]:
        lines += ["", f"{'copies':<20} {'count':>9} {'bytes':>16}"]
        for b in summary["bytes_by_direction"]:
            lines.append(f"{b['stream'] + ' ' + str(b['direction']):<20} {b['count']:>9} "
                         f"{b['bytes']:>16,}")
    return lines


def hist_lines(buckets: list[dict], width: int = 40) -> list[str]:
    """The histogram drawn as runqlat draws it."""
    peak = max((b["count"] for b in buckets), default=0) or 1
    out = [f"{'usecs':>19}{'':7}: count     distribution"]
    for b in buckets:
        stars = "*" * int(b["count"] * width / peak)
        out.append(f"{b['low_us']:>10} -> {b['high_us']:<10}: {b['count']:<8} |{stars:<{width}}|")
    return out
