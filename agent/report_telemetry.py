"""The report's section on what dispatchers reported and what the agent
told them: request latency p50/p99 per series and modality, attention
entropy per modality, and the hint audit log of a flight recording."""

import numpy as np

from .recording import Recording

LAST_HINTS = 10


def _latest_table(rec: Recording, key: str) -> list[str]:
    """The last version of a name table (tables only grow)."""
    for doc in reversed(rec.meta):
        if isinstance(doc.get(key), list):
            return [str(x) for x in doc[key]]
    return []


def _name(table: list[str], i: int) -> str:
    return table[i] if i < len(table) else str(i)


def telemetry_summary(rec: Recording) -> dict:
    return {"requests": request_latencies(rec), "entropy": entropy_summary(rec),
            "hints": hint_summary(rec)}


def request_latencies(rec: Recording) -> list[dict]:
    samples = rec.events.get("request.latency")
    if samples is None or not len(samples):
        return []
    names = _latest_table(rec, "request_series")
    out = []
    for sid in np.unique(samples["series"]).tolist():
        values = samples["value_s"][samples["series"] == sid] * 1e3
        p50, p99 = np.percentile(values, [50, 99])
        out.append({"series": _name(names, sid), "count": int(len(values)),
                    "p50_ms": round(float(p50), 3), "p99_ms": round(float(p99), 3),
                    "max_ms": round(float(values.max()), 3)})
    return out


def entropy_summary(rec: Recording) -> list[dict]:
    samples = rec.events.get("model.entropy")
    if samples is None or not len(samples):
        return []
    modalities = _latest_table(rec, "modalities")
    out = []
    for mid in np.unique(samples["modality"]).tolist():
        mine = samples[samples["modality"] == mid]
        heads = np.unique(mine[["layer", "head"]])
        out.append({"modality": _name(modalities, mid), "samples": int(len(mine)),
                    "heads": int(len(heads)), "mean": round(float(mine["value"].mean()), 4),
                    "std": round(float(mine["value"].std()), 4),
                    "min": round(float(mine["value"].min()), 4),
                    "max": round(float(mine["value"].max()), 4)})
    return out


def hint_summary(rec: Recording) -> dict:
    audit = []
    for doc in rec.meta:
        if isinstance(doc.get("hint_audit"), list):
            audit = doc["hint_audit"]
    counts: dict[str, int] = {}
    for e in audit:
        key = f"{e.get('kind')}/{e.get('outcome')}"
        counts[key] = counts.get(key, 0) + 1
    last = [{k: e.get(k) for k in ("ts_ns", "kind", "target", "value", "step", "outcome",
                                     "reason")} for e in audit[-LAST_HINTS:]]
    return {"count": len(audit), "by_kind_outcome": counts, "last": last}


def telemetry_lines(t: dict) -> list[str]:
    lines = []
    if t["requests"]:
        lines += ["", f"{'request latency':<48} {'count':>8} {'p50 ms':>9} {'p99 ms':>9}"]
        lines += [f"{r['series']:<48} {r['count']:>8} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f}"
                  for r in t["requests"]]
    if t["entropy"]:
        lines += ["", "attention entropy (normalised)"]
        lines += [f"  {e['modality']:<12} {e['samples']:>8} samples, {e['heads']} heads, "
                  f"mean {e['mean']:.3f} sd {e['std']:.3f} [{e['min']:.3f}, {e['max']:.3f}]"
                  for e in t["entropy"]]
    hints = t["hints"]
    if hints["count"]:
        lines += ["", f"hints: {hints['count']} decisions ("
                  + ", ".join(f"{k} {n}" for k, n in sorted(hints["by_kind_outcome"].items()))
                  + ")"]
        lines += [f"  {h['outcome']:<8} {h['step']:<9} {h['kind']} {h['target']} -> {h['value']}: "
                  f"{h['reason']}" for h in hints["last"]]
    return lines
