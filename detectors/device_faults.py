"""Verdicts from device faults: a hung device (`gpu_hang`, `npu_hang`, from
device_hang anomalies) and leaking memory (`memory_leak`). They outrank
any time share: a launcher whose sync never returns is not slow, it is
stuck. Added to a diagnosis answer (detectors/diagnosis.py diagnose) from
the anomalies of its window, with evidence, fixes, and the chain that
joins a hang on one device with memory growing on another in the same
window: a hung NPU can take the PCIe link down, the GPU driver takes that
for a device reset and skips the callbacks that free device memory."""

from mmtrace.detectors.diagnosis import STATES

MIB = 1 << 20

FIXES = {
    "npu_hang": ["restart the worker {who}: its stream will not drain on its own",
                 "reset NPU {device} (npu-smi set -t reset -d {device}) once no process "
                 "uses it; check its health first (npu-smi info)",
                 "drain NPU {device}: a prefer_device hint sends new work to the other "
                 "devices while it is stuck"],
    "gpu_hang": ["restart the worker {who}: its stream will not drain on its own",
                 "reset GPU {device} (nvidia-smi --gpu-reset -i {device}) once no process "
                 "uses it; look for Xid errors in the kernel log",
                 "drain GPU {device}: a prefer_device hint sends new work to the other "
                 "devices while it is stuck"],
    "memory_leak": ["restart the worker {who} to give the memory back; then find the "
                    "allocation that is never freed (the largest live ones are listed)",
                    "cap what it may hold (PYTORCH_CUDA_ALLOC_CONF, a per-process memory "
                    "fraction) so that it fails before the device is full"],
    "unaccounted_gpu": ["memory on GPU {device} is held by no live traced process: the "
                        "driver kept a dead process's memory, or an untraced one holds it "
                        "(nvidia-smi --query-compute-apps=pid,used_memory --format=csv)",
                        "reset GPU {device} (nvidia-smi --gpu-reset -i {device}) once its "
                        "workers are drained (prefer_device hints away from it)"],
    "unaccounted_npu": ["memory on NPU {device} is held by no live traced process: the "
                        "driver kept a dead process's memory, or an untraced one holds it "
                        "(npu-smi info shows the processes on each NPU)",
                        "reset NPU {device} (npu-smi set -t reset -d {device}) once its "
                        "workers are drained"],
}


def _unaccounted_fixes(e: dict) -> list[str]:
    return [f.format(device=e["device"]) for f in FIXES[f"unaccounted_{e['stream']}"]]


def _firing(anomalies, detector: str, start_ns: int, end_ns: int) -> list[dict]:
    """The `detector`'s alarms that were firing at some time in [start, end):
    raised before its end and not resolved before its start (a hang raised
    a minute ago is still a hang now)."""
    out, resolved = [], {}
    for a in anomalies:
        if a.get("detector") == detector and a.get("state") == "resolved":
            resolved.setdefault(a.get("series"), []).append(int(a.get("ts_ns", 0)))
    for a in anomalies:
        if a.get("detector") != detector or a.get("state") != "firing" \
                or not isinstance(a.get("evidence"), dict):
            continue
        raised = int(a.get("ts_ns", 0))
        ended = min((t for t in resolved.get(a.get("series"), ()) if t >= raised), default=None)
        if raised < end_ns and (ended is None or ended >= start_ns):
            out.append(a)
    return out


def _mib(n) -> str:
    return f"{n / MIB:,.0f} MiB"


def _hang_line(a: dict) -> str:
    e = a["evidence"]
    behind = e.get("unretired")
    return (f"pid {e['pid']} ({e.get('comm') or '?'}) tid {e['tid']}: {e['api']} on "
            f"{e['stream'].upper()} {e['device']} stream {e['stream_handle']:#x} had not "
            f"returned after {e['waited_s']:.1f} s"
            + (f", {behind} submissions behind it unretired" if behind else ""))


def _leak_line(a: dict) -> str:
    e = a["evidence"]
    if e.get("kind") == "unaccounted":
        return (f"{e['stream'].upper()} {e['device']}: {_mib(e['unaccounted_bytes'])} in use "
                f"that no live traced process holds, grown by {_mib(e['grown_bytes'])} "
                f"({_mib(e['growth_bytes_per_s'])}/s)")
    where = ", ".join(f"{h['stream'].upper()} {h['device']}" for h in e.get("holdings", []))
    return (f"pid {e['pid']} holds {_mib(e['outstanding_bytes'])} on {where or 'its devices'}, "
            f"grown by {_mib(e['grown_bytes'])} with no free"
            + (f" ({_mib(e['growth_bytes_per_s'])}/s)" if e.get("growth_bytes_per_s") else ""))


def _elsewhere(leak: dict, hang: dict) -> bool:
    """The leak grew while the call hung, on another device (or in no
    process's hands)."""
    le, he = leak["evidence"], hang["evidence"]
    if le["since_ns"] > hang["ts_ns"] or leak["ts_ns"] < he["since_ns"]:
        return False
    if le.get("kind") == "unaccounted":
        return (he["stream"], he["device"]) != (le["stream"], le["device"])
    return any((h["stream"], h["device"]) != (he["stream"], he["device"])
               for h in le.get("holdings", []))


