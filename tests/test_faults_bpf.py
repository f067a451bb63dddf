"""Faults on real eBPF: the agent stays up through each, and every loss is
counted where an operator looks (the recording's footer, the metrics).

- 500 short-lived processes calling NVIDIA's real libcudart during a
  recording: each attributed, and the per-thread and per-process maps back
  to their size before;
- a traced library replaced on disk (renamed over, as package managers and
  `install` do): the old file keeps its probes, the new one is probed too;
- the device ring buffer overflowed while the daemon's drain is stopped:
  what was delivered plus what was counted lost is every call made;
- one probe the kernel refuses (a copy of libcudart whose
  cudaEventSynchronize starts with `hlt`, mapped by a process while the
  probes attach): every other probe traces, and `mmtrace doctor` and the
  metrics name it and say why;
- the GPU/NPU programs failing to compile (a syntax error appended to
  their source): the scheduler program traces on, and the metrics,
  `mmtrace doctor` and a recording's report name the programs and give
  the compiler's error;
- the disk filling up under `mmtrace record` (a 2 MiB tmpfs): one error
  line, exit 2, and the file reads back.

Covered elsewhere: the metrics port taken
(test_metrics.py::test_run_with_a_taken_port_exits_2_with_one_line) and
SIGHUP with a broken configuration (test_reload.py::test_sighup_on_the_running_daemon).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bpf_maps import bpf_maps_of, map_entries
from gpu_fixtures import (api_names, build_library, build_program,  # noqa: F401
                          natives)
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.discovery.elf_symbols import ElfSymbols
from test_metrics_bpf import Daemon, free_port, held
from test_sched_bpf import start_recorder, stop, wait_for_line

pytestmark = pytest.mark.bpf

CUDART_CALLS_APIS = ["cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
                     "cudaGraphLaunch", *["cudaMemcpyAsync"] * 5, "cudaMemcpy",
                     "cudaStreamSynchronize"]
PER_THREAD_MAPS = ("threads", "op_seq", "calls_in_flight")
# Kept past a process's exit on purpose, to name its kernels afterwards;
# least-recently-used maps, bounded by their size.
PER_PROCESS_LRU_MAPS = ("load_frames", "exe_paths")
HLT = b"\xf4"
KERNELS = {"vector_add(float const*, float const*, float*, int)", "kernel::softmax(float*, int)",
           "gelu(float*)"}


# ----- helpers ---------------------------------------------------------------

def map_sizes(maps: dict[str, dict], names) -> dict[str, int]:
    return {name: map_entries(maps[name]["id"]) for name in names}


def exposition(port: int) -> bytes:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()


def scrape(port: int) -> list:
    return [s for family in text_string_to_metric_families(exposition(port).decode())
            for s in family.samples]


def metric(samples, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(s.value for s in samples
               if s.name == name and labels.items() <= s.labels.items())


def scrape_when(port: int, name: str, at_least: float, **labels) -> list | None:
    """A scrape once `name` has reached `at_least`, else None."""
    samples = scrape(port)
    return samples if metric(samples, name, **labels) >= at_least else None


def wait_until(check, timeout: float = 30.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def run_loop(loop: subprocess.Popen, line: str):
    loop.stdin.write(line + "\n")
    loop.stdin.flush()
    assert loop.stdout.readline().startswith("done"), line


def launch_loop(program) -> subprocess.Popen:
    loop = subprocess.Popen([str(program)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    assert loop.stdout.readline().startswith("ready")
    return loop


def end(*procs):
    for proc in procs:
        if proc is not None and proc.poll() is None:
            if proc.stdin:
                proc.stdin.close()
            proc.kill()
            proc.wait(timeout=10)


def symbol_file_offset(lib, symbol: str) -> int:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True,
                         text=True, check=True).stdout
    vaddr = next(int(line.split()[0], 16) for line in out.splitlines()
                 if line.split()[-1].split("@")[0] == symbol)
    return ElfSymbols.read(str(lib)).segments.offset_of_vaddr(vaddr)


# ----- 500 short-lived processes ----------------------------------------------

def test_500_short_lived_processes_are_all_attributed_and_leave_no_map_entries(
        natives, tmp_path):  # noqa: F811
    path = tmp_path / "many.mmtr"
    recorder = start_recorder(path, "--lib", natives.cudart)
    pids = []
    try:
        maps = bpf_maps_of(recorder.pid)
        time.sleep(0.5)
        before = map_sizes(maps, PER_THREAD_MAPS)
        for _ in range(50):
            batch = [subprocess.Popen([str(natives.cudart_calls)], stdout=subprocess.PIPE,
                                      text=True) for _ in range(10)]
            for proc in batch:
                out, _ = proc.communicate(timeout=30)
                assert proc.returncode == 0
                pids.append(json.loads(out)["pid"])
        time.sleep(1.0)     # freed tasks leave the maps after an RCU grace period
        after = map_sizes(maps, PER_THREAD_MAPS)
        lru = map_sizes(maps, PER_PROCESS_LRU_MAPS)
    finally:
        out = stop(recorder)
    assert recorder.returncode == 0, out
    # The host runs other work meanwhile: a leak would be one entry per process.
    for name in PER_THREAD_MAPS:
        assert after[name] <= before[name] + 50, (name, before, after)
    assert after["calls_in_flight"] == 0, after
    assert all(lru[name] <= maps[name]["max_entries"] for name in lru), lru

    rec = recording.read_recording(path)
    assert rec.complete and rec.footer["lost_events"] == rec.footer["counters"][
        "switch_in_unseen"], rec.footer["counters"]
    dev = rec.events["dev.event"]
    runq = rec.events["cpu.runq"]
    names = {}
    for doc in rec.meta:
        for pid, addr, name in doc.get("op_names", []):
            names.setdefault(pid, set()).add(name)
    assert len(set(pids)) == 500
    unseen = rec.footer["counters"]["switch_in_unseen"]
    waited = 0
    for pid in pids:
        mine = dev[dev["pid"] == pid]
        assert api_names(mine[np.argsort(mine["ts_ns"], kind="stable")]) == CUDART_CALLS_APIS, pid
        assert set(mine["comm"].tolist()) == {b"cudart_calls"}, pid
        assert names.get(pid) in (None, KERNELS), pid
        own = runq[runq["tid"] == pid]
        assert set(own["pid"].tolist()) <= {pid}, pid
        waited += bool(len(own))
    # Every process waits at least once (its first run after fork); one whose
    # switch-ins the kernel never reported has none, and each such loss is
    # counted (a CI run: 499 of 500, with 5 switch-ins unseen).
    assert waited >= 500 - unseen, (waited, unseen)
    # Kernel names of a process gone before the drain come from the load
    # frames its first launch took; the kernel gives up a build id when it
    # cannot take the process's mmap lock at once (many starting together),
    # and each name lost that way is counted.
    unnamed = [pid for pid in pids if pid not in names]
    assert rec.footer["name_resolution"]["unresolved"] == len(KERNELS) * len(unnamed)
    assert len(unnamed) < len(pids), "no kernel named after its process exited"


# ----- a library replaced on disk ----------------------------------------------

def test_a_library_replaced_on_disk_keeps_being_traced(natives, tmp_path):  # noqa: F811
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    lib = lib_dir / "libcudart.so.12"
    shutil.copy(natives.cudart, lib)
    program = build_program("launch_loop.c", tmp_path, [lib])
    old_loop = launch_loop(program)
    new_loop = held([program])     # its pid known now, the program run later
    path = tmp_path / "replaced.mmtr"
    recorder = start_recorder(path, "--lib", lib, "--pid", old_loop.pid, "--pid", new_loop.pid)
    try:
        run_loop(old_loop, "run 10")
        # A new build renamed over the old one: a new inode at the same path.
        fresh = lib_dir / ".libcudart.so.12.new"
        shutil.copy(natives.cudart, fresh)
        os.rename(fresh, lib)
        said = wait_for_line(recorder, r"replaced on disk", timeout=30)
        run_loop(old_loop, "run 10")        # the old inode, still mapped, still probed
        new_loop.stdin.write("go\n")
        new_loop.stdin.flush()
        assert new_loop.stdout.readline().startswith("ready")
        run_loop(new_loop, "run 10")
        time.sleep(0.3)
    finally:
        end(old_loop, new_loop)
        out = stop(recorder)
    assert recorder.returncode == 0, "".join(said) + out
    assert f"{lib} was replaced on disk" in "".join(said)
    rec = recording.read_recording(path)
    dev = rec.events["dev.event"]
    for proc, loops in ((old_loop, 20), (new_loop, 10)):
        got = api_names(dev[dev["pid"] == proc.pid])
        for api in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize"):
            assert got.count(api) == loops, (proc.pid, api, got.count(api))
    attached = {(s["inode"], s["symbol"]) for doc in rec.meta for s in doc.get("probes", [])
                if s.get("path") == str(lib) and s.get("state") == "attached"}
    assert len({inode for inode, _ in attached}) == 2
    assert rec.footer["lost_events"] == rec.footer["counters"]["switch_in_unseen"]


def test_a_library_rewritten_in_place_is_probed_again(natives, tmp_path):  # noqa: F811
    """`cp` over a probed library keeps its inode: probes left at the old
    build's offsets would sit inside the new build's instructions."""
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    lib = lib_dir / "libcuda.so.1"
    shutil.copy(natives.driver, lib)
    rebuilt = build_library("cuda_driver_standin.c", tmp_path, "libcuda.so.1",
                             flags=["-falign-functions=256"])
    assert symbol_file_offset(rebuilt, "cuLaunchKernel") != symbol_file_offset(
        lib, "cuLaunchKernel")
    caller = held([build_program("cuda_driver_calls.c", tmp_path, [lib])])
    inode = lib.stat().st_ino
    path = tmp_path / "rewritten.mmtr"
    recorder = start_recorder(path, "--lib", lib, "--pid", caller.pid)
    try:
        shutil.copyfile(rebuilt, lib)       # in place, as cp does
        assert lib.stat().st_ino == inode
        said = wait_for_line(recorder, r"rewritten in place", timeout=30)
        out, _ = caller.communicate("go\n", timeout=30)
        assert caller.returncode == 0
        time.sleep(0.3)
    finally:
        end(caller)
        out_recorder = stop(recorder)
    assert recorder.returncode == 0, "".join(said) + out_recorder
    assert f"{lib} was rewritten in place" in "".join(said)
    dev = recording.read_recording(path).events["dev.event"]
    assert len(dev[dev["pid"] == json.loads(out)["pid"]]) == 12


# ----- the device ring overflowing ----------------------------------------------

def test_a_ring_overflow_is_counted_and_the_daemon_keeps_tracing(natives, tmp_path):  # noqa: F811
    """The daemon stopped (SIGSTOP) stands for a drain that falls behind:
    90 000 calls against a device ring that holds 55 188 (8 MiB)."""
    loop = launch_loop(natives.launch_loop)
    port = free_port()
    daemon = None
    try:
        daemon = Daemon(["--state-dir", tmp_path / "state", "--socket", tmp_path / "hint.sock",
                         "--lib", natives.cudart, "--pid", loop.pid, "--trace-launches",
                         "--metrics-address", f"127.0.0.1:{port}"], None,
                        tmp_path / "daemon.log")

        def accounted(samples):
            # every call delivered: work, waits, and (no driver) failed calls
            delivered = (metric(samples, "mmtrace_device_submissions_total", stream="gpu")
                         + metric(samples, "mmtrace_device_sync_wait_seconds_count",
                                  stream="gpu")
                         + metric(samples, "mmtrace_device_call_failures_total", stream="gpu"))
            return delivered, metric(samples, "mmtrace_events_lost_total",
                                     reason="ringbuf_full_dev")

        def settled(total):
            samples = scrape(port)
            delivered, lost = accounted(samples)
            return (delivered, lost, samples) if delivered + lost >= total else None

        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            run_loop(loop, "run 30000")     # a launch, a memcpy and a sync each
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        delivered, lost, samples = wait_until(lambda: settled(90000), what="the calls")
        assert delivered + lost == 90000 and lost > 30000, (delivered, lost)
        # Besides: switch-ins the kernel did not report (test_sched_bpf.py), counted too.
        unseen = metric(samples, "mmtrace_events_lost_total", reason="switch_in_unseen")
        assert metric(samples, "mmtrace_events_lost_total") == lost + unseen, "another loss"
        status = subprocess.run([sys.executable, "-m", "mmtrace.agent", "top", "--json",
                                 "--socket", tmp_path / "hint.sock"], capture_output=True,
                                text=True, timeout=30)
        losses = json.loads(status.stdout)["losses"]
        losses.pop("kernel.switch_in_unseen", None)
        assert losses == {"kernel.ringbuf_full_dev": lost}
        # Still tracing, and nothing more lost.
        run_loop(loop, "run 100")
        delivered_after, lost_after, _ = wait_until(lambda: settled(90300), what="100 more")
        assert (delivered_after, lost_after) == (delivered + 300, lost)
        assert daemon.proc.poll() is None
    finally:
        end(loop)
        if daemon is not None:
            assert daemon.stop() == 0, daemon.text()


# ----- one probe the kernel refuses ---------------------------------------------

def test_a_probe_the_kernel_refuses_fails_alone_and_is_named(natives, tmp_path,  # noqa: F811
                                                             mmtrace_cli):
    lib_dir = tmp_path / "lib"
    lib_dir.mkdir()
    lib = lib_dir / "libcudart.so.12"
    shutil.copy(natives.cudart, lib)
    with open(lib, "r+b") as f:
        f.seek(symbol_file_offset(lib, "cudaEventSynchronize"))
        f.write(HLT)    # never called; the kernel will not single-step it
    # Mapped by a running process: the kernel checks the instruction as it attaches.
    loop = launch_loop(build_program("launch_loop.c", tmp_path, [lib]))
    port = free_port()
    daemon = None
    try:
        daemon = Daemon(["--state-dir", tmp_path / "state", "--socket", tmp_path / "hint.sock",
                         "--lib", lib, "--pid", loop.pid, "--trace-launches",
                         "--metrics-address", f"127.0.0.1:{port}"], None,
                        tmp_path / "daemon.log")
        run_loop(loop, "run 50")
        # no driver: the loop's calls fail, and are counted so
        samples = wait_until(lambda: scrape_when(port, "mmtrace_device_call_failures_total",
                                                 50, api="cudaStreamSynchronize"),
                             what="the loop's syncs")
        up = {s.labels["probe"]: s.value for s in samples if s.name == "mmtrace_probe_up"
              and s.labels["library"] == "libcudart.so.12"}
        assert up["cudaEventSynchronize"] == 0
        assert {p for p, v in up.items() if v == 0} == {"cudaEventSynchronize"}, up
        assert up["cudaStreamSynchronize"] == up["cudaMemcpy"] == up["cudaLaunchKernel"] == 1
        failures = [s.labels for s in samples if s.name == "mmtrace_probe_failure_info"]
        assert {(f["probe"], f["point"]) for f in failures} == {
            ("cudaEventSynchronize", "entry"), ("cudaEventSynchronize", "return")}
        assert all("cannot probe the instruction" in f["reason"] for f in failures), failures
        for api in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize"):
            assert metric(samples, "mmtrace_device_call_failures_total", api=api, code="35") == 50
        assert metric(samples, "mmtrace_device_submissions_total", stream="gpu") == 0
        assert "cudaEventSynchronize" in daemon.text()
        if shutil.which("promtool"):
            check = subprocess.run(["promtool", "check", "metrics"], input=exposition(port),
                                   capture_output=True)
            assert check.returncode == 0, check.stdout + check.stderr

        doctor = mmtrace_cli("doctor", "--json")
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        check = next(c for c in json.loads(doctor.stdout)["checks"]
                     if c["name"] == "gpu_npu_probes")
        assert not check["ok"]
        failed = check["detail"].split("; failed: ", 1)[1]
        assert re.fullmatch(rf"{re.escape(str(lib))}:cudaEventSynchronize \(entry, return\): "
                            r".*the kernel cannot probe the instruction.*", failed), failed
        assert "cudaStreamSynchronize" not in failed and "cudaMemcpy" not in failed
        assert daemon.proc.poll() is None
    finally:
        end(loop)
        if daemon is not None:
            assert daemon.stop() == 0, daemon.text()


# ----- GPU/NPU programs that do not compile -------------------------------------

# The real daemon and the real compiler, with a syntax error appended to the
# GPU/NPU programs' source (as a bad edit or an unsupported kernel would make).
BROKEN_DEVICE_PROGRAMS = """
import runpy, sys
from mmtrace.agent.kernel import probes
source = probes.device_text
probes.device_text = lambda options: source(options) + "\\nint broken_on_purpose( {\\n"
sys.argv[0] = "mmtrace"
runpy.run_module("mmtrace.agent", run_name="__main__")
"""


def test_gpu_npu_programs_that_do_not_compile_fail_alone_and_are_named(tmp_path):
    port = free_port()
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-c", BROKEN_DEVICE_PROGRAMS, "run", "--state-dir",
             tmp_path / "state", "--socket", tmp_path / "hint.sock",
             "--metrics-address", f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "tracing:" in log_path.read_text() or daemon.poll() is not None,
                   timeout=90, what="the daemon to start")
        text = log_path.read_text()
        assert daemon.poll() is None, text
        said = r"main\.c:\d+:\d+: error: expected parameter declarator"   # the compiler's words
        assert re.search(rf"ERROR.*GPU/NPU probes unavailable \(.*{said}.*\); "
                         r"the CPU stream goes on", text), text
        first = scrape(port)
        time.sleep(1.5)
        samples = scrape(port)
        up = {(s.labels["probe"], s.labels["library"]): s.value for s in samples
              if s.name == "mmtrace_probe_up"}
        assert up == {("sched", "kernel"): 1, ("gpu_npu_programs", "*"): 0}, up
        failures = [s.labels for s in samples if s.name == "mmtrace_probe_failure_info"]
        assert [(f["probe"], f["point"]) for f in failures] == [("gpu_npu_programs", "load")]
        assert re.search(said, failures[0]["reason"]), failures
        # No library probed: the scheduler's tracepoints are mmtrace_probe_up's, not probe
        # points; the programs that failed as a whole count as one failed point.
        assert metric(samples, "mmtrace_probes", state="attached") == 0
        assert metric(samples, "mmtrace_probes", state="failed") == 1
        wakeups = [metric(s, "mmtrace_runq_delay_seconds_count") for s in (first, samples)]
        assert wakeups[1] > wakeups[0] > 0, wakeups                    # the CPU stream runs
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0, log_path.read_text()


def test_doctor_names_gpu_npu_programs_that_do_not_compile(tmp_path):
    doctor = subprocess.run([sys.executable, "-c", BROKEN_DEVICE_PROGRAMS, "doctor", "--json"],
                            capture_output=True, text=True, timeout=180)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    check = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "gpu_npu_probes")
    assert not check["ok"]
    assert re.match(r"the GPU/NPU programs \(gpu_npu_programs\) did not compile or load, so no "
                    r"library is probed; the CPU stream is unaffected: .*main\.c:\d+:\d+: "
                    r"error: expected parameter declarator",
                    check["detail"]), check


def test_a_recording_made_while_gpu_npu_programs_do_not_compile_says_why(
        tmp_path, workloads, mmtrace_cli):
    path = tmp_path / "cpu-only.mmtr"
    load = subprocess.Popen([workloads.path("ctxswitch"), "30", "1"], stdout=subprocess.PIPE)
    try:
        recorder = subprocess.run(
            [sys.executable, "-c", BROKEN_DEVICE_PROGRAMS, "record", "-o", path,
             "--duration", "1"], capture_output=True, text=True, timeout=180)
    finally:
        end(load)
    said = r"main\.c:\d+:\d+: error: expected parameter declarator"   # the compiler's words
    assert recorder.returncode == 0, recorder.stderr
    assert re.search(rf"GPU/NPU probes unavailable \(.*{said}.*\); recording the CPU stream",
                     recorder.stderr), recorder.stderr
    report = mmtrace_cli("report", path, "--json")
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    failed = summary["device_probes"]["failed_programs"]
    assert [(f["program"], f["state"], f["point"]) for f in failed] == \
        [("gpu_npu_programs", "failed", "load")], failed
    assert re.search(said, failed[0]["reason"]), failed
    assert summary["events"]["cpu.runq"] > 0 and not any(
        name.startswith(("gpu.", "npu.")) for name in summary["events"]), summary["events"]
    text = mmtrace_cli("report", path).stdout
    assert re.search(r"^not traced  gpu/npu: the gpu_npu_programs did not compile or load, so "
                     rf"the file has none of its events:\n(              .*\n)*.*{said}", text,
                     re.M), text


# ----- the disk filling up ---------------------------------------------------------

@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 2 MiB tmpfs: writes past it fail with ENOSPC."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_stops_the_recording_with_one_line_and_the_file_reads_back(
        small_tmpfs, workloads, mmtrace_cli):
    path = small_tmpfs / "full.mmtr"
    recorder = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "record", "-o",
                                 str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    load = None
    try:
        first = recorder.stderr.readline()
        while " stream live " in first:     # the streams going live come first
            first = recorder.stderr.readline()
        # The host's own switches may fill the 2 MiB before the first
        # progress line; else a ping-pong fills it.
        assert first.startswith(("recording ", "mmtrace: error: ")), first
        if first.startswith("recording "):
            load = subprocess.Popen([workloads.path("ctxswitch"), "20", "4"],
                                    stdout=subprocess.PIPE)
        err = first + recorder.stderr.read()
        recorder.wait(timeout=60)
    finally:
        end(load, recorder)
    assert recorder.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("mmtrace: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert re.match(rf"mmtrace: error: {re.escape(str(path))}: No space left on device after "
                    r"[\d,]+ events \([\d,]+ bytes\); recording stopped: it ends (with its "
                    r"footer|at its last complete chunk) and reads back$", errors[0]), errors[0]
    report = mmtrace_cli("report", path, "--json")
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    written = int(re.search(r"after ([\d,]+) events", errors[0]).group(1).replace(",", ""))
    assert sum(summary["events"].values()) == written > 10000
    if "with its footer" in errors[0]:
        assert recording.read_recording(path).footer["stopped_by"] == "write_error"
