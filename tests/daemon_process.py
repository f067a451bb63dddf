"""The daemon as systemd runs it (`mmtrace run`), for the end-to-end tests,
and the CUDA launcher whose run-queue delay they contend."""

import subprocess
import sys
import time

import pytest

import native
from gpu_fixtures import cudart_path

# Windows short enough that the launcher's few seconds of contention fire.
FAST_P99 = """
[p99]
window_s = 0.5
baseline_windows = 20
min_baseline_windows = 6
consecutive = 3
min_samples = 20
"""


def launch_phases():
    """(libcudart, the launch_phases workload built against it), or a skip."""
    cudart = cudart_path()
    if cudart is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    return cudart, native.build(native.WORKLOADS / "launch_phases.c",
                                flags=[str(cudart), f"-Wl,-rpath,{cudart.parent}"])


def start_daemon(args: list, log: list[str], timeout_s: float = 60,
                 env: dict | None = None) -> subprocess.Popen:
    """`mmtrace run ARGS` kept to CPU 0 (the tests contend CPU 1), returned
    once it traces; its output so far is appended to `log`."""
    daemon = subprocess.Popen(
        ["taskset", "-c", "0", sys.executable, "-m", "mmtrace.agent", "run", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = daemon.stdout.readline()
        assert line, "daemon exited: " + "".join(log)
        log.append(line)
        if "tracing:" in line:
            return daemon
    daemon.kill()
    raise AssertionError(f"daemon not tracing after {timeout_s} s: " + "".join(log))
