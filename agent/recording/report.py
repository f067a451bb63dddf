"""`mmtrace report`: a summary of one recording, as text or JSON."""

from collections import Counter

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.detectors.diagnosis import STATES, DiagnosisRules

from mmtrace.agent.recording.device_view import ApiGroups
from mmtrace.agent.recording.explain import DiagnosisReplay, anomaly_verdict, explain_split
from mmtrace.agent.recording.offline_detectors import Detectors, settings_of
from mmtrace.agent.ingest.percentiles import Percentiles
from mmtrace.agent.recording.file_checks import lost_total
from mmtrace.agent.recording.replay import DEVICE, replay
from mmtrace.agent.recording.report_telemetry import Telemetry, telemetry_lines
from mmtrace.agent.recording.wall_clock import WallClock


def log2_buckets_us(delays_ns: np.ndarray) -> np.ndarray:
    """runqlat's bucket index per value: 0 for 0–1 µs, k for [2^k, 2^(k+1)) µs."""
    us = delays_ns // 1000
    _, exponent = np.frexp(np.maximum(us, 1).astype(np.float64))
    return np.where(us < 2, 0, exponent - 1).astype(np.int64)


def hist_buckets(counts: np.ndarray) -> list[dict]:
    counts = np.trim_zeros(np.asarray(counts), "b")
    return [{"low_us": 0 if k == 0 else 1 << k, "high_us": (1 << (k + 1)) - 1,
             "count": int(c)} for k, c in enumerate(counts)]


def _us(ns) -> float:
    return round(float(ns) / 1e3, 3)


