"""The GPU check: one command that proves mmtrace's GPU stream on a host with
an NVIDIA GPU, a driver and PyTorch, and writes what it found as one JSON
and one text summary.

1. eBPF: mmtrace doctor's prerequisites, then a tiny tracepoint program
   (sched_process_fork) and a uprobe (libc's getpid) that must see this
   process. Where eBPF does not work (some sandboxes refuse bpf()), it
   says why and goes on with what needs none (5).
2. Recording: a decode-like PyTorch loop (bench/gpu_workload.py: layer
   norms, matmuls through cuBLAS, softmax, a cuDNN convolution, a CUDA
   graph replay, copies both ways, syncs) under `mmtrace record --pid`.
3. Against torch.profiler's kernel list for the same steps: every launch
   recorded exactly once whichever layer made it (cudaLaunchKernel in
   libcudart, cuLaunchKernel[Ex] in libcuda as cuBLAS 13 and Triton call
   it), the share of launches named, and named as the profiler names them,
   graph launches, copies per direction, syncs.
4. The cost of a launch on the real driver: a loop of empty kernels
   (bench/launch_loop_gpu.cu, built with nvcc) untraced, with an empty bcc
   uprobe on cudaLaunchKernel, and with mmtrace's probes, side by side,
   interleaved, the fastest of --repeat rounds each.
5. NVML's gauges (mmtrace's own reader) against `nvidia-smi --query-gpu`,
   read between two NVML reads.

--rehearse runs the same steps on a host with no GPU: the workload is
tests/native/decode_loop.c (NVIDIA's real libcudart from the PyPI wheel and
a stand-in libcuda built with gcc), whose own list of what it submitted
plays the profiler's part; the launch loop is tests/native/launch_loop.c;
NVML is the stand-in libnvidia-ml and nvidia-smi a stand-in script on
PATH that reads the same state. --bundle DIR gathers, on a host with apt
and pip, what a host with no package registry needs (bench/gpu_bundle.py);
--from-bundle DIR uses it there.

Exit status: 0 when every step that ran passed, 1 when one failed or could
not run, 2 for bad usage or a bundle that cannot be built or used.
"""

import argparse
import dataclasses
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "tests")]

import gpu_bundle  # noqa: E402
import gpu_compare  # noqa: E402

PREPARED = "MMTRACE_GPU_CHECK_PREPARED"     # set once the bundle's environment is in place
DEFAULT_BUNDLE = ROOT / "gpu-bundle"
DEFAULT_OUT = ROOT / "bench" / "out" / "gpu_check"
SECTIONS = ("mode", "host", "ebpf", "recording", "launch_cost", "nvml", "bundle", "verdict")
STEPS = ("ebpf", "recording", "launch_cost", "nvml")

EXAMPLES = """
examples:
  on a GPU host with PyTorch (as root), the bundle carried beside the checkout:
    bench/gpu_check --from-bundle gpu-bundle -o /tmp/gpu-check
  here, on a host with apt and pip: gather the bundle (at most 50 MiB), then
  rehearse the check with no GPU:
    sudo bench/gpu_check --bundle gpu-bundle
    sudo bench/gpu_check --rehearse
  a shorter check, or only some of its steps:
    bench/gpu_check --steps 10 --no-compile --only recording --only nvml

It writes gpu_check.json and gpu_check.txt under -o (the text is also
printed). README.md, "On a GPU host", says how to read them.
"""


# ----- helpers ---------------------------------------------------------------------

class StepFailed(Exception):
    """A step could not run; the message says why."""


def read_line(proc: subprocess.Popen, timeout: float, what: str) -> str:
    """One line of `proc`'s stdout within `timeout` s."""
    got = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got:
        raise StepFailed(f"{what}: expected a line within {timeout:.0f} s, none came")
    if not got[0]:
        raise StepFailed(f"{what}: ended (exit status {proc.wait()}) before its line")
    return got[0]


