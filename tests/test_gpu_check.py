"""bench/gpu_check, the check that proves the GPU stream on a real GPU: its
comparisons over plain data (a torch.profiler trace, a recording's events,
NVML against nvidia-smi), its rehearsal here with no GPU (the real
libcudart, the stand-ins, real eBPF), and the bundle a host with no package
registry gets (built with apt-get and pip, used as on a bare host)."""

import json
from collections import Counter
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bundle  # noqa: E402
import gpu_check  # noqa: E402
import gpu_compare  # noqa: E402

CHECK = ROOT / "bench" / "gpu_check"


# ----- a torch.profiler trace made into a reference ------------------------------------

def kineto_trace(calls, window=(1000.0, 9000.0), outside=()):
    """A Chrome trace as Kineto writes it: each call (api, [kernel names],
    copy name or None, ts) a runtime or driver event with its correlation
    id, its kernels and copies correlated to it; `outside` calls come after
    the window's annotation."""
    events = [{"ph": "X", "cat": "user_annotation", "name": gpu_compare.WINDOW_ANNOTATION,
               "ts": window[0], "dur": window[1] - window[0]}]
    for correlation, (api, kernels, copy, ts) in enumerate([*calls, *outside], start=7):
        cat = "cuda_runtime" if api.startswith("cuda") else "cuda_driver"
        events.append({"ph": "X", "cat": cat, "name": api, "ts": ts, "dur": 2,
                       "args": {"correlation": correlation}})
        for name in kernels:
            events.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts + 5, "dur": 3,
                           "args": {"correlation": correlation}})
        if copy:
            events.append({"ph": "X", "cat": "gpu_memcpy", "name": copy, "ts": ts + 5,
                           "dur": 3, "args": {"correlation": correlation}})
        events.append({"ph": "f", "cat": "ac2g", "id": correlation, "ts": ts})
    return {"traceEvents": events}


def test_a_profiler_trace_gives_each_launch_its_call_and_graph_kernels_apart():
    gemm = "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1>"
    norm = "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>"
    calls = [("cudaLaunchKernel", [norm], None, 1100.0),
             ("cuLaunchKernelEx", [gemm], None, 1200.0),
             ("cuLaunchKernel_ptsz", [gemm], None, 1300.0),
             ("cudaGraphLaunch", ["a", "b", "c"], None, 1400.0),
             ("cudaMemcpyAsync", [], "Memcpy HtoD (Pageable -> Device)", 1500.0),
             ("cudaMemcpyAsync", [], "Memcpy DtoH (Device -> Pageable)", 1600.0),
             ("cudaLaunchKernel", [], None, 1700.0),          # its kernel never seen
             ("cudaStreamSynchronize", [], None, 1800.0)]
    later = [("cudaLaunchKernel", [norm], None, 9500.0),
             ("cudaDeviceSynchronize", [], None, 9600.0)]
    ref = gpu_compare.reference_from_trace(kineto_trace(calls, outside=later))
    launched = [(gpu_compare.api_name(api), name) for api, kernels, _, _ in calls
                if gpu_compare.api_name(api) in gpu_compare.LAUNCH_APIS
                for name in (kernels or [None])]
    assert Counter({(r["api"], r["name"]): r["count"] for r in ref["launches"]}) == \
        Counter(launched)
    assert ref["graph_launches"] == 1 and ref["graph_kernels"] == 3
    assert ref["memcpy"] == {"h2d": 1, "d2h": 1}
    assert ref["syncs"] == 1 and ref["window_found"]


# ----- the recording against the reference ----------------------------------------------

REFERENCE = {"launches": [{"api": "cudaLaunchKernel", "name": "norm(float*)", "count": 2},
                          {"api": "cuLaunchKernelEx", "name": "gemv", "count": 1}],
             "graph_launches": 1, "graph_kernels": 4, "memcpy": {"h2d": 1, "d2h": 1},
             "syncs": 1}


def event(kind, api, name=None, direction=None, ts=100, pid=42, ret=None):
    return {"stream": "gpu", "kind": kind, "api": api, "op_name": name, "pid": pid,
            "ts_ns": ts, "direction": direction, "ret": ret}


def recorded_as_referenced():
    return [event("memcpy", "cudaMemcpyAsync", direction="h2d"),
            *[event("launch", row["api"], row["name"]) for row in REFERENCE["launches"]
              for _ in range(row["count"])],
            event("graph_launch", "cudaGraphLaunch"),
            event("memcpy", "cuMemcpyDtoHAsync", direction="d2h"),
            event("sync", "cudaStreamSynchronize")]


def test_a_recording_as_the_reference_passes_named_and_by_layer():
    out = gpu_compare.compare(REFERENCE, recorded_as_referenced())
    assert out["ok"] and out["exactly_once"]
    assert out["recorded_launches"] == out["reference_launches"] == sum(
        r["count"] for r in REFERENCE["launches"])
    assert out["recorded_by_layer"] == {"runtime": 2, "driver": 1}
    assert out["named_share"] == out["names_matching_share"] == 1.0
    assert out["graph_launches"] == {"reference": 1, "recorded": 1}
    assert out["duplicated"] == out["missing"] == out["unmatched_names"] == []


