"""What bench/gpu_check compares, as pure functions over plain data (no
bcc, no torch): a torch.profiler trace made into a reference list of
submissions; a recording's GPU events against that reference; NVML's
gauges against `nvidia-smi --query-gpu`.

A reference (the profiler's, or the rehearsal workload's own list) is
    {"launches": [{"api", "name", "count"}, ...],   kernels launched one by one
     "graph_launches": N, "graph_kernels": N or None, "memcpy": {"h2d": N, "d2h": N},
     "syncs": N}
with the API names as mmtrace writes them (no _ptsz / _v2 suffix).
"""

import re
from collections import Counter

LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
               "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel")
GRAPH_APIS = ("cudaGraphLaunch", "cuGraphLaunch")
SYNC_APIS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
             "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")
# What a profiler's copy is called, and mmtrace's name for its direction.
COPY_DIRECTIONS = {"HtoD": "h2d", "DtoH": "d2h", "DtoD": "d2d", "HtoH": "h2h"}
WINDOW_ANNOTATION = "gpu_check.window"
_SUFFIX = re.compile(r"(_v\d+)?(_ptsz|_ptds)?$")


def api_name(symbol: str) -> str:
    """An API symbol as mmtrace names it: without _ptsz/_ptds/_v2."""
    return _SUFFIX.sub("", symbol)


def kernel_name(name: str | None) -> str | None:
    """A kernel name with its white space as one space, for matching."""
    return " ".join(name.split()) if name else None


def layer_of(api: str) -> str:
    """'runtime' (cuda*) or 'driver' (cu*)."""
    return "runtime" if api.startswith("cuda") else "driver"


# ----- torch.profiler's trace -------------------------------------------------

def reference_from_trace(trace: dict, annotation: str = WINDOW_ANNOTATION) -> dict:
    """The reference of a torch.profiler (Kineto) Chrome trace, within the
    user annotation `annotation` when the trace has one: each kernel
    joined through its correlation id to the runtime or driver call that
    submitted it. A kernel of a graph replay counts as a graph kernel, not
    a launch; a launch call whose kernel the profiler did not see still
    counts (its name unknown)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    window = next(((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
                   if e.get("name") == annotation
                   and e.get("cat") in ("user_annotation", "cpu_op", "python_function")),
                  None)

    def inside(e) -> bool:
        return window is None or window[0] <= float(e["ts"]) <= window[1]

    calls = {}
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and inside(e):
            correlation = (e.get("args") or {}).get("correlation")
            if correlation is not None:
                calls[correlation] = api_name(e["name"])
    kernels: dict = {}
    copies = Counter()
    for e in events:
        correlation = (e.get("args") or {}).get("correlation")
        if correlation not in calls:
            continue
        if e.get("cat") == "kernel":
            kernels.setdefault(correlation, []).append(kernel_name(e["name"]))
        elif e.get("cat") == "gpu_memcpy" and calls[correlation] not in GRAPH_APIS:
            m = re.search(r"(HtoD|DtoH|DtoD|HtoH)", e["name"])
            copies[COPY_DIRECTIONS[m.group(1)] if m else "other"] += 1
    launches = Counter()
    graph_kernels = 0
    for correlation, api in calls.items():
        if api in GRAPH_APIS:
            graph_kernels += len(kernels.get(correlation, []))
        elif api in LAUNCH_APIS:
            for name in kernels.get(correlation, [None]):
                launches[(api, name)] += 1
    return {"launches": [{"api": api, "name": name, "count": n}
                         for (api, name), n in sorted(launches.items(), key=str)],
            "graph_launches": sum(1 for api in calls.values() if api in GRAPH_APIS),
            "graph_kernels": graph_kernels,
            "memcpy": dict(sorted(copies.items())),
            "syncs": sum(1 for api in calls.values() if api in SYNC_APIS),
            "window_found": window is not None}


# ----- the recording against the reference -------------------------------------

def window_events(lines, pid: int, window_ns) -> list[dict]:
    """The GPU events of process `pid` whose call began within
    `window_ns` (CLOCK_MONOTONIC ns, both ends included), from the
    objects of `mmtrace export --format jsonl`."""
    start, end = window_ns
    return [e for e in lines if e.get("stream") == "gpu" and e.get("pid") == pid
            and start <= e["ts_ns"] <= end]


def compare(reference: dict, events: list[dict]) -> dict:
    """How the recorded GPU events of the window match the reference: each
    launch recorded exactly once whichever layer made it, the share named,
    names as the reference has them, graph launches, copies and syncs."""
    launches = [e for e in events if e["kind"] == "launch"]
    recorded_names = Counter(kernel_name(e.get("op_name")) for e in launches)
    reference_names = Counter()
    reference_by_api = Counter()
    for row in reference["launches"]:
        reference_names[kernel_name(row["name"])] += row["count"]
        reference_by_api[row["api"]] += row["count"]
    n_ref = sum(reference_by_api.values())
    named = sum(n for name, n in recorded_names.items() if name is not None)
    known = {name for name in reference_names if name is not None}
    duplicated = [{"name": name, "reference": reference_names[name], "recorded": n}
                  for name, n in recorded_names.items()
                  if name in known and n > reference_names[name]]
    missing = [{"name": name, "reference": n, "recorded": recorded_names.get(name, 0)}
               for name, n in reference_names.items()
               if name is not None and recorded_names.get(name, 0) < n]
    unmatched = [{"name": name, "recorded": n} for name, n in recorded_names.items()
                 if name is not None and name not in known]
    matching = sum(min(n, reference_names[name]) for name, n in recorded_names.items()
                   if name in known)
    by_api = Counter(e["api"] for e in launches)
    by_kind = Counter(e["kind"] for e in events)
    copies = Counter(e.get("direction") for e in events if e["kind"] == "memcpy")
    failed = Counter(e["api"] for e in events if e.get("ret") not in (None, 0))
    exactly_once = len(launches) == n_ref and not duplicated
    graphs = {"reference": reference["graph_launches"], "recorded": by_kind["graph_launch"]}
    memcpy = {d: {"reference": n, "recorded": copies.get(d, 0)}
              for d, n in reference.get("memcpy", {}).items()}
    return {
        "reference_launches": n_ref,
        "recorded_launches": len(launches),
        "reference_by_api": dict(sorted(reference_by_api.items())),
        "recorded_by_api": dict(sorted(by_api.items())),
        "recorded_by_layer": {layer: sum(n for api, n in by_api.items()
                                         if layer_of(api) == layer)
                              for layer in ("runtime", "driver")},
        "exactly_once": exactly_once,
        "duplicated": sorted(duplicated, key=lambda d: -d["recorded"])[:10],
        "missing": sorted(missing, key=lambda d: -d["reference"])[:10],
        "unmatched_names": sorted(unmatched, key=lambda d: -d["recorded"])[:10],
        "named_share": named / len(launches) if launches else None,
        "names_matching_share": matching / n_ref if n_ref else None,
        "graph_launches": graphs,
        "graph_kernels": reference.get("graph_kernels"),
        "memcpy": memcpy,
        "syncs": {"reference": reference.get("syncs"), "recorded": by_kind["sync"]},
        "failed_calls": dict(sorted(failed.items())),
        "ok": (exactly_once and graphs["reference"] == graphs["recorded"]
               and all(m["reference"] == m["recorded"] for m in memcpy.values())),
    }


# ----- NVML against nvidia-smi ------------------------------------------------

# nvidia-smi's field, NVML's (a DeviceState attribute and a scale into
# nvidia-smi's unit), and how far apart two reads may be.
SMI_FIELDS = {
    "name": ("name", None, None),
    "pci.bus_id": ("bus_id", None, None),
    "memory.total": ("memory_total_bytes", 1 / 2**20, 1.0),     # MiB
    "memory.used": ("memory_used_bytes", 1 / 2**20, 64.0),
    "utilization.gpu": ("sm_util", 100, 10.0),                   # %
    "utilization.memory": ("mem_bw_util", 100, 10.0),
    "temperature.gpu": ("temperature_c", 1, 3.0),                # C
    "power.draw": ("power_w", 1, 0.1),                           # W; a tenth of the value
}


def smi_query() -> list[str]:
    """nvidia-smi's arguments for every field compared."""
    return ["--query-gpu=index," + ",".join(SMI_FIELDS), "--format=csv,noheader,nounits"]