def read_json(proc, timeout, what) -> dict:
    line = read_line(proc, timeout, what)
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise StepFailed(f"{what}: expected a JSON line, got {line[:200]!r}") from None


def end(proc: subprocess.Popen):
    """Close a workload's stdin (it exits then); kill it if it lingers."""
    if proc.poll() is None:
        try:
            proc.stdin.close()
            proc.wait(timeout=30)
        except (subprocess.TimeoutExpired, BrokenPipeError):
            proc.kill()
            proc.wait()


def kernel_has_headers() -> bool:
    """Whether bcc finds headers of the running kernel's own (before mmtrace
    can be imported: the doctor's kernel_headers check says more)."""
    build = Path("/lib/modules") / platform.release() / "build"
    return ((build / "include" / "generated" / "autoconf.h").exists()
            or Path("/sys/kernel/kheaders.tar.xz").exists())


def mapped(pid: int, pattern: str) -> str | None:
    """The first file process `pid` maps whose name matches `pattern`."""
    from mmtrace.agent.discovery.proc_maps import read_maps
    return next((path for path in read_maps(Path("/proc"), pid).paths
                 if path.startswith("/") and re.search(pattern, os.path.basename(path))), None)


# ----- the two targets: a real GPU, and the rehearsal's stand-ins -------------------

@dataclasses.dataclass
class Target:
    """What the steps run against."""
    rehearsal: bool
    workload: list                 # the command of the decode-like loop
    workload_env: dict
    launch_loop: Path | None       # speaks tests/native/launch_loop.c's protocol
    launch_loop_missing: str = ""
    smi_path: str = ""             # PATH for nvidia-smi
    ready_s: float = 120           # CUDA up, or compilation
    done_s: float = 600
    close: object = None


def real_target(args, work: Path) -> Target:
    from native import nvcc_build
    env = gpu_bundle.scrubbed_env(os.environ, work)
    trace = Path(args.out) / "torch_trace.json"
    cmd = [args.torch_python, str(HERE / "gpu_workload.py"), "--trace", str(trace)]
    if args.compile:
        cmd.append("--compile")
    loop, why = None, ""
    try:
        loop = nvcc_build(HERE / "launch_loop_gpu.cu", "-cudart", "shared",
                          name="launch_loop_gpu")
        why = "" if loop else "nvcc not found: the launch loop cannot be built"
    except RuntimeError as exc:
        why = str(exc)
    return Target(False, cmd, env, loop, why, os.environ.get("PATH", ""))


def rehearsal_target(args, work: Path) -> Target:
    from gpu_fixtures import build_library, build_program, cudart_path
    from nvml_standin import FakeGpu, build_standin, write_state
    import nvidia_smi_standin
    cudart = cudart_path()
    if cudart is None:
        raise StepFailed("the rehearsal needs the nvidia-cuda-runtime-cu12 wheel "
                         "(libcudart.so.12): scripts/setup --test installs it")
    if shutil.which("gcc") is None:
        raise StepFailed("the rehearsal needs gcc to build the stand-ins")
    build = Path(tempfile.mkdtemp(prefix="rehearsal-", dir=work))
    driver = build_library("cuda_driver_standin.c", build, "libcuda.so.1")
    decode = build_program("decode_loop.c", build, [cudart, driver])
    # The launch loop on a private copy of libcudart: a perf-event uprobe
    # does not attach (EINVAL) beside uprobes that another tracer left on the
    # same file (the recorder's, while the kernel detaches them).
    private = build / "private" / cudart.name
    private.parent.mkdir()
    shutil.copy(cudart, private)
    loop = build_program("launch_loop.c", private.parent, [private])
    # NVML: the stand-in library, loaded here before pynvml looks for it by
    # its soname, and a stand-in nvidia-smi reading the same state.
    import ctypes
    nvml = build_standin(build / "nvml")
    state = build / "nvml" / "gpus"
    write_state(state, [FakeGpu("0000:17:00.0", name="StandinH100", sm_pct=37, membw_pct=12,
                                used_bytes=3 << 30, temp_c=41, power_mw=118_250),
                        FakeGpu("0000:18:00.0", name="StandinH100", sm_pct=0,
                                used_bytes=512 << 20, temp_c=35, power_mw=71_000)])
    os.environ["MMTRACE_NVML_STATE"] = str(state)
    ctypes.CDLL(str(nvml), mode=ctypes.RTLD_GLOBAL)
    smi = nvidia_smi_standin.install_standin(build / "bin")
    return Target(True, [str(decode)], dict(os.environ), loop,
                  smi_path=f"{smi.parent}:{os.environ.get('PATH', '')}", ready_s=30, done_s=120,
                  close=lambda: shutil.rmtree(build, ignore_errors=True))


