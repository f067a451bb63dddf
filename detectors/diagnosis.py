"""Why a process is slow: its launchers' time split (detectors/time_split.py)
over a window, read against a reference stretch, turned into ranked causes
with their evidence, the threads that took the CPU, a causal chain from
symptom to culprit, and the fixes that fit.

The verdict names are the spec's (Diagnosis): cpu_starved, host_bound,
bus_bound, device_bound, npu_queue, blocked, input_shift, healthy.

Two kinds of cause. Some states bound the launcher whatever came before:
waiting runnable on a run queue, the device's syncs, synchronous copies,
the CPU itself between launches. Each is a cause once its share passes a
level of its own (`*_share`), or once it has risen well past the same
process's share in the reference stretch. Sleeping elsewhere (pipes,
locks, I/O, a timer) is also what an idle server does, so `blocked` is a
cause only where it rose against the reference.
"""

from dataclasses import asdict, dataclass, field

import numpy as np

from mmtrace.detectors.time_split import TimeSplit, key_slice, key_tid

STATES = ("on_cpu", "runnable", "sync", "copy", "blocked")
VERDICTS = ("cpu_starved", "host_bound", "bus_bound", "device_bound", "npu_queue", "blocked",
            "input_shift", "gpu_hang", "npu_hang", "memory_leak", "healthy")
# Which state carries each verdict that a time share decides.
STATE_OF = {"cpu_starved": "runnable", "host_bound": "on_cpu", "bus_bound": "copy",
            "device_bound": "sync", "npu_queue": "sync", "blocked": "blocked"}


@dataclass
class DiagnosisRules:
    """Every level a verdict is decided by; [diagnosis] in the config."""
    starved_share: float = 0.25     # runnable share that starves a launcher on its own
    sync_share: float = 0.5         # share in device syncs: device-bound
    copy_share: float = 0.3         # share in synchronous copies: bus-bound
    on_cpu_share: float = 0.8       # share on the CPU between launches: host-bound
    min_share: float = 0.05         # a cause is at least this share of the time
    rise_factor: float = 1.5        # a rise is at least this times the reference share...
    rise_share: float = 0.1         # ...and this much above it
    link_gbps: float = 16.0         # the bus's capacity when NVML gives none (PCIe 4 x16: ~25 GB/s)
    bus_utilisation: float = 0.7    # copies at this share of the link: bus-bound
    min_reference_s: float = 3.0    # a shorter reference stretch is none
    reference_s: float = 10.0       # the stretch just before a window that it is read against
    max_processes: int = 20         # processes in an answer
    max_culprits: int = 5

    @classmethod
    def of(cls, settings) -> "DiagnosisRules":
        """From the daemon's [diagnosis] settings (the fields both have)."""
        return cls(**{f: getattr(settings, f) for f in cls.__dataclass_fields__
                      if hasattr(settings, f)})


@dataclass
class Process:
    """One process's window: the sums behind its verdict."""
    pid: int
    comm: str
    tids: list
    wall_ns: int = 0
    parts: dict = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    calls: int = 0
    submissions: int = 0
    failed: int = 0
    copy_bytes: int = 0
    npu_calls: int = 0
    npu_queue_ns: int = 0
    holders: dict = field(default_factory=dict)     # tid -> ns it held a CPU the launchers waited for
    cpu_measured: bool = True       # its threads have switch-in records (else on_cpu is a guess)

    @property
    def shares(self) -> dict:
        total = sum(self.parts.values())
        return {s: (self.parts[s] / total if total else 0.0) for s in STATES}