class TopCounter:
    """Counts by key, bounded: past `limit` keys the smaller half is dropped
    (a recording with more distinct keys than that is ranked approximately)."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self.counts: Counter = Counter()

    def update(self, counts):
        self.counts.update(counts)
        if len(self.counts) > self.limit:
            self.counts = Counter(dict(self.counts.most_common(self.limit // 2)))


class RunqSummary:
    def __init__(self):
        self.hist = np.zeros(64, np.int64)
        self.delays = Percentiles()
        self.threads: dict[int, list] = {}      # tid -> [total_ns, count, pid, comm]
        self.thread_limit = 1 << 16

    def add(self, runq: np.ndarray):
        delays = runq["delay_ns"]
        self.hist += np.bincount(log2_buckets_us(delays), minlength=64)[:64]
        self.delays.add(delays)
        tids, inverse = np.unique(runq["tid"], return_inverse=True)
        total = np.bincount(inverse, weights=delays.astype(np.float64))
        count = np.bincount(inverse)
        # The thread's latest name: a process renames itself at exec.
        latest = np.zeros(len(tids), dtype=np.int64)
        np.maximum.at(latest, inverse, np.arange(len(runq)))
        pids, comms = runq["pid"][latest].tolist(), runq["comm"][latest].tolist()
        for i, tid in enumerate(tids.tolist()):
            entry = self.threads.get(tid)
            if entry is None:
                self.threads[tid] = [float(total[i]), int(count[i]), pids[i], comms[i]]
            else:
                entry[0] += float(total[i])
                entry[1] += int(count[i])
                entry[2], entry[3] = pids[i], comms[i]
        if len(self.threads) > self.thread_limit:
            keep = sorted(self.threads.items(), key=lambda kv: -kv[1][0])
            self.threads = dict(keep[:self.thread_limit // 2])

    def summary(self) -> dict:
        d = self.delays
        out = {"count": d.count, "p50_us": None, "p99_us": None, "max_us": None,
               "hist_log2_us": hist_buckets(self.hist) if d.count else []}
        pct = d.p50_p99()
        if pct:
            out.update(p50_us=_us(pct[0]), p99_us=_us(pct[1]), max_us=_us(d.max))
        return out

    def top_threads(self, limit: int = 10) -> list[dict]:
        """Threads with the largest total run-queue delay."""
        ranked = sorted(self.threads.items(), key=lambda kv: (-kv[1][0], kv[0]))[:limit]
        return [{"pid": pid, "tid": tid, "comm": comm.decode(errors="replace"), "count": n,
                 "total_ms": round(total / 1e6, 3)} for tid, (total, n, pid, comm) in ranked]


class DeviceSummary:
    """Counts, top ops, sync waits and copied bytes of decoded device rows,
    of the calls that succeeded (or whose return was not probed); the calls
    that failed are counted apart, per API and return code."""

    def __init__(self):
        self.events: Counter = Counter()
        self.ops = TopCounter()
        self.waits: dict[tuple, Percentiles] = {}
        self.copies: dict[tuple, list] = {}
        self.failures: Counter = Counter()         # (stream, kind, api, error) -> calls
        self.launch_returns = [0, 0]               # launches, those whose return was probed

    def add(self, rows):
        """One batch of decoded rows. Rows are grouped by their API id with
        numpy: a row's stream and kind, a sync's API and a failed call's
        error (by its code) follow from the id, so only the columns that
        vary within an id (a launch's op, an aclnn launch's API) are
        counted row by row."""
        ev = rows.events
        by_api = rows.api_groups()
        failed = rows.failed
        if failed.any():
            self._add_failures(rows, by_api, np.flatnonzero(failed))
        ok = ~failed
        returned = device_stream.returned(ev)
        counts = np.bincount(by_api.inverse[ok], minlength=len(by_api.first))
        for j, n in enumerate(counts.tolist()):
            if n:
                self.events[f"{by_api.stream[j]}.{by_api.kind[j]}"] += n
        launches = by_api.of_kinds("launch") & ok
        self.launch_returns[0] += int(launches.sum())
        self.launch_returns[1] += int((launches & returned).sum())
        ops = np.flatnonzero(by_api.of_kinds("launch", "graph_launch", "model_exec") & ok)
        if len(ops):
            named = Counter(zip(by_api.inverse[ops].tolist(), rows.api[ops], rows.op_name[ops]))
            keyed: Counter = Counter()      # ids that share a name (a _ptsz variant) add up
            for (j, api, op), n in named.items():
                keyed[(by_api.stream[j], by_api.kind[j], api, op)] += n
            self.ops.update(keyed)
        syncs = np.flatnonzero(by_api.of_kinds("sync") & ok & returned)
        if len(syncs):
            waits = ev["duration_ns"][syncs]
            group = by_api.inverse[syncs]
            for key, ids in _ids_by_key(np.unique(group).tolist(),
                                        lambda j: (by_api.stream[j], rows.api[by_api.first[j]])):
                self.waits.setdefault(key, Percentiles(1 << 16)).add(waits[np.isin(group, ids)])
        copies = np.flatnonzero(by_api.of_kinds("memcpy") & ok)
        if len(copies):
            keys = by_api.inverse[copies] << 8 | ev["direction"][copies].astype(np.int64)
            copied = ev["bytes"][copies].astype(np.uint64)
            order, starts = _sorted_runs(keys)
            for members in np.split(order, starts[1:]):
                mine = copied[members]
                # Exact sums of uint64 lengths, as their 32-bit halves (no sum wraps).
                total = (int((mine >> np.uint64(32)).sum()) << 32) + int(
                    (mine & np.uint64(0xFFFFFFFF)).sum())
                at = copies[members[0]]
                entry = self.copies.setdefault((rows.stream[at], rows.direction[at]), [0, 0])
                entry[0] += len(members)
                entry[1] += total

    def _add_failures(self, rows, by_api: ApiGroups, at: np.ndarray):
        """Failed calls per (stream, kind, api, error): grouped by their
        failure key (DeviceRows.failure_keys: one API id, api and error a
        key), each group's names read once."""
        order, starts = _sorted_runs(rows.failure_keys[at])
        sizes = np.diff(np.append(starts, len(order))).tolist()
        firsts = at[order[starts]]
        for n, j, api, error in zip(sizes, by_api.inverse[firsts].tolist(),
                                    rows.api[firsts].tolist(), rows.error[firsts].tolist()):
            self.failures[(by_api.stream[j], by_api.kind[j], api, error)] += n

    def top_ops(self, limit: int = 20) -> list[dict]:
        """Submissions (not syncs, not copies) by (stream, api, op_name), most first."""
        ranked = sorted(self.ops.counts.items(), key=lambda item: (-item[1], str(item[0])))
        return [{"stream": s, "kind": k, "api": a, "op_name": n, "count": c}
                for (s, k, a, n), c in ranked[:limit]]

    def sync_waits(self) -> list[dict]:
        """Time the host spent blocked in each sync API."""
        out = []
        for (stream, api), waits in sorted(self.waits.items()):
            p50, p99 = waits.p50_p99()
            out.append({"stream": stream, "api": api, "count": waits.count,
                        "total_ms": round(waits.total / 1e6, 3),
                        "p50_us": _us(p50), "p99_us": _us(p99), "max_us": _us(waits.max)})
        return out

    def failed_calls(self) -> list[dict]:
        """Calls that returned an error code, most first."""
        ranked = sorted(self.failures.items(), key=lambda kv: (-kv[1], tuple(map(str, kv[0]))))
        return [{"stream": s, "kind": k, "api": a, "error": e, "count": n}
                for (s, k, a, e), n in ranked]

    def launch_return_codes(self) -> dict:
        """How many launches that did not fail had their return probed (the
        rest were not sampled: bpf/device.h launch_return_wanted)."""
        failed = sum(n for (_, k, _, _), n in self.failures.items() if k == "launch")
        return {"launches": self.launch_returns[0] + failed,
                "probed": self.launch_returns[1] + failed, "failed": failed}

    def bytes_by_direction(self) -> list[dict]:
        return [{"stream": stream, "direction": direction, "count": n, "bytes": total}
                for (stream, direction), (n, total) in sorted(
                    self.copies.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))]


