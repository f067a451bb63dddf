"""Driver launches named through CUDA 12+ library loading, as cuBLAS 13
makes them: a stand-in libcuda.so.1 compiled against the toolkit's own
cuda.h (tests/native/cuda_library_standin.c; no driver here) and a caller
that takes kernels with cuLibraryGetKernel, their CUfunctions with
cuKernelGetFunction, and one name with cuFuncGetName, then launches with
cuLaunchKernel and cuLaunchKernelEx."""

import json
import subprocess
from pathlib import Path

import pytest

from gpu_fixtures import DeviceSession, build_library, build_program

pytestmark = pytest.mark.bpf

CUDA_INCLUDE = Path("/usr/local/cuda/include")
STREAM = 0xC0B1A5


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not (CUDA_INCLUDE / "cuda.h").exists():
        pytest.skip(f"no CUDA toolkit: {CUDA_INCLUDE}/cuda.h is missing")
    out = tmp_path_factory.mktemp("cuda-library")
    include = [f"-I{CUDA_INCLUDE}"]
    driver = build_library("cuda_library_standin.c", out, "libcuda.so.1", include)
    return driver, build_program("cuda_library_calls.c", out, [driver], include)


def test_kernels_of_libraries_launched_by_the_driver_carry_their_names(built):
    from mmtrace.agent.recording.device_view import decode
    driver, caller = built
    proc = subprocess.Popen([str(caller)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        json.loads(proc.stdout.readline())   # its first kernel is taken: attach now
        session = DeviceSession([driver])
        try:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            out = json.loads(proc.stdout.readline())
            session.drain()
            rows = decode(session.events(out["pid"]), session.context())
            states = {s.symbol: s.state for s in session.states if s.point == "entry"}
        finally:
            session.close()
    finally:
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    for symbol in ("cuLibraryGetKernel", "cuKernelGetFunction", "cuFuncGetName",
                   "cuLaunchKernel", "cuLaunchKernelEx"):
        assert states[symbol] == "attached", symbol
    launches = [(rows.api[i], rows.op_name[i], int(rows.events["grid_x"][i]),
                 int(rows.events["block_x"][i]), int(rows.events["shared_mem_bytes"][i]),
                 int(rows.events["stream_handle"][i]))
                for i in range(len(rows)) if rows.kind[i] == "launch"]
    assert launches == [
        ("cuLaunchKernel", "void cublas::gemm<float>(float const*, float const*, float*, int)",
         8, 128, 4096, STREAM),
        ("cuLaunchKernelEx", "gemv_splitk_kernel", 16, 256, 512, STREAM),
        ("cuLaunchKernel", "void cublas::gemm<float>(float const*, float const*, float*, int)",
         2, 32, 0, STREAM),
        ("cuLaunchKernel", "cublas::epilog(float*, int)", 1, 64, 0, STREAM)]
    assert out["asked"] == "_ZN6cublas6epilogEPfi"
