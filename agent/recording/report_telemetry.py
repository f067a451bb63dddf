"""The report's section on what dispatchers reported and what the agent
told them: request latency p50/p99 per series and modality, attention
entropy per modality, and the hint audit log of a flight recording."""

import numpy as np

from mmtrace.agent.ingest.percentiles import Percentiles

LAST_HINTS = 10
MAX_SERIES = 256
MAX_HEADS = 1 << 16
EXACT_LIMIT = 1 << 16       # values held exactly per series before the sketch


def latest_list(rec, key: str) -> list:
    """The last version of a table the meta holds as a list (tables only grow)."""
    for doc in reversed(rec.meta):
        if isinstance(doc.get(key), list):
            return doc[key]
    return []


def latest_table(rec, key: str) -> list[str]:
    """The last version of a name table."""
    return [str(x) for x in latest_list(rec, key)]


def name_at(table: list[str], i: int) -> str:
    return table[i] if i < len(table) else str(i)


class Telemetry:
    """What dispatchers reported, gathered piece by piece as a recording
    is replayed (bounded: at most MAX_SERIES request series and as many
    modalities, each with bounded percentiles)."""

    def __init__(self):
        self.requests: dict[int, Percentiles] = {}
        self.entropy: dict[int, dict] = {}

    def add(self, records: dict):
        samples = records.get("request.latency")
        if samples is not None and len(samples):
            for sid in np.unique(samples["series"]).tolist():
                if sid in self.requests or len(self.requests) < MAX_SERIES:
                    values = samples["value_s"][samples["series"] == sid] * 1e3
                    self.requests.setdefault(sid, Percentiles(EXACT_LIMIT)).add(values)
        samples = records.get("model.entropy")
        if samples is not None and len(samples):
            for mid in np.unique(samples["modality"]).tolist():
                if mid not in self.entropy and len(self.entropy) >= MAX_SERIES:
                    continue
                mine = samples[samples["modality"] == mid]
                s = self.entropy.setdefault(mid, {"n": 0, "sum": 0.0, "sq": 0.0, "min": 1.0,
                                                  "max": 0.0, "heads": set()})
                v = mine["value"].astype(np.float64)
                s["n"] += len(v)
                s["sum"] += float(v.sum())
                s["sq"] += float((v * v).sum())
                s["min"], s["max"] = min(s["min"], float(v.min())), max(s["max"], float(v.max()))
                if len(s["heads"]) < MAX_HEADS:
                    s["heads"].update(zip(mine["layer"].tolist(), mine["head"].tolist()))

    def summary(self, rec) -> dict:
        return {"requests": self._requests(rec), "entropy": self._entropy(rec),
                "hints": hint_summary(rec)}

    def _requests(self, rec) -> list[dict]:
        names = latest_table(rec, "request_series")
        out = []
        for sid, values in sorted(self.requests.items()):
            p50, p99 = values.p50_p99()
            out.append({"series": name_at(names, sid), "count": values.count,
                        "p50_ms": round(p50, 3), "p99_ms": round(p99, 3),
                        "max_ms": round(values.max, 3)})
        return out

    def _entropy(self, rec) -> list[dict]:
        modalities = latest_table(rec, "modalities")
        out = []
        for mid, s in sorted(self.entropy.items()):
            mean = s["sum"] / s["n"]
            std = max(0.0, s["sq"] / s["n"] - mean * mean) ** 0.5
            out.append({"modality": name_at(modalities, mid), "samples": s["n"],
                        "heads": len(s["heads"]), "mean": round(mean, 4),
                        "std": round(std, 4), "min": round(s["min"], 4),
                        "max": round(s["max"], 4)})
        return out


def hint_summary(rec) -> dict:
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