def fault_end(anomalies) -> int:
    """When the last hang or leak anomaly was raised (0: none)."""
    return max((int(a.get("ts_ns", 0)) for a in anomalies
                if a.get("detector") in ("device_hang", "memory_leak")), default=0)


def fault_start(anomalies) -> int:
    """When the first hang or leak began (its evidence's since_ns)."""
    return min((int((a.get("evidence") or {}).get("since_ns", a.get("ts_ns", 0)))
                for a in anomalies if a.get("detector") in ("device_hang", "memory_leak")),
               default=0)


def faults(anomalies, start_ns: int, end_ns: int) -> dict[int, dict]:
    """pid -> {"causes", "chain", "fixes", "comm"} of the hangs and leaks
    that name it in [start, end). A hang's chain takes in the leaks on
    other devices in the same window, whoever holds them."""
    hangs = _firing(anomalies, "device_hang", start_ns, end_ns)
    leaks = _firing(anomalies, "memory_leak", start_ns, end_ns)
    span = max(1, end_ns - start_ns)
    out: dict[int, dict] = {}
    for a in hangs:
        e = a["evidence"]
        verdict = "npu_hang" if e["stream"] == "npu" else "gpu_hang"
        share = min(1.0, (end_ns - max(start_ns, e["since_ns"])) / span)
        p = out.setdefault(e["pid"], {"causes": [], "chain": [], "fixes": [],
                                      "comm": e.get("comm")})
        p["causes"].append({"verdict": verdict, "share": round(share, 4), "evidence": e})
        p["chain"].append(_hang_line(a))
        joined = [leak for leak in leaks if _elsewhere(leak, a)]
        for leak in joined:
            p["chain"].append("in the same window, " + _leak_line(leak))
        if joined:
            p["chain"].append(f"a hung {e['stream'].upper()} can take the PCIe link down; the "
                              "GPU driver takes that for a device reset and skips the "
                              "callbacks that free device memory")
        who = f"pid {e['pid']} ({e.get('comm') or '?'})"
        p["fixes"] += [f.format(who=who, device=e["device"]) for f in FIXES[verdict]]
        for leak in joined:
            le = leak["evidence"]
            if le.get("kind") == "unaccounted":
                p["fixes"] += _unaccounted_fixes(le)
    for a in leaks:
        e = a["evidence"]
        if e.get("kind") != "process":
            continue
        share = min(1.0, (end_ns - max(start_ns, e["since_ns"])) / span)
        p = out.setdefault(e["pid"], {"causes": [], "chain": [], "fixes": [], "comm": None})
        hung = bool(p["causes"])        # its hang's fixes restart it already
        p["causes"].append({"verdict": "memory_leak", "share": round(share, 4), "evidence": e})
        line = _leak_line(a)
        if line not in " ".join(p["chain"]):
            p["chain"].append(line)
        p["fixes"] += [f.format(who=f"pid {e['pid']}") for f in FIXES["memory_leak"][hung:]]
    return out


def merge(answer: dict, anomalies, pids=None) -> dict:
    """Put the fault verdicts into a diagnosis answer: a process they name
    takes the fault as its verdict (a hang first), its time-share causes
    kept after; one the window did not hold (its only thread is stuck in
    the call) is added."""
    window = answer.get("window")
    if not window:
        return answer
    found = faults(anomalies, window["start_ns"], window["end_ns"])
    rows = {p["pid"]: p for p in answer["processes"]}
    for pid, f in found.items():
        if pids and pid not in pids:
            continue
        causes = sorted(f["causes"], key=lambda c: (c["verdict"] == "memory_leak", -c["share"]))
        row = rows.get(pid)
        if row is None:
            row = rows[pid] = {"pid": pid, "comm": f["comm"] or "?", "window": dict(window),
                               "verdict": "healthy", "shares": dict.fromkeys(STATES, 0.0),
                               "causes": [],
                               "culprits": [], "chain": [], "fixes": [], "threads": [],
                               "calls": 0, "submissions": 0, "failed_calls": 0,
                               "copy_bytes": 0, "cpu_measured": False, "reference": None}
            answer["processes"].append(row)
        was_healthy = row["verdict"] == "healthy"
        row["causes"] = causes + row["causes"]
        row["verdict"] = causes[0]["verdict"]
        row["chain"] = f["chain"] + ([] if was_healthy else row["chain"])
        row["fixes"] = f["fixes"] + row["fixes"]
    answer["processes"].sort(key=lambda r: r["verdict"] not in ("npu_hang", "gpu_hang",
                                                                "memory_leak"))
    # Memory no live process holds belongs to no process: said per device.
    devices = [{"stream": a["evidence"]["stream"], "device": a["evidence"]["device"],
                "verdict": "memory_leak", "line": _leak_line(a), "evidence": a["evidence"],
                "fixes": _unaccounted_fixes(a["evidence"])}
               for a in _firing(anomalies, "memory_leak", window["start_ns"], window["end_ns"])
               if a["evidence"].get("kind") == "unaccounted"]
    if devices:
        answer["devices"] = devices
    return answer