def processes(split: TimeSplit, start_ns: int, end_ns: int, pids=None) -> dict[int, Process]:
    """Per process, the sums of its submitting threads over [start, end):
    threads that made a GPU/NPU call there (for a pid asked for by name
    that made none, all its threads)."""
    # The sums are whole slices: the window's wall time is theirs too.
    lo, hi = split.aligned(start_ns, end_ns)
    if not pids and (split.last_ns is None or split.last_ns < lo):
        return {}                   # nothing reaches the window (an idle daemon's every window)
    threads, device, culprits = split.slices(lo, hi)
    names = split.names
    dev_tid = key_tid(device["key"])
    submitting = np.unique(dev_tid[device["calls"] > 0])
    by_pid: dict[int, set] = {}
    for tid, pid in zip(submitting.tolist(), names.pids(submitting).tolist()):
        if pid:
            by_pid.setdefault(pid, set()).add(tid)
    run_tids = np.unique(key_tid(threads["key"]))
    for pid in pids or ():
        if pid not in by_pid:
            tids = set(run_tids[names.pids(run_tids) == pid].tolist())
            if tids:
                by_pid[pid] = tids
    lo = max(lo, split.first_ns if split.first_ns is not None else lo)
    hi = min(hi, split.last_ns + 1) if split.last_ns is not None else hi
    per = _per_thread(threads, device, split.slice_ns, lo, hi)
    waiter_tid = key_tid(culprits["key"])   # the thread that waited
    out = {}
    for pid, tids in by_pid.items():
        if pids and pid not in pids:
            continue
        leader = names.get(pid) or names.get(min(tids))
        proc = Process(pid, leader.comm if leader else "?", sorted(tids))
        sel = np.isin(per["tid"], proc.tids)
        mine = {k: v[sel] for k, v in per.items()}
        proc.wall_ns = int(mine["wall"].sum())
        proc.parts = {state: int(mine[state].sum()) for state in STATES}
        proc.cpu_measured = bool(mine["cpu_rows"].any())
        for name in ("calls", "submissions", "failed", "bytes", "npu", "queue"):
            setattr(proc, _PROCESS_FIELD.get(name, name), int(mine[name].sum()))
        held = culprits[np.isin(waiter_tid, list(tids))]
        for holder, wait in zip(held["holder"].tolist(), held["wait"].tolist()):
            proc.holders[holder] = proc.holders.get(holder, 0) + wait
        out[pid] = proc
    return out


_PROCESS_FIELD = {"bytes": "copy_bytes", "npu": "npu_calls", "queue": "npu_queue_ns"}


def _grouped(rows, fields: tuple, tids: np.ndarray) -> dict:
    """Per tid of `tids` (sorted, unique): the sums of `fields` in `rows`,
    their first and last evidence and the last slice (zeros where none)."""
    out = {f: np.zeros(len(tids), np.int64) for f in fields + ("first", "last", "slice", "n")}
    out["first"][:] = np.iinfo(np.int64).max
    if not len(rows):
        return out
    tid = key_tid(rows["key"])
    order = np.argsort(tid, kind="stable")
    rows, tid = rows[order], tid[order]
    uniq, starts = np.unique(tid, return_index=True)
    at = np.searchsorted(tids, uniq)
    for f in fields:
        out[f][at] = np.add.reduceat(rows[f], starts)
    out["first"][at] = np.minimum.reduceat(rows["first"], starts)
    out["last"][at] = np.maximum.reduceat(rows["last"], starts)
    out["slice"][at] = np.maximum.reduceat(key_slice(rows["key"]), starts)
    out["n"][at] = np.diff(np.append(starts, len(rows)))
    return out


def _per_thread(threads, device, slice_ns: int, lo: int, hi: int) -> dict:
    """Per thread of the window (sorted tids): its wall time and its parts.
    A device wait is a sleep (a blocking sync) or a spin (on the CPU): it is
    carved from the thread's sleep, then from its time on the CPU, and never
    from its time runnable (waiting for a CPU on the way out of a sync is
    the CPU's doing), thread by thread (one thread's sync cannot take
    another's sleep)."""
    tids = np.union1d(key_tid(threads["key"]), key_tid(device["key"]))
    run = _grouped(threads, ("runnable", "blocked"), tids)
    dev = _grouped(device, ("sync", "copy", "calls", "submissions", "failed", "bytes", "npu",
                            "queue"), tids)
    # A thread lives from its first evidence to the end of the slice of its
    # last (it runs on after its last switch-in).
    first = np.minimum(run["first"], dev["first"])
    last = np.maximum(np.maximum(run["last"], dev["last"]),
                      (np.maximum(run["slice"], dev["slice"]) + 1) * slice_ns)
    wall = np.maximum(0, np.minimum(hi, last) - np.maximum(lo, first))
    runnable, blocked = run["runnable"], run["blocked"]
    on_cpu = np.maximum(0, wall - runnable - blocked)
    waited = dev["sync"] + dev["copy"]
    from_sleep = np.minimum(blocked, waited)
    from_cpu = np.minimum(on_cpu, waited - from_sleep)
    device_part = from_sleep + from_cpu            # what of the waits the thread's time holds
    share_of_sync = np.divide(dev["sync"], waited, out=np.zeros(len(tids)), where=waited > 0)
    sync = np.round(device_part * share_of_sync).astype(np.int64)
    return {"tid": tids, "wall": wall, "runnable": runnable,
            "blocked": blocked - from_sleep, "on_cpu": on_cpu - from_cpu,
            "sync": sync, "copy": device_part - sync, "cpu_rows": run["n"] > 0,
            **{k: dev[k] for k in ("calls", "submissions", "failed", "bytes", "npu", "queue")}}