def _sorted_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the positions of `keys` sorted, stably; where each run of one key
    begins in that order): every group of equal keys from one sort, not a
    pass over every key per group (a storm of failures can have as many
    codes as calls)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    return order, np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))


def _ids_by_key(groups: list[int], key) -> list:
    """(key, the groups that have it): groups whose ids name one key together."""
    out: dict = {}
    for j in groups:
        out.setdefault(key(j), []).append(j)
    return list(out.items())


def duration_s(rec) -> float:
    if rec.footer and "duration_s" in rec.footer:
        return float(rec.footer["duration_s"])
    ranges = list(rec.ts_range.values())
    if not ranges:
        return 0.0
    return (max(hi for _, hi in ranges) - min(lo for lo, _ in ranges)) / 1e9


def device_probes(rec) -> dict:
    footer = rec.footer or {}
    return {"summary": footer.get("device_probe_summary", {}),
            "name_resolution": footer.get("name_resolution", {}),
            "failed_programs": failed_programs(rec)}


def failed_programs(rec) -> list[dict]:
    """Probe programs that did not compile or load while recording (from the
    meta, so that a file cut short tells it too): why a stream is empty."""
    return [state for doc in rec.meta for state in doc.get("probes", ())
            if state.get("state") == "failed" and "program" in state]


def time_span(rec, clock: WallClock) -> dict:
    """When the recording started and ended, on the wall and in CLOCK_MONOTONIC."""
    header, footer = getattr(rec, "header", None) or {}, rec.footer or {}
    start = header.get("start_monotonic_ns")
    if not isinstance(start, int):
        return {}
    end = footer.get("end_monotonic_ns")
    if not isinstance(end, int):
        end = start + int(duration_s(rec) * 1e9)
    return {"started": clock.stamp(start), "ended": clock.stamp(end)}