# ----- step 1: eBPF ------------------------------------------------------------------

TINY_PROGRAM = r"""
BPF_ARRAY(hits, u64, 2);
TRACEPOINT_PROBE(sched, sched_process_fork)
{
    if (args->parent_pid == TARGET) {
        int k = 0;
        hits.increment(k);
    }
    return 0;
}
int on_getpid(struct pt_regs *ctx)
{
    if (bpf_get_current_pid_tgid() >> 32 == TARGET) {
        int k = 1;
        hits.increment(k);
    }
    return 0;
}
"""


def mount_tracefs() -> list[str]:
    """Mount tracefs and debugfs where they are not (bcc 0.26 reads
    tracepoints through debugfs), as scripts/setup does; what was done."""
    done = []
    for path, fs, where in (("/sys/kernel/tracing/events", "tracefs", "/sys/kernel/tracing"),
                            ("/sys/kernel/debug/tracing/events", "debugfs", "/sys/kernel/debug")):
        if not os.path.exists(path):
            result = subprocess.run(["mount", "-t", fs, "nodev", where], capture_output=True,
                                    text=True)
            done.append(f"mount -t {fs} {where}: "
                        + ("done" if result.returncode == 0 else result.stderr.strip()))
    return done


def check_ebpf() -> dict:
    """Doctor's prerequisites, then the tiny programs."""
    out = {"ok": False, "mounted": mount_tracefs()}
    from mmtrace.agent.doctor import host as doctor
    h = doctor.Host()
    checks = [doctor.check_privileges(h), doctor.check_tracefs(h), doctor.check_uprobes(h),
              doctor.check_kernel_headers(h), doctor.check_ringbuf()]
    try:
        from mmtrace.agent.kernel.bcc_module import check_bcc
        checks.append(check_bcc())
    except Exception as exc:       # bcc's module may fail to import at all
        out["reason"] = f"bcc does not import: {exc}"
        return out
    out["doctor"] = {c.name: {"ok": c.ok, "detail": c.detail} for c in checks}
    missing = [f"{c.name}: {c.detail}" for c in checks if c.required and not c.ok]
    try:
        import bcc
        out["bcc"] = os.path.dirname(bcc.__file__)
        out["libbcc"] = mapped(os.getpid(), r"^libbcc\.so")
        program = bcc.BPF(text=TINY_PROGRAM, cflags=[f"-DTARGET={os.getpid()}"])
    except Exception as exc:
        out["reason"] = "; ".join(missing + [f"the tiny program did not load: "
                                             f"{str(exc).strip().splitlines()[-1]}"])
        return out
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        program.attach_uprobe(name="c", sym="getpid", fn_name="on_getpid")
        calls = 10
        for _ in range(calls):
            libc.getpid()
        subprocess.run(["true"])
        hits = program["hits"]
        forks, getpids = hits[0].value, hits[1].value
    except Exception as exc:
        out["reason"] = f"the tiny program did not attach: {exc}"
        return out
    finally:
        program.cleanup()
    out.update(tracepoint_forks=forks, uprobe_calls=getpids, uprobe_expected=calls)
    out["ok"] = forks >= 1 and getpids >= calls
    if not out["ok"]:
        out["reason"] = (f"expected at least 1 fork and {calls} getpid calls seen, "
                         f"got {forks} and {getpids}")
    elif missing:
        out["note"] = "; ".join(missing)
    return out