def window_shares(split: TimeSplit, start_ns: int, end_ns: int) -> dict:
    """pid -> (its launching threads' time split, the share of the window
    they lived, comm): what the live starvation detector and the metrics read."""
    span = max(1, end_ns - start_ns)
    return {pid: (p.shares, p.wall_ns / (span * max(1, len(p.tids))), p.comm)
            for pid, p in processes(split, start_ns, end_ns).items()}


def reference_range(split: TimeSplit, start_ns: int, end_ns: int,
                    rules: DiagnosisRules) -> tuple[int, int] | None:
    """The stretch a window is read against: the `reference_s` just before
    it, when at least `min_reference_s` of it is held; else the start of
    what is held, when the window is long enough to have one of its own;
    else None (never what comes after: a quiet stretch read against a later
    incident would look like one)."""
    if split.first_ns is None:
        return None
    least = int(rules.min_reference_s * 1e9)
    if start_ns - split.first_ns >= least:
        return max(split.first_ns, start_ns - int(rules.reference_s * 1e9)), start_ns
    if min(end_ns, split.last_ns) - split.first_ns >= 2 * least:
        return split.first_ns, split.first_ns + least
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def rise_level(base: float, rise_factor: float, rise_share: float) -> float:
    """The least share that counts as a rise over `base`: at least
    `rise_share` above it, and either `rise_factor` times it or the rest of
    the time cut by that factor (0.6 -> 0.85 asleep is the rest cut from
    0.4 to 0.15). One rule for the verdicts and the live watches."""
    grown = base * rise_factor
    rest_cut = 1 - (1 - base) / rise_factor
    return max(base + rise_share, min(grown, rest_cut))


def _causes(p: Process, ref: Process | None, window_s: float, rules: DiagnosisRules,
            entropy_share: float) -> list[dict]:
    shares = p.shares
    ref_shares = ref.shares if ref is not None and ref.wall_ns else None
    npu_heavy = p.npu_calls * 2 > p.calls
    copy_rate = p.copy_bytes / window_s if window_s > 0 else 0.0
    link = rules.link_gbps * 1e9
    levels = {"runnable": rules.starved_share, "sync": rules.sync_share,
              "copy": rules.copy_share, "on_cpu": rules.on_cpu_share, "blocked": None}
    causes = []
    for verdict, state in STATE_OF.items():
        if verdict == "npu_queue" and not npu_heavy or verdict == "device_bound" and npu_heavy:
            continue
        if state == "on_cpu" and not p.calls:
            continue            # a host-bound launcher launches
        if state in ("on_cpu", "blocked") and not p.cpu_measured:
            continue            # no switch-in records: what is not a device wait is unknown
        share = shares[state]
        if share < rules.min_share:
            continue
        level = levels[state]
        alone = level is not None and share >= level
        was = ref_shares[state] if ref_shares else None
        rose = was is not None and share >= rise_level(was, rules.rise_factor, rules.rise_share)
        bus_full = state == "copy" and copy_rate >= rules.bus_utilisation * link
        if not (alone or rose or bus_full):
            continue
        evidence = {"share": round(share, 4)}
        if was is not None:
            evidence["reference_share"] = round(was, 4)
        if state == "copy":
            evidence.update(copy_bytes=p.copy_bytes, copy_gb_per_s=round(copy_rate / 1e9, 3),
                            link_gb_per_s=rules.link_gbps)
        if verdict == "npu_queue":
            evidence["npu_submit_to_retire_ms"] = round(p.npu_queue_ns / 1e6, 3)
        causes.append({"verdict": verdict, "share": round(share, 4), "evidence": evidence})
    if entropy_share >= rules.min_share:
        causes.append({"verdict": "input_shift", "share": round(entropy_share, 4),
                       "evidence": {"share_of_window_shifted": round(entropy_share, 4)}})
    causes.sort(key=lambda c: -c["share"])
    return causes