def summarize(rec) -> dict:
    """The report of a recording (a Recording, or a RecordingReader streamed
    from disk): one replay feeds every aggregate and the detectors."""
    runq, device, telemetry = RunqSummary(), DeviceSummary(), Telemetry()
    detectors = Detectors(rec)
    diagnosis = DiagnosisReplay(rec, detectors.p99.submitters)
    for step in replay(rec):
        telemetry.add(step.records)
        if "cpu.runq" in step.records:
            runq.add(step.records["cpu.runq"])
        if step.device is not None and len(step.device):
            device.add(step.device)
        detectors.feed(step)
        diagnosis.feed(step)
    counts = {name: n for name, n in rec.counts.items() if name != DEVICE and n}
    counts.update(device.events)
    clock = WallClock.of(rec)
    anomalies = detectors.finish()
    rules = DiagnosisRules.of(settings_of(rec).diagnosis)
    for anomaly in anomalies:
        anomaly["wall_time"] = clock.stamp(anomaly.get("ts_ns", 0))
        anomaly_verdict(diagnosis.split, anomaly, rules)
    verdicts = explain_split(diagnosis.split, None, None, anomalies, rules, clock,
                             entropy_until_ns=diagnosis.last_entropy_ns)
    return {
        "file": str(rec.path),
        "format_version": "%d.%d" % rec.version,
        "complete": rec.complete,
        "warnings": list(rec.warnings),
        "duration_s": round(duration_s(rec), 6),
        **time_span(rec, clock),
        "events": dict(sorted(counts.items())),
        "lost_events": lost_total(rec.footer),
        "kernel_counters": (rec.footer or {}).get("counters", {}),
        "runq": runq.summary(),
        "top_runq_threads": runq.top_threads(),
        "ops": device.top_ops(),
        "sync_waits": device.sync_waits(),
        "bytes_by_direction": device.bytes_by_direction(),
        "failed_calls": device.failed_calls(),
        "launch_return_codes": device.launch_return_codes(),
        "device_probes": device_probes(rec),
        "anomalies": anomalies,
        "device_memory": detectors.memory.summary(),
        "p99_baselines": detectors.p99.baselines(),
        "detector_notes": detector_notes(rec, detectors),
        "diagnosis": verdicts,
        "telemetry": telemetry.summary(rec),
    }


def format_text(summary: dict) -> str:
    lines = [f"recording   {summary['file']} (format {summary['format_version']}"
             f"{'' if summary['complete'] else ', cut short'})",
             f"duration    {summary['duration_s']:.3f} s",
             *([f"started     {_wall(summary['started'])}",
                f"ended       {_wall(summary['ended'])}"] if "started" in summary else []),
             f"lost        {summary['lost_events']:,} events"]
    for name, count in summary["events"].items():
        lines.append(f"events      {name:<20} {count:>12,}")
    for failed in summary["device_probes"]["failed_programs"]:
        lines.append(f"not traced  {failed.get('stream')}: the {failed.get('program')} did not "
                     f"compile or load, so the file has none of its events:")
        lines.extend("              " + line for line in str(failed.get("reason")).splitlines())
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
    lines.extend(verdict_lines(summary.get("diagnosis") or {}))
    lines.extend(memory_lines(summary.get("device_memory") or {}))
    lines.append("")
    lines.append(f"anomalies: {len(summary['anomalies'])}")
    for note in summary.get("detector_notes") or []:
        lines.append(f"  ({note})")
    for anomaly in summary["anomalies"]:
        lines.append("  " + anomaly_line(anomaly))
    learnt = [b for b in summary.get("p99_baselines") or [] if b["baseline_s"] is not None]
    if learnt:
        lines += ["", f"{'p99 series (at the end)':<44} {'baseline ms':>12} {'threshold ms':>13}"]
        lines += [f"{b['series'][:44]:<44} {b['baseline_s'] * 1e3:>12.3f} "
                  f"{b['threshold_s'] * 1e3:>13.3f}" for b in learnt[:10]]
    lines.extend(telemetry_lines(summary["telemetry"]))
    return "\n".join(lines)


def memory_lines(memory: dict) -> list[str]:
    """Device memory each process held at the end, and its failed allocations."""
    rows = memory.get("processes") or []
    if not rows:
        return []
    lines = ["", f"{'device memory':<14} {'pid':>8} {'held MiB':>10} {'allocs':>8} "
                 f"{'frees':>8}  failed"]
    for p in rows:
        allocs = sum(h["allocs"] for h in p["holdings"])
        frees = sum(h["frees"] for h in p["holdings"])
        failed = ", ".join(f"{f['api']} {f['ret']} x{f['count']}" for f in p["failed"]) or "-"
        where = " ".join(f"{h['stream']}{h['device']}" for h in p["holdings"]) or "-"
        lines.append(f"{where:<14} {p['pid']:>8} {p['outstanding_bytes'] / 2**20:>10,.1f} "
                     f"{allocs:>8,} {frees:>8,}  {failed}")
    return lines


