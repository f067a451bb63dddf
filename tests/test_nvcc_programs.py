"""Programs built with the real toolchain: tests/native/nvcc_kernels.cu
compiled by nvcc with the CUDA runtime linked statically (nvcc's default)
and shared, against libcudart.so.13 (the toolkit) and libcudart.so.12 (the
nvidia-cuda-runtime-cu12 wheel). No driver here: every call fails, and the
probes fire with the real arguments all the same.

Every launch, copy and sync must be recorded exactly once with its grid,
block, shared memory, stream and demangled kernel name, also when the
program exits right after its last call (the names then come from the
files on disk, through the load frames the kernel took)."""

import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gpu_fixtures import DeviceSession, cudart_path
from native import NATIVE, nvcc_build

SOURCE = NATIVE / "nvcc_kernels.cu"
TOOLKIT_CUDART = Path("/usr/local/cuda/lib64/libcudart.so.13")
STREAM = 0x5EED
PATCH = "vision::patch_embed(float*, int)"
SOFTMAX = "void softmax_rows<float>(float*, int)"
PLAIN = "plain_c_kernel"
# (kernel, grid, block, shared memory) of each launch, in program order.
LAUNCHES = ([(PATCH, (7, 2, 1), (64, 1, 1), 128)] * 3
            + [(SOFTMAX, (3, 1, 1), (32, 1, 1), 0)] * 2
            + [(PLAIN, (1, 1, 1), (1, 1, 1), 0),
               (PLAIN, (2, 1, 1), (8, 1, 1), 16),
               (PATCH, (4, 4, 1), (16, 16, 1), 0)])
COPY_BYTES = 64
BUILDS = ("static-13", "shared-13", "static-12", "shared-12")


def _flags(build: str) -> tuple[list[str], Path | None]:
    """nvcc flags of a build and the runtime library the probes go on
    (None: the executable itself carries it)."""
    linkage, version = build.split("-")
    if version == "13":
        return ["-cudart", linkage], None if linkage == "static" else TOOLKIT_CUDART
    wheel = cudart_path()
    if wheel is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel is not installed")
    if linkage == "static":
        return ["-cudart", "none", str(wheel.parent / "libcudart_static.a"), "-ldl",
                "-lpthread", "-lrt"], None
    return ["-cudart", "none", f"-L{wheel.parent}", "-l:libcudart.so.12",
            f"-Xlinker", f"-rpath,{wheel.parent}"], wheel


def built(build: str) -> tuple[Path, Path]:
    """(program, file to probe) of a build; skips without nvcc."""
    flags, runtime = _flags(build)
    if runtime is not None and not runtime.exists():
        pytest.skip(f"{runtime} is not installed")
    program = nvcc_build(SOURCE, *flags, name=f"nvcc_kernels-{build}")
    if program is None:
        pytest.skip("nvcc is not installed")
    return program, runtime or program