def test_a_launch_recorded_by_both_layers_is_no_pass_and_is_named():
    """The runtime's launch reaching the driver's probed cuLaunchKernel too
    would be counted twice: the check must say so, and which kernel."""
    events = recorded_as_referenced() + [event("launch", "cuLaunchKernel", "norm(float*)")]
    out = gpu_compare.compare(REFERENCE, events)
    assert not out["ok"] and not out["exactly_once"]
    assert out["duplicated"] == [{"name": "norm(float*)", "reference": 2, "recorded": 3}]
    assert out["recorded_by_layer"] == {"runtime": 2, "driver": 2}


def test_an_unnamed_launch_a_lost_graph_launch_and_other_windows_count_against():
    events = [e for e in recorded_as_referenced() if e["kind"] != "graph_launch"]
    events[1] = dict(events[1], op_name=None)
    events.append(event("launch", "cudaLaunchKernel", "norm(float*)", pid=7))
    out = gpu_compare.compare(REFERENCE, gpu_compare.window_events(events, 42, (50, 150)))
    assert out["exactly_once"] and not out["ok"]      # the graph launch is missing
    assert out["graph_launches"] == {"reference": 1, "recorded": 0}
    assert out["named_share"] == pytest.approx(2 / 3)
    assert out["missing"] == [{"name": "norm(float*)", "reference": 2, "recorded": 1}]


# ----- NVML against nvidia-smi ----------------------------------------------------------

@dataclass
class Gpu:
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:17:00.0"
    memory_total_bytes: int = 81559 << 20
    memory_used_bytes: int = 4000 << 20
    sm_util: float = 0.40
    mem_bw_util: float = 0.10
    temperature_c: float = 40.0
    power_w: float = 120.0


def smi_row(index: int, gpu: Gpu, **said) -> dict:
    row = {"index": index, "name": gpu.name, "pci.bus_id": gpu.bus_id.upper(),
           "memory.total": str(gpu.memory_total_bytes >> 20),
           "memory.used": str(gpu.memory_used_bytes >> 20),
           "utilization.gpu": str(round(gpu.sm_util * 100)),
           "utilization.memory": str(round(gpu.mem_bw_util * 100)),
           "temperature.gpu": str(gpu.temperature_c), "power.draw": f"{gpu.power_w:.2f}"}
    return row | said


def test_nvml_agrees_with_nvidia_smi_between_its_two_reads():
    before, after = [Gpu(bus_id="0000:17:00.0")], [Gpu(sm_util=0.60, bus_id="0000:17:00.0")]
    out = gpu_compare.compare_nvml(before, [smi_row(0, Gpu(sm_util=0.5))], after)
    assert out["ok"], out
    assert set(out["devices"][0]["fields"]) == set(gpu_compare.SMI_FIELDS)


def test_nvml_against_nvidia_smi_names_the_field_that_disagrees():
    gpu = Gpu()
    off = gpu.memory_used_bytes / 2**20 + 500
    out = gpu_compare.compare_nvml([gpu], [smi_row(0, gpu, **{"memory.used": str(off)},
                                                   **{"power.draw": "[N/A]"})], [gpu])
    assert not out["ok"]
    fields = out["devices"][0]["fields"]
    assert fields["memory.used"] == {"nvml": gpu.memory_used_bytes / 2**20, "nvidia_smi": off,
                                     "agree": False}
    assert fields["power.draw"]["agree"] is None      # not a disagreement: not reported
    assert [f for f, v in fields.items() if v["agree"] is False] == ["memory.used"]


def test_nvidia_smi_output_of_another_shape_is_refused_with_what_was_expected():
    with pytest.raises(ValueError, match=r"expected 9 comma-separated fields .* got '0, x'"):
        gpu_compare.parse_smi("0, x\n")


# ----- the command ---------------------------------------------------------------------