# ----- steps 2 and 3: the recording against the reference ----------------------------

def run_mmtrace(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmtrace.agent", *map(str, args)],
                          capture_output=True, text=True, **kw)


def check_recording(target: Target, steps: int, out_dir: Path) -> dict:
    recording = out_dir / "gpu_check.mmtr"
    recording.unlink(missing_ok=True)
    workload = subprocess.Popen(target.workload, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=target.workload_env)
    recorder = None
    stderr: list[str] = []
    try:
        first = read_json(workload, target.ready_s, "the workload")
        pid = first["pid"]
        recorder = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o",
                                     str(recording), "--pid", str(pid)],
                                    stderr=subprocess.PIPE, text=True)
        live = threading.Event()

        def follow():
            for line in recorder.stderr:
                stderr.append(line)
                if "gpu/npu stream live" in line:
                    live.set()
            live.set()
        threading.Thread(target=follow, daemon=True).start()
        if not live.wait(120) or recorder.poll() is not None:
            raise StepFailed("mmtrace record did not go live: " + "".join(stderr)[-800:])
        workload.stdin.write(f"go {steps}\n")
        workload.stdin.flush()
        reference = read_json(workload, target.done_s, "the workload's steps")
        time.sleep(0.5)
    finally:
        if recorder is not None and recorder.poll() is None:
            recorder.send_signal(signal.SIGINT)
            recorder.wait(timeout=120)
        end(workload)
    if recorder.returncode != 0:
        raise StepFailed(f"mmtrace record exited {recorder.returncode}: "
                         + "".join(stderr)[-800:])
    from mmtrace.agent.recording.file_format import RecordingReader
    from mmtrace.bpf.counters import losses, stream_of
    with RecordingReader(recording) as reader:
        footer = reader.footer
    exported = run_mmtrace("export", recording, "--format", "jsonl", "-o", "-")
    if exported.returncode != 0:
        raise StepFailed(f"mmtrace export exited {exported.returncode}: {exported.stderr}")
    lines = [json.loads(line) for line in exported.stdout.splitlines() if line]
    events = gpu_compare.window_events(lines, pid, reference["window_ns"])
    result = gpu_compare.compare(reference, events)
    lost = losses(footer["counters"])
    result.update(workload={k: v for k, v in first.items() if k != "pid"}, steps=steps,
                  recorded_events=footer["events"],
                  lost_device_events={k: n for k, n in lost.items() if stream_of(k) == "dev"},
                  lost_cpu_events={k: n for k, n in lost.items() if stream_of(k) == "cpu"},
                  name_resolution=footer.get("name_resolution"), recording=str(recording))
    for key in ("compile", "window_found"):
        if key in reference:
            result[key] = reference[key]
    # The CPU stream's losses (switch-ins the kernel never reported) are
    # told, not held against the GPU stream.
    result["ok"] = result["ok"] and not result["lost_device_events"]
    return result


# ----- step 4: the cost of a launch --------------------------------------------------