def parse_smi(text: str) -> list[dict]:
    """The rows of `nvidia-smi` run with smi_query()'s arguments."""
    rows = []
    for line in text.strip().splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(SMI_FIELDS) + 1:
            raise ValueError(f"nvidia-smi: expected {len(SMI_FIELDS) + 1} comma-separated "
                             f"fields (index,{','.join(SMI_FIELDS)}), got {line!r}")
        rows.append({"index": int(cells[0]), **dict(zip(SMI_FIELDS, cells[1:]))})
    return rows


def bus_id(text: str) -> str:
    """A PCI bus id in one spelling: NVML and nvidia-smi may pad the domain
    differently (00000000:17:00.0, 0000:17:00.0)."""
    parts = text.strip().lower().split(":")
    try:
        return ":".join([f"{int(parts[0], 16):04x}", *parts[1:]]) if len(parts) == 3 else text
    except ValueError:
        return text


def compare_nvml(before: list, smi_rows: list[dict], after: list) -> dict:
    """NVML read just before and just after nvidia-smi (lists of
    DeviceState), against nvidia-smi's rows: each field of each device
    agrees when nvidia-smi's value lies within NVML's two reads, widened
    by the field's tolerance. Names and bus ids must be equal."""
    devices = []
    ok = len(before) == len(smi_rows) == len(after)
    for smi in smi_rows:
        i = smi["index"]
        if i >= len(before) or i >= len(after):
            devices.append({"index": i, "ok": False, "fields": {},
                            "error": f"nvidia-smi lists GPU {i}, NVML {len(before)} GPUs"})
            ok = False
            continue
        fields = {}
        for field, (attr, scale, tolerance) in SMI_FIELDS.items():
            a, b = getattr(before[i], attr), getattr(after[i], attr)
            said = smi[field]
            if scale is None:
                agree = (bus_id(said) == bus_id(a) == bus_id(b) if field == "pci.bus_id"
                         else said == a == b)
                fields[field] = {"nvml": a, "nvidia_smi": said, "agree": agree}
                continue
            try:
                value = float(said)
            except ValueError:        # [N/A], [Not Supported]
                fields[field] = {"nvml": a * scale, "nvidia_smi": said, "agree": None}
                continue
            low, high = sorted((a * scale, b * scale))
            slack = tolerance * max(abs(high), 1.0) if field == "power.draw" else tolerance
            fields[field] = {"nvml": round(a * scale, 3), "nvidia_smi": value,
                             "agree": low - slack <= value <= high + slack}
        agree = all(f["agree"] is not False for f in fields.values())
        ok = ok and agree
        devices.append({"index": i, "name": smi["name"], "ok": agree, "fields": fields})
    return {"ok": ok and bool(smi_rows), "devices": devices,
            "nvml_devices": len(before), "nvidia_smi_devices": len(smi_rows)}