def _culprits(p: Process, split: TimeSplit, rules: DiagnosisRules) -> list[dict]:
    runnable = p.parts["runnable"] or 1
    out = []
    for tid, held in sorted(p.holders.items(), key=lambda kv: -kv[1])[:rules.max_culprits]:
        info = split.names.get(tid) or split.resolve(tid)
        out.append({"pid": info.pid if info else None, "tid": tid,
                    "comm": info.comm if info else None,
                    "share": round(min(1.0, held / runnable), 4)})
    return out


def _who(c: dict) -> str:
    return f"pid {c['pid']} ({c['comm']}) tid {c['tid']}" if c["pid"] else f"tid {c['tid']}"


def _chain(p: Process, verdict: str, causes: list, culprits: list, ref_rate: float | None,
           window_s: float, symptom: str | None) -> list[str]:
    rate = p.submissions / window_s if window_s > 0 else 0.0
    first = symptom or (
        f"{p.comm} (pid {p.pid}) submitted {rate:,.0f} GPU/NPU calls/s"
        + (f", against {ref_rate:,.0f}/s before" if ref_rate is not None else "")
        + (f"; {p.failed:,} calls failed" if p.failed else ""))
    chain = [first]
    if verdict == "healthy":
        chain.append("its launching threads' time splits as usual: "
                     + ", ".join(f"{s} {_pct(v)}" for s, v in p.shares.items()))
        return chain
    top = causes[0]
    share = _pct(top["share"])
    was = top["evidence"].get("reference_share")
    against = f" (reference {_pct(was)})" if was is not None else ""
    text = {
        "cpu_starved": f"its launching threads waited runnable on a run queue {share} of "
                       f"their time{against}",
        "host_bound": f"its launching threads were on the CPU {share} of their time{against}, "
                      "so the device waits on the host between launches",
        "bus_bound": f"its launching threads were blocked in synchronous copies {share} of "
                     f"their time{against}, {top['evidence'].get('copy_gb_per_s', 0)} GB/s",
        "device_bound": f"its launching threads waited in device syncs {share} of their "
                        f"time{against}",
        "npu_queue": f"its launching threads waited on the NPU's queue {share} of their "
                     f"time{against}",
        "blocked": f"its launching threads slept off the device {share} of their time"
                   f"{against} (I/O, locks, pipes, timers)",
        "input_shift": f"the model's attention entropy shifted for {share} of the window",
    }[verdict]
    chain.append(text)
    if verdict == "cpu_starved" and culprits:
        chain.append("the CPUs they waited for were held by "
                     + ", ".join(f"{_who(c)} {_pct(c['share'])}" for c in culprits[:3]))
    return chain


FIXES = {
    "cpu_starved": ["give the launcher CPUs of its own: isolate them (cpuset, isolcpus) or pin "
                    "it away from {culprits} (taskset, affinity)",
                    "raise its weight over the noisy neighbours: cpu.weight in its cgroup, or "
                    "nice/SCHED_FIFO for the launch thread",
                    "move {culprits} to other CPUs, or cap them with cpu.max"],
    "host_bound": ["cut host work between launches: CUDA graphs (torch.compile "
                   "mode=\"reduce-overhead\"), fused kernels, larger batches",
                   "move pre/post-processing off the launch thread"],
    "bus_bound": ["use pinned (page-locked) host memory and cudaMemcpyAsync, overlapped with "
                  "compute", "fewer, larger copies: batch the inputs; keep tensors on the "
                  "device between steps", "check the link: PCIe generation and width "
                  "(nvidia-smi -q | grep -i -A2 link)"],
    "device_bound": ["the device is the limit: cap the batch or sequence length, or add "
                     "devices (prefer_device hints spread the load)",
                     "avoid syncs in the loop (item(), .cpu(), cudaDeviceSynchronize) so the "
                     "host runs ahead"],
    "npu_queue": ["the NPU's queue is long: cap the batch, or spread the work over more "
                  "NPUs/streams", "check the NPU's health (npu-smi info) for a stuck task"],
    "blocked": ["find what the launcher waits for off the device (py-spy dump, "
                "/proc/PID/stack, offcputime): a slow upstream pipe, a lock, disk I/O",
                "decouple input from launching with a queue deep enough for the bursts"],
    "input_shift": ["the inputs changed: check the request mix (image sizes, prompt lengths) "
                    "against the model's expected distribution",
                    "route the shifted modality apart (modality_batch, route_affinity hints)"],
    "healthy": [],
}