def check_launch_cost(target: Target, iterations: int, per_sync: int, repeat: int) -> dict:
    """ns per launch untraced, with an empty uprobe, with mmtrace; the loop
    launches `per_sync` kernels, then copies and syncs, `iterations` times
    per run."""
    if target.launch_loop is None:
        raise StepFailed(target.launch_loop_missing)
    import bcc
    import launch_pieces
    from bench_gpu_probes import EMPTY_PROGRAM, RING_PAGES, Loop, _drain, empty_multi_link
    from mmtrace.agent.kernel import probes
    from mmtrace.agent.kernel.probed_file import target_from_path
    from mmtrace.bpf import device
    try:
        loop = Loop(target.launch_loop, launch_only=False)
    except (IndexError, ValueError):      # no "ready PID" line: it ended (its stderr says why)
        raise StepFailed(f"{target.launch_loop} did not start: expected 'ready PID' on its "
                         "stdout, it ended first (its message is on stderr)") from None
    runtime = mapped(loop.pid, r"^libcudart\.so") or str(target.launch_loop)
    driver = mapped(loop.pid, r"^libcuda\.so")
    libs = [p for p in (runtime, driver) if p]
    options = probes.ProbeOptions(pids=(loop.pid,), dev_ringbuf_pages=RING_PAGES)
    # The empty program is attached as mmtrace attaches (a uprobe_multi link
    # where the kernel has them): the kernel refuses a uprobe whose kind
    # differs from one it still holds at the same place (ref_ctr_offset
    # mismatch), and the comparison is then like for like.
    mode = probes.attach_mode(options)
    traced = probes.load(options)
    launches = iterations * per_sync
    delivered = []

    def untraced():
        return loop.run(iterations, per_sync)

    if mode == "multi":
        empty, _ = empty_multi_link(runtime, attach=False)

        def empty_uprobe():
            _, link = empty_multi_link(runtime, program=empty)
            try:
                return loop.run(iterations, per_sync)
            finally:
                link.close()
    else:
        empty = bcc.BPF(text=EMPTY_PROGRAM)

        def empty_uprobe():
            return launch_pieces.uprobe_run(empty, "empty", runtime, loop, iterations,
                                            drain=False, run_args=(per_sync,))

    def mmtrace():
        targets = [target_from_path(p) for p in libs]
        for t in targets:
            traced.device.add(t)
        try:
            return loop.run(iterations, per_sync)
        finally:
            traced.device.release(targets)
            batches = _drain(traced)
            delivered.append(sum(int(((b["kind"] == device.KIND_IDS["launch"])
                                      & (b["pid"] == loop.pid)).sum()) for b in batches))
    try:
        best = launch_pieces.interleaved_best(loop, iterations, repeat, {
            "untraced": untraced, "empty_uprobe": empty_uprobe, "mmtrace": mmtrace})
    finally:
        loop.close()
        empty.cleanup()
        traced.close()
    ns = {k: v / launches * 1e9 for k, v in best.items()}
    # Every host-wide tracer (a `mmtrace record` without --pid, the daemon)
    # probes every CUDA library a process maps, this loop's too.
    note = ("the untraced loop was no faster than the empty uprobe: another tracer "
            "probes these libraries (a host-wide mmtrace?)"
            if ns["untraced"] >= ns["empty_uprobe"] else None)
    return {"note": note, "ok": True, "launches_per_run": launches, "per_sync": per_sync, "repeat": repeat,
            "attach_mode": mode, "probed": libs, "untraced_ns": ns["untraced"],
            "empty_uprobe_ns": ns["empty_uprobe"],
            "mmtrace_ns": ns["mmtrace"],
            "mmtrace_vs_empty": ns["mmtrace"] / ns["empty_uprobe"],
            "mmtrace_vs_untraced": ns["mmtrace"] / ns["untraced"],
            "mmtrace_events_per_launch": min(delivered) / launches}


# ----- step 5: NVML against nvidia-smi -------------------------------------------------

def check_nvml(target: Target) -> dict:
    from mmtrace.exporters.devices import nvml
    smi = shutil.which("nvidia-smi", path=target.smi_path)
    if smi is None:
        raise StepFailed("nvidia-smi is not on PATH")
    try:
        lib = nvml.load_pynvml()
    except RuntimeError as exc:
        raise StepFailed(str(exc)) from None
    try:
        before = nvml.read_devices(lib)
        result = subprocess.run([smi, *gpu_compare.smi_query()], capture_output=True,
                                text=True, timeout=60)
        after = nvml.read_devices(lib)
    finally:
        lib.nvmlShutdown()
    if result.returncode != 0:
        raise StepFailed(f"nvidia-smi exited {result.returncode}: {result.stderr.strip()}")
    out = gpu_compare.compare_nvml(before, gpu_compare.parse_smi(result.stdout), after)
    out["nvidia_smi"] = smi
    return out