def test_help_teaches_with_examples():
    out = subprocess.run([str(CHECK), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for what in ("--rehearse", "--bundle DIR", "--from-bundle", "examples:",
                 "bench/gpu_check --rehearse", "On a GPU host"):
        assert what in out.stdout, what


def test_bad_values_end_in_one_line_and_exit_2():
    out = subprocess.run([str(CHECK), "--steps", "0"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "--steps: expected a whole number >= 1, got 0" in out.stderr
    out = subprocess.run([str(CHECK), "--rehearse", "--from-bundle", "/nonexistent"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "gpu_check: error: /nonexistent is no bundle: expected /nonexistent/MANIFEST.json "
        "(made by bench/gpu_check --bundle DIR)"]


def run_rehearsal(tmp_path, *extra) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run([str(CHECK), "--rehearse", "-o", str(tmp_path / "out"), "--work",
                          str(tmp_path / "work"), "--iterations", "300", "--repeat", "3",
                          *extra], capture_output=True, text=True, timeout=300)
    summary = tmp_path / "out" / "gpu_check.json"
    assert summary.exists(), out.stdout + out.stderr
    return out, json.loads(summary.read_text())


def assert_rehearsal_passed(out, s, tmp_path):
    assert out.returncode == 0, out.stdout + out.stderr
    assert s["verdict"] == {"result": "pass", "failed": [], "ran": list(gpu_check.STEPS)}
    e = s["ebpf"]
    assert e["ok"] and e["tracepoint_forks"] >= 1 and e["uprobe_calls"] >= e["uprobe_expected"]
    r = s["recording"]
    assert r["ok"] and r["exactly_once"], r
    # decode_loop's own list plays the profiler: every launch of both layers
    # once, named as it names them; every graph launch, copy and sync.
    assert r["recorded_launches"] == r["reference_launches"] > 0
    assert r["recorded_by_api"] == r["reference_by_api"]
    assert r["recorded_by_layer"]["runtime"] > 0 and r["recorded_by_layer"]["driver"] > 0
    assert r["named_share"] == r["names_matching_share"] == 1.0
    assert r["graph_launches"]["recorded"] == r["graph_launches"]["reference"] > 0
    assert all(m["recorded"] == m["reference"] > 0 for m in r["memcpy"].values())
    assert r["syncs"]["recorded"] == r["syncs"]["reference"] == r["steps"]
    assert r["lost_device_events"] == {}
    c = s["launch_cost"]
    assert c["mmtrace_events_per_launch"] == 1.0
    # Each of the three measured; which is faster is not asserted: on a shared
    # host another engineer's host-wide recorder probes every libcudart that a
    # process maps, this loop's private copy too (the summary notes it).
    assert min(c["untraced_ns"], c["empty_uprobe_ns"], c["mmtrace_ns"]) > 0
    assert (c["note"] is None) == (c["untraced_ns"] < c["empty_uprobe_ns"])
    n = s["nvml"]
    assert n["ok"] and n["nvml_devices"] == n["nvidia_smi_devices"] == 2
    # The text: every section on a line of its own, as a real run prints it.
    assert out.stdout == (tmp_path / "out" / "gpu_check.txt").read_text()
    labels = [line.split()[0] for line in out.stdout.splitlines()[1:] if not line.startswith(" ")]
    assert labels == list(gpu_check.SECTIONS)
    assert gpu_check.text_summary(dict(s, mode="real")).splitlines()[2:] == \
        out.stdout.splitlines()[2:]


@pytest.mark.bpf
@pytest.mark.slow
def test_the_rehearsal_passes_every_step_and_prints_the_real_runs_summary(tmp_path):
    out, s = run_rehearsal(tmp_path)
    assert_rehearsal_passed(out, s, tmp_path)
    assert s["mode"] == "rehearsal"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    dest = tmp_path_factory.mktemp("gpu-bundle") / "bundle"
    probe = subprocess.run(["apt-get", "download", "--print-uris", "libbpfcc"],
                           capture_output=True, text=True)
    if probe.returncode != 0 or "http" not in probe.stdout:
        pytest.skip(f"apt cannot download here: {(probe.stderr or probe.stdout).strip()}")
    out = subprocess.run([str(CHECK), "--bundle", str(dest)], capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
    return dest, out.stdout


@pytest.mark.bpf
@pytest.mark.slow
@pytest.mark.bundle
def test_the_bundle_is_within_50_mib_lists_its_contents_and_serves_a_bare_host(bundle,
                                                                              tmp_path):
    dest, printed = bundle
    manifest = json.loads((dest / "MANIFEST.json").read_text())
    size = gpu_bundle.folder_bytes(dest)
    assert size <= 50 * 2**20
    on_disk = {str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()}
    assert on_disk == set(manifest["files"]) | {"MANIFEST.json", "MANIFEST.txt"}
    assert printed == (dest / "MANIFEST.txt").read_text()
    assert printed.splitlines()[0].startswith(f"mmtrace GPU check bundle: {size:>12} bytes")
    for name in manifest["files"]:
        assert name in printed, name
    assert "libbcc.so.0" in manifest["libraries"]
    assert set(manifest["stubs"]) == set(gpu_bundle.STUBBED)
    # As on a host with none of it: every library (the stubs too), every
    # wheel and the headers from the bundle, and mmtrace from the checkout.
    out, s = run_rehearsal(tmp_path, "--from-bundle", str(dest), "--bare-host")
    assert_rehearsal_passed(out, s, tmp_path)
    work = str((tmp_path / "work").resolve())
    assert s["ebpf"]["bcc"].startswith(work) and s["ebpf"]["libbcc"].startswith(work)
    used = s["bundle"]["used"]
    assert sorted(used["stubs"]) == sorted(gpu_bundle.STUBBED)
    assert used["headers"].endswith("(BCC_KERNEL_SOURCE)")
    assert s["bundle"]["ok"] and s["bundle"]["bytes"] == size
    assert s["host"]["mmtrace"].startswith(work)