def _fixes(verdict: str, culprits: list) -> list[str]:
    named = ", ".join(f"pid {c['pid']} ({c['comm']})" for c in culprits[:3] if c["pid"]) \
        or "the threads that held its CPUs"
    return [f.format(culprits=named) for f in FIXES.get(verdict, [])]


def diagnose(split: TimeSplit, start_ns: int, end_ns: int, rules: DiagnosisRules | None = None,
             pids=None, entropy_windows=(), symptoms=None) -> dict:
    """The spec's `explain --json`: per process ranked by impact, its
    window's time split, causes, culprits, chain and fixes.
    `entropy_windows`: (start_ns, end_ns) stretches the entropy detector
    held a shift; `symptoms`: pid -> a line naming what a user saw."""
    rules = rules or DiagnosisRules()
    start_ns, end_ns = split.aligned(start_ns, end_ns)
    ref_range = reference_range(split, start_ns, end_ns, rules)
    window = processes(split, start_ns, end_ns, pids)
    refs = processes(split, *ref_range, list(window)) if ref_range and window else {}
    span = max(1, min(end_ns, split.last_ns or end_ns) - max(start_ns, split.first_ns or 0))
    window_s = span / 1e9
    ref_s = (ref_range[1] - ref_range[0]) / 1e9 if ref_range else None
    shifted = sum(max(0, min(e, end_ns) - max(s, start_ns)) for s, e in entropy_windows)
    entropy_share = min(1.0, shifted / span)
    out = []
    for pid, p in window.items():
        ref = refs.get(pid)
        causes = _causes(p, ref, window_s, rules, entropy_share)
        verdict = causes[0]["verdict"] if causes else "healthy"
        culprits = _culprits(p, split, rules) if verdict == "cpu_starved" or any(
            c["verdict"] == "cpu_starved" for c in causes) else []
        out.append({
            "pid": pid, "comm": p.comm,
            "window": {"start_ns": int(start_ns), "end_ns": int(end_ns)},
            "verdict": verdict,
            "shares": {s: round(v, 4) for s, v in p.shares.items()},
            "causes": causes, "culprits": culprits,
            "chain": _chain(p, verdict, causes, culprits,
                            ref.submissions / ref_s if ref is not None else None, window_s,
                            (symptoms or {}).get(pid)),
            "fixes": _fixes(verdict, culprits),
            "threads": p.tids[:64],
            "calls": p.calls, "submissions": p.submissions, "failed_calls": p.failed,
            "copy_bytes": p.copy_bytes,
            "cpu_measured": p.cpu_measured,
            "reference": None if ref is None else {
                "start_ns": int(ref_range[0]), "end_ns": int(ref_range[1]),
                "shares": {s: round(v, 4) for s, v in ref.shares.items()}},
        })
    out.sort(key=lambda r: (r["verdict"] == "healthy", -(r["causes"][0]["share"]
                                                        if r["causes"] else 0), -r["calls"]))
    answer = {"processes": out[:rules.max_processes],
              "window": {"start_ns": int(start_ns), "end_ns": int(end_ns)},
              "reference": None if ref_range is None else
              {"start_ns": int(ref_range[0]), "end_ns": int(ref_range[1])},
              "rules": asdict(rules)}
    if not split.has_blocked:
        answer["note"] = ("this recording predates blocked time: sleeps count as on-CPU, "
                          "so host_bound and blocked cannot be told apart")
    if ref_range is None:
        answer.setdefault("note", f"no reference stretch of {rules.min_reference_s:g} s "
                                  "before the window: causes are judged on their own "
                                  "levels only")
    return answer