def detector_notes(rec, detectors) -> list[str]:
    """What the detectors could not judge in this recording, said plainly."""
    p99 = detectors.p99.detector
    needed_s = p99.min_baseline_windows * p99.window_ns / 1e9
    if duration_s(rec) >= needed_s + p99.consecutive * p99.window_ns / 1e9:
        return []
    return [f"the recording is {duration_s(rec):.1f} s long: the P99 detectors need "
            f"{needed_s:g} s of normal windows for a baseline ([p99] "
            f"min_baseline_windows x window_s) and fired nothing; the verdict table "
            f"reads the file against its start, and against its own levels"]


def verdict_lines(diagnosis: dict) -> list[str]:
    """The verdict table: per process, its verdict and its launching
    threads' time split over the whole recording (`mmtrace explain` says why)."""
    processes = diagnosis.get("processes") or []
    if not processes:
        return []
    lines = ["", f"{'verdict':<13} {'pid':>8} {'comm':<16} " + " ".join(
        f"{s:>8}" for s in STATES) + "  (share of the launching threads' time)"]
    for p in processes:
        lines.append(f"{p['verdict']:<13} {p['pid']:>8} {p['comm']:<16} " + " ".join(
            f"{100 * p['shares'][s]:>7.0f}%" for s in STATES))
    if diagnosis.get("note"):
        lines.append(f"  ({diagnosis['note']})")
    lines.append("  why, and what to change: mmtrace explain FILE [--pid PID]")
    return lines


def _wall(stamp: dict) -> str:
    """A moment as a person reads it, the monotonic seconds after it."""
    clock = WallClock(None if stamp.get("unix_ns") is None
                      else stamp["unix_ns"] - stamp["monotonic_ns"])
    return f"{clock.text(stamp['monotonic_ns'])}  [{stamp['monotonic_ns'] / 1e9:.3f} s]"


def anomaly_line(a: dict) -> str:
    """One line per anomaly; the evidence is in --json."""
    ev = a.get("evidence", {})
    what = a.get("series") or f"{a.get('kind')} ({a.get('modality')})"
    at = _wall(a["wall_time"]) if "wall_time" in a else f"{a.get('ts_ns', 0) / 1e9:14.3f} s"
    line = f"{at}  {a.get('detector')} {what} {a.get('state')}"
    if ev.get("p99") is not None and ev.get("baseline"):
        line += (f": p99 {ev['p99'] * 1e6:.1f} µs vs baseline {ev['baseline'] * 1e6:.1f} µs "
                 f"({ev['p99'] / ev['baseline']:.1f}x)")
    if ev.get("share") is not None and ev.get("threshold") is not None:
        line += (f": {100 * ev['share']:.0f} % of the time {ev.get('part', 'runnable')}, threshold "
                 f"{100 * ev['threshold']:.0f} %")
    if ev.get("verdict"):
        line += f" [{ev['verdict']}]"
    if ev.get("top_contributors"):
        line += "; top threads " + ", ".join(str(c[0]) for c in ev["top_contributors"][:3])
    if ev.get("errors"):
        top = ev["errors"][0]
        line += (f": {ev.get('failed', 0):,} failed calls, most {top.get('api')} "
                 f"{top.get('error')}")
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
    failed = summary.get("failed_calls") or []
    if failed:
        total = sum(f["count"] for f in failed)
        lines += ["", f"failed calls: {total:,} (no work done: not in the counts, copies "
                      f"and waits above)",
                  f"{'stream':<6} {'api':<28} {'error':<44} {'count':>9}"]
        for f in failed:
            lines.append(f"{f['stream']:<6} {f['api']:<28} {f['error']:<44} {f['count']:>9,}")
    codes = summary.get("launch_return_codes") or {}
    if codes.get("launches"):
        lines += ["", f"launch return codes: {codes['probed']:,} of {codes['launches']:,} "
                      f"launches probed, {codes['failed']:,} failed"
                      + ("" if codes["probed"] == codes["launches"] else
                         " (the rest were not sampled: their outcome is unknown)")]
    return lines


def hist_lines(buckets: list[dict], width: int = 40) -> list[str]:
    """The histogram drawn as runqlat draws it."""
    peak = max((b["count"] for b in buckets), default=0) or 1
    out = [f"{'usecs':>19}{'':7}: count     distribution"]
    for b in buckets:
        stars = "*" * int(b["count"] * width / peak)
        out.append(f"{b['low_us']:>10} -> {b['high_us']:<10}: {b['count']:<8} |{stars:<{width}}|")
    return out