# ----- the summary -------------------------------------------------------------------------

def host_facts() -> dict:
    import mmtrace.agent
    return {"kernel": platform.release(), "machine": platform.machine(),
            "python": platform.python_version(), "python_path": sys.executable,
            "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
            "mmtrace": list(mmtrace.agent.__path__)[0]}


def bundle_facts(bundle: Path | None, used: dict | None) -> dict:
    if bundle is None or not (bundle / "MANIFEST.json").exists():
        return {"ok": None, "path": None, "note": "no bundle here: its size is not checked"}
    size = gpu_bundle.folder_bytes(bundle)
    return {"ok": size <= gpu_bundle.LIMIT_BYTES, "path": str(bundle), "bytes": size,
            "limit_bytes": gpu_bundle.LIMIT_BYTES, "used": used}


def _counts(counts: dict) -> str:
    return ", ".join(f"{n:,} {name}" for name, n in counts.items()) or "none"


def _or_na(x) -> str:
    return "n/a" if x is None else str(x)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def text_summary(s: dict) -> str:
    """One line per section, the same sections in a rehearsal and a real run."""
    lines = {}
    lines["mode"] = ("rehearsal: no GPU; NVIDIA's libcudart from PyPI, stand-in libcuda, "
                     "libnvidia-ml and nvidia-smi" if s["mode"] == "rehearsal"
                     else "real GPU, driver and PyTorch")
    h = s["host"]
    lines["host"] = (f"Linux {h['kernel']} {h['machine']}, Python {h['python']}, {h['glibc']}, "
                     f"mmtrace from {h['mmtrace']}"
                     + (f", GPU {h['gpu']}" if h.get("gpu") else ""))
    for step in STEPS:
        r = s[step]
        if r.get("skipped"):
            lines[step] = f"skipped: {r['skipped']}"
        elif r.get("error"):
            lines[step] = f"FAILED: {r['error']}"
    e = s["ebpf"]
    if "ebpf" not in lines:
        lines["ebpf"] = (f"{'ok' if e['ok'] else 'FAILED'}: a tracepoint saw "
                         f"{e.get('tracepoint_forks', 0)} fork(s), a uprobe "
                         f"{e.get('uprobe_calls', 0)} of {e.get('uprobe_expected', 0)} getpid "
                         f"calls; bcc {e.get('bcc')}, libbcc {e.get('libbcc')}"
                         + (f" ({e['reason']})" if e.get("reason") else "")
                         + (f"; note: {e['note']}" if e.get("note") else ""))
    r = s["recording"]
    if "recording" not in lines:
        layers = r["recorded_by_layer"]
        copies = ", ".join(f"{d} {m['recorded']}/{m['reference']}" for d, m in r["memcpy"].items())
        failed = _counts(r["failed_calls"])
        lines["recording"] = (
            f"{'ok' if r['ok'] else 'FAILED'}: {r['recorded_launches']} launches recorded for "
            f"{r['reference_launches']} in the reference "
            f"({'each once' if r['exactly_once'] else 'NOT each once'}; "
            f"runtime layer {layers['runtime']}, driver layer {layers['driver']}); "
            f"named {_pct(r['named_share'])}, as the reference names them "
            f"{_pct(r['names_matching_share'])}; graph launches "
            f"{r['graph_launches']['recorded']}/{r['graph_launches']['reference']}"
            f" (kernels inside them: {_or_na(r['graph_kernels'])}); copies {copies or 'none'}; "
            "syncs "
            f"{r['syncs']['recorded']}/{r['syncs']['reference']}; failed calls: {failed}; "
            f"GPU events lost: {_counts(r['lost_device_events'])} (CPU stream: "
            f"{_counts(r['lost_cpu_events'])})")
        for key in ("duplicated", "missing", "unmatched_names"):
            for row in r[key][:3]:
                lines["recording"] += f"\n              {key}: {row}"
    c = s["launch_cost"]
    if "launch_cost" not in lines:
        lines["launch_cost"] = (
            f"per launch: untraced {c['untraced_ns']:,.0f} ns, empty uprobe "
            f"{c['empty_uprobe_ns']:,.0f} ns, mmtrace {c['mmtrace_ns']:,.0f} ns "
            f"({c['mmtrace_vs_empty']:.3f}x the empty uprobe, {c['mmtrace_vs_untraced']:.3f}x "
            f"untraced); mmtrace events per launch {c['mmtrace_events_per_launch']:.2f}"
            + (f"; note: {c['note']}" if c["note"] else ""))
    n = s["nvml"]
    if "nvml" not in lines:
        off = [f"GPU {d['index']} {f}: NVML {v['nvml']} vs nvidia-smi {v['nvidia_smi']}"
               for d in n["devices"] for f, v in d["fields"].items() if v["agree"] is False]
        lines["nvml"] = (f"{'ok' if n['ok'] else 'FAILED'}: {n['nvml_devices']} GPU(s) by NVML, "
                         f"{n['nvidia_smi_devices']} by nvidia-smi; "
                         + (", ".join(off) if off else
                            "every field within NVML's two reads "
                            f"({', '.join(gpu_compare.SMI_FIELDS)})"))
    b = s["bundle"]
    lines["bundle"] = (b["note"] if b["ok"] is None else
                       f"{'ok' if b['ok'] else 'OVER THE LIMIT'}: {b['path']}: "
                       f"{b['bytes'] / 2**20:.1f} MiB of {b['limit_bytes'] / 2**20:.0f} MiB")
    v = s["verdict"]
    lines["verdict"] = v["result"] + (f" ({', '.join(v['failed'])} failed)" if v["failed"]
                                      else "")
    title = "mmtrace GPU check"
    return title + "\n" + "\n".join(f"{k:<13} {lines[k]}" for k in SECTIONS) + "\n"


