"""`mmtrace doctor`'s check of the GPU/NPU probes: load the programs,
attach to every library discovery finds (as `record` would), report each
probe's state, detach. Like ebpf_exporter's --config.check: what attaches
here attaches when tracing."""

from collections import Counter
from pathlib import Path

from mmtrace.agent.findings import Check

NAME = "gpu_npu_probes"
UNTRACEABLE = "untraceable_cuda"


def device_checks(host, ready: bool, *, compile_apart: bool = False) -> list[Check]:
    """The probes check, and the files running CUDA code that no probe can
    reach, from one discovery scan (as `record` would make it).
    `compile_apart`: as for probes.load_cpu."""
    if not ready:
        return [Check(NAME, False, False, "not tried: fix the MISSING lines first")]
    if Path(host.proc) != Path("/proc") or Path(host.sys) != Path("/sys"):
        return [Check(NAME, False, False, "not tried on an injected host root")]
    from mmtrace.agent.kernel.probed_symbols import wanted
    from mmtrace.agent.discovery.discoverer import Discoverer
    discoverer = Discoverer(wanted)
    targets = discoverer.poll()
    return [check_device_probes(targets, compile_apart=compile_apart),
            check_untraceable(discoverer.untraceable)]


def check_untraceable(untraceable: dict[str, str]) -> Check:
    """Not required: names each file found that runs CUDA code no probe can
    reach (a stripped executable with a static runtime), and why."""
    if not untraceable:
        return Check(UNTRACEABLE, True, False, "every file found running CUDA code can be "
                     "probed")
    detail = "; ".join(f"{path}: {why}" for path, why in sorted(untraceable.items()))
    return Check(UNTRACEABLE, False, False,
                 f"{len(untraceable)} file(s) cannot be traced: " + detail)


def check_device_probes(targets: list, *, compile_apart: bool = False) -> Check:
    """Not required: a host without GPU/NPU libraries still traces the CPU.
    Loads the programs (`compile_apart`: as for probes.load_cpu) and
    attaches to `targets`, then detaches."""
    from mmtrace.agent.kernel import probes
    from mmtrace.agent.errors import MmtraceError
    from mmtrace.agent.kernel.device_compile import DEVICE_PROGRAMS
    if not targets:
        return Check(NAME, True, False, "no CUDA or Ascend library found to probe "
                     "(the CPU stream is unaffected)", "mmtrace record --lib PATH adds one")
    try:
        loaded = probes.load_cpu(probes.ProbeOptions(), compile_apart=compile_apart)
    except MmtraceError as exc:
        return Check(NAME, False, False, f"not tried: the scheduler program did not load: {exc}")
    try:
        loaded.load_device()
    except MmtraceError as exc:
        loaded.close()
        return Check(NAME, False, False,
                     f"the GPU/NPU programs ({DEVICE_PROGRAMS}) did not compile or load, so no "
                     f"library is probed; the CPU stream is unaffected: {exc}")
    try:
        for target in targets:
            loaded.device.add(target)
        states = loaded.device.states()
        mode = loaded.device.mode
    finally:
        loaded.close()
    return summarise(states, mode)


def summarise(states: list[dict], mode: str) -> Check:
    """Counted as `run --check` and the metrics count them: the per-launch
    probes apart, since the daemon holds them until an alarm by default."""
    from mmtrace.bpf import device as device_stream
    per_launch = {api.name for api in device_stream.default_table().apis if api.per_launch}
    by_state = Counter()
    launches = 0
    for s in states:
        by_state[s["state"]] += s.get("count", 1)
        if s["state"] == "attached" and s.get("api") in per_launch:
            launches += s.get("count", 1)
    libraries = sorted({s["path"] for s in states})
    failed = [s for s in states if s["state"] == "failed"]
    detail = (f"{len(libraries)} libraries ({mode} attach): "
              f"{by_state['attached'] - launches} probes attached, and {launches} per-launch "
              "probes attach too (the daemon holds those until an alarm unless "
              "adaptive_launches is off), "
              f"{by_state['not_found']} symbols not in their library, "
              f"{by_state['failed']} failed")
    if failed:
        detail += "; failed: " + "; ".join(_failures(failed))
        return Check(NAME, False, False, detail,
                     "see `mmtrace doctor --json`; a replaced library is picked up on the "
                     "next discovery")
    return Check(NAME, True, False, detail)


MAX_FAILURES_SHOWN = 5


def _failures(failed: list[dict]) -> list[str]:
    """Each failed probe once, as PATH:SYMBOL (points): reason; the first
    MAX_FAILURES_SHOWN, then how many more."""
    by_probe: dict[tuple, list[str]] = {}
    for s in failed:
        by_probe.setdefault((s["path"], s["symbol"], s["reason"]), []).append(s["point"])
    lines = [f"{path}:{symbol} ({', '.join(points)}): {reason}"
             for (path, symbol, reason), points in list(by_probe.items())[:MAX_FAILURES_SHOWN]]
    if len(by_probe) > MAX_FAILURES_SHOWN:
        lines.append(f"and {len(by_probe) - MAX_FAILURES_SHOWN} more")
    return lines