class Program:
    """One run of a built program: started waiting for a line on stdin."""

    def __init__(self, path: Path, mode: str):
        self.proc = subprocess.Popen([str(path), mode], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def call(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def finish(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
        assert self.proc.wait(timeout=30) == 0


def run_and_drain(session: DeviceSession, run: Program, mode: str) -> dict:
    """Let `run` call; read its events after it exited ("exit") or while
    it still lives ("linger"). Returns what it printed."""
    out = run.call()
    if mode == "exit":
        run.finish()                # gone before its events are read
        session.drain()
    else:
        session.drain()
        run.finish()
    return out


def _decoded(session: DeviceSession, pid: int):
    from mmtrace.agent.recording.device_view import decode
    return decode(session.events(pid), session.context())


def assert_recorded_exactly(rows, out: dict):
    launch = [i for i in range(len(rows)) if rows.kind[i] == "launch"]
    got = [(rows.op_name[i],
            tuple(int(rows.events[f"grid_{a}"][i]) for a in "xyz"),
            tuple(int(rows.events[f"block_{a}"][i]) for a in "xyz"),
            int(rows.events["shared_mem_bytes"][i])) for i in launch]
    assert got == LAUNCHES
    assert {int(rows.events["stream_handle"][i]) for i in launch} == {STREAM}
    copies = [i for i in range(len(rows)) if rows.kind[i] == "memcpy"]
    assert [(rows.api[i], int(rows.events["bytes"][i]), rows.direction[i],
             int(rows.events["stream_handle"][i])) for i in copies] == \
        [("cudaMemcpyAsync", out["copy_bytes"], "d2h", STREAM)]
    syncs = [i for i in range(len(rows)) if rows.kind[i] == "sync"]
    assert [(rows.api[i], int(rows.events["stream_handle"][i]), int(rows.events["ret"][i]))
            for i in syncs] == [("cudaStreamSynchronize", STREAM, out["sync_ret"])]
    assert out["sync_ret"] != 0     # no driver: the call failed, and was seen


@pytest.fixture(scope="module")
def session():
    # The builds (nvcc, cached in tests/_build: on a fresh checkout all
    # four) two at a time: each is one nvcc pipeline of a CPU.
    with ThreadPoolExecutor(max_workers=2) as pool:
        buildable = list(pool.map(_buildable, BUILDS))
    libs = sorted({str(built(b)[1]) for b, ok in zip(BUILDS, buildable) if ok})
    s = DeviceSession(libs)
    yield s
    s.close()


def _buildable(build: str) -> bool:
    try:
        built(build)
    except pytest.skip.Exception:
        return False
    return True


@pytest.mark.bpf
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("mode", ["linger", "exit"])
def test_every_call_recorded_once_with_its_kernel_name(session, build, mode):
    program, _ = built(build)
    out = run_and_drain(session, Program(program, mode), mode)
    assert_recorded_exactly(_decoded(session, out["pid"]), out)
    if mode == "exit":
        assert session.names.report()["address_resolved_after_exit"] > 0
    assert _named_by_callers(session, out["pid"]) == [name for name, *_ in LAUNCHES[:6]]


@pytest.mark.bpf
@pytest.mark.parametrize("build", ["static-13", "shared-13"])
def test_one_uprobe_per_symbol_records_the_same(build):
    """Kernels without uprobe_multi links: bcc's perf-event uprobes, on
    local symbols of the executable too."""
    program, runtime = built(build)
    session = DeviceSession([runtime], attach_mode="single")
    try:
        out = run_and_drain(session, Program(program, "exit"), "exit")
        assert_recorded_exactly(_decoded(session, out["pid"]), out)
    finally:
        session.close()


def _named_by_callers(session: DeviceSession, pid: int) -> list:
    """The <<<>>> launches' names when their handles name nothing (a
    driver's cudaKernel_t whose __cudaGetKernel ran before tracing): from
    their callers, nvcc's host stubs, resolved afresh."""
    from mmtrace.agent.ingest.device_names import DeviceNames
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    from mmtrace.agent.ingest.device_names import exited_process_resolver
    from mmtrace.bpf import device
    events = session.events(pid).copy()
    launches = np.flatnonzero(events["kind"] == device.KIND_IDS["launch"])[:6]
    events["handle"][launches] = 0xDEAD0000 + np.arange(len(launches))
    names = DeviceNames(device.default_infos(),
                        resolver=exited_process_resolver(session.loaded, lambda: session.libs))
    rows = decode(events, DeviceContext.from_meta([{"op_names": names.process(events)}]))
    return [rows.op_name[i] for i in range(len(rows)) if rows.kind[i] == "launch"][:6]


def _private_copy(program: Path) -> Path:
    """A copy with an inode of its own: no probe session holds it yet."""
    fresh = program.with_name(f"{program.name}-{os.getpid()}-{time.monotonic_ns()}")
    fresh.write_bytes(program.read_bytes())
    fresh.chmod(0o755)
    return fresh


@pytest.mark.bpf
def test_record_names_every_call_of_a_static_program_started_after_it(tmp_path):
    """mmtrace record, no --lib: the program starts after the recorder,
    is found by discovery, and exits at once after its last call."""
    from mmtrace.agent.recording.device_view import DeviceContext, decode
    from mmtrace.agent.recording.recorder import record
    from mmtrace.agent.stop_flag import StopFlag
    from mmtrace.agent.recording.file_format import read_recording
    fresh = _private_copy(built("static-13")[0])
    output = tmp_path / "static.mmtr"
    stop = StopFlag()
    recorder = threading.Thread(target=record, args=(output, 120), kwargs={"stop": stop})
    recorder.start()
    try:
        deadline = time.monotonic() + 120
        while not (output.exists() and output.stat().st_size) and recorder.is_alive():
            assert time.monotonic() < deadline, "the recorder did not start"
            time.sleep(0.1)
        run = Program(fresh, "exit")
        # Discovery looks at processes every 2 s, then the probes attach:
        # the recording's meta says when (a fixed sleep lost to a slow compile).
        while not _probes_attached(output, fresh):
            assert time.monotonic() < deadline, "the fresh program was never probed"
            time.sleep(0.2)
        # The calls come a while after the start, as a server's do: the
        # kernel takes the build ids that name them after the exit only when
        # it can take the process's mmap lock at once, which a process still
        # loading (or a busy host) can deny (one CI run of calls made at once
        # after the attach lost every name).
        time.sleep(2.0)
        out = run.call()
        run.finish()
        time.sleep(0.3)
    finally:
        stop.reason = "test"
        recorder.join(timeout=60)
        fresh.unlink()
    rec = read_recording(output)
    events = rec.events["dev.event"]
    rows = decode(events[events["pid"] == out["pid"]], DeviceContext.from_meta(rec.meta))
    assert_recorded_exactly(rows, out)
    assert rec.footer["name_resolution"]["address_resolved_after_exit"] > 0
    assert any(p.get("path") == str(fresh) and p["state"] == "attached"
               for doc in rec.meta for p in doc.get("probes", ()))


def _probes_attached(path, target) -> bool:
    """Whether the recording being written says a probe on `target` attached."""
    from mmtrace.agent.recording.file_format import RecordingError, read_recording
    try:
        rec = read_recording(path)
    except RecordingError:
        return False
    return any(p.get("path") == str(target) and p["state"] == "attached"
               for doc in rec.meta for p in doc.get("probes", ()))


@pytest.mark.bpf
def test_static_runtime_of_a_new_process_is_discovered_without_lib():
    from mmtrace.agent.kernel.probed_symbols import wanted
    from mmtrace.agent.discovery.discoverer import Discoverer
    fresh = _private_copy(built("static-13")[0])
    session = DeviceSession([])
    try:
        discoverer = Discoverer(wanted, search_paths=[])
        discoverer.poll()
        run = Program(fresh, "linger")
        time.sleep(0.05)
        found = [t for t in discoverer.poll() if t.inode == os.stat(fresh).st_ino]
        assert len(found) == 1 and found[0].origin == f"maps:{run.proc.pid}"
        assert {"cudaLaunchKernel", "__cudaGetKernel", "cudaMemcpyAsync",
                "cudaStreamSynchronize"} <= found[0].symbols
        session.device.add(found[0])
        out = run_and_drain(session, run, "linger")
        assert_recorded_exactly(_decoded(session, out["pid"]), out)
    finally:
        session.close()
        fresh.unlink()


def stripped(build: str) -> Path:
    """A copy of a build without its symbol table (strip, as packagers do)."""
    program, _ = built(build)
    out = program.with_name(program.name + "-stripped")
    if not out.exists():
        subprocess.run(["strip", "-o", str(out), str(program)], check=True)
    return out


def test_only_a_stripped_static_runtime_is_untraceable():
    from mmtrace.agent.discovery.elf_symbols import ElfSymbols
    from mmtrace.agent.discovery.library_files import untraceable_reason
    reasons = {name: untraceable_reason(ElfSymbols.read(path)) for name, path in [
        ("static", built("static-13")[0]), ("shared stripped", stripped("shared-13")),
        ("static stripped", stripped("static-13"))]}
    assert reasons["static"] is None and reasons["shared stripped"] is None
    assert reasons["static stripped"].startswith("carries a static CUDA runtime")


@pytest.fixture
def stripped_static_program():
    """A stripped static-runtime build, running."""
    program = stripped("static-13")
    run = Program(program, "linger")
    yield program
    run.call()
    run.finish()


@pytest.mark.bpf
def test_doctor_names_a_stripped_executable_with_a_static_runtime(
        stripped_static_program, mmtrace_cli):
    result = mmtrace_cli("doctor", "--json", timeout=300)
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    check = checks["untraceable_cuda"]
    assert not check["ok"]
    assert f"{stripped_static_program}: carries a static CUDA runtime" in check["detail"]
    assert "no symbol table" in check["detail"]


@pytest.mark.bpf
def test_record_warns_of_a_stripped_executable_with_a_static_runtime(
        stripped_static_program, mmtrace_cli, tmp_path):
    out = tmp_path / "r.mmtr"
    result = mmtrace_cli("record", "-o", out, "--duration", "1", timeout=300)
    assert result.returncode == 0, result.stderr
    assert (f"mmtrace: warning: {stripped_static_program}: carries a static CUDA runtime"
            in result.stderr)