def verdict(s: dict) -> dict:
    failed = [k for k in (*STEPS, "bundle") if s[k].get("ok") is False]
    ran = [k for k in STEPS if not s[k].get("skipped")]
    return {"result": "fail" if failed else "pass", "failed": failed, "ran": ran}


# ----- main ------------------------------------------------------------------------------

def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="bench/gpu_check", description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--rehearse", action="store_true",
                      help="run the check here, with no GPU, against the PyPI libcudart and "
                           "the stand-ins")
    mode.add_argument("--bundle", metavar="DIR", type=Path,
                      help="gather what a host with no package registry needs into DIR "
                           "(at most 50 MiB; replaced whole); needs apt-get, pip, gcc")
    parser.add_argument("--from-bundle", metavar="DIR", type=Path, default=None,
                        help=f"use the bundle in DIR (default: {DEFAULT_BUNDLE.relative_to(ROOT)} "
                             "when it exists): bcc from it, the rest where the host lacks it")
    parser.add_argument("--bare-host", action="store_true",
                        help="use all of the bundle, as on a host that has none of it: every "
                             "library (the stubs too), every wheel, its kernel headers "
                             "(through BCC_KERNEL_SOURCE); to rehearse such a host here")
    parser.add_argument("-o", "--out", type=Path, default=DEFAULT_OUT,
                        help="where gpu_check.json, gpu_check.txt and the recording go "
                             "(default: %(default)s)")
    parser.add_argument("--work", type=Path,
                        default=Path(tempfile.gettempdir()) / "mmtrace-gpu-check",
                        help="where the bundle is unpacked and stand-ins built "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=None,
                        help="decode steps under the profiler (default: 20; rehearsal 200)")
    parser.add_argument("--iterations", type=int, default=1000,
                        help="launch-cost loop: iterations per run, each --per-sync launches "
                             "then a copy and a sync (default: %(default)s)")
    parser.add_argument("--per-sync", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5,
                        help="launch-cost rounds; the fastest of each counts "
                             "(default: %(default)s)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help='include torch.compile(mode="reduce-overhead") (default: on)')
    parser.add_argument("--torch-python", default=sys.executable,
                        help="the Python with PyTorch that runs the workload (default: this one)")
    parser.add_argument("--only", action="append", choices=STEPS,
                        help="run only these steps (repeatable)")
    args = parser.parse_args(argv)
    for name in ("steps", "iterations", "per_sync", "repeat"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a whole number >= 1, got {value}")
    if args.steps is None:
        args.steps = 200 if args.rehearse else 20
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.bundle is not None:
        try:
            manifest = gpu_bundle.build(args.bundle, log=lambda m: print(f"gpu_check: {m}",
                                                                          file=sys.stderr))
        except gpu_bundle.BundleError as exc:
            print(f"gpu_check: error: {exc}", file=sys.stderr)
            return 2
        print((args.bundle / "MANIFEST.txt").read_text(), end="")
        return 0
    bundle = args.from_bundle or (DEFAULT_BUNDLE if DEFAULT_BUNDLE.exists() else None)
    used = json.loads(os.environ[PREPARED]) if PREPARED in os.environ else None
    if bundle is not None and used is None:
        try:
            env, used = gpu_bundle.prepare(bundle, args.work,
                                           headers_wanted=not kernel_has_headers(),
                                           bare=args.bare_host)
        except gpu_bundle.BundleError as exc:
            print(f"gpu_check: error: {exc}", file=sys.stderr)
            return 2
        env[PREPARED] = json.dumps(used)
        os.execve(sys.executable, [sys.executable, __file__, *argv], env)
    return run_check(args, bundle, used)


def run_step(run) -> dict:
    """A step's result; one that could not run says why, and the check goes
    on with the next (a GPU host is at hand for minutes: one step's surprise
    must not cost the others)."""
    try:
        return run()
    except StepFailed as exc:
        return {"ok": False, "error": str(exc)}
    except Exception as exc:
        import traceback
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()}


def run_check(args, bundle, used) -> int:
    out_dir = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    wanted = set(args.only or STEPS)
    summary = {"mode": "rehearsal" if args.rehearse else "real", "host": host_facts()}
    target = None
    try:
        try:
            target = (rehearsal_target if args.rehearse else real_target)(args, args.work)
        except StepFailed as exc:
            target = None
            setup_error = str(exc)
        for step in STEPS:
            summary[step] = {"skipped": "not asked for (--only)"} if step not in wanted else None
        if summary["ebpf"] is None:
            summary["ebpf"] = run_step(check_ebpf)
        ebpf_ok = summary["ebpf"].get("ok", True)
        # The launch cost first: it attaches a perf-event uprobe, which the
        # recorder's links would stand in the way of while the kernel detaches them.
        for step, run in (("launch_cost", lambda: check_launch_cost(
                              target, args.iterations, args.per_sync, args.repeat)),
                          ("recording", lambda: check_recording(target, args.steps, out_dir)),
                          ("nvml", lambda: check_nvml(target))):
            if summary[step] is not None:
                continue
            if target is None:
                summary[step] = {"ok": False, "error": setup_error}
            elif step != "nvml" and not ebpf_ok:
                summary[step] = {"skipped": "eBPF does not work here (see ebpf)"}
            else:
                summary[step] = run_step(run)
        nvml_devices = summary["nvml"].get("devices") or []
        if nvml_devices:
            summary["host"]["gpu"] = ", ".join(sorted({d["name"] for d in nvml_devices}))
    finally:
        if target is not None and target.close:
            target.close()
    summary["bundle"] = bundle_facts(bundle, used)
    summary["verdict"] = verdict(summary)
    text = text_summary(summary)
    (out_dir / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out_dir / "gpu_check.txt").write_text(text)
    print(text, end="")
    print(f"wrote {out_dir / 'gpu_check.json'} and gpu_check.txt", file=sys.stderr)
    return 0 if summary["verdict"]["result"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
