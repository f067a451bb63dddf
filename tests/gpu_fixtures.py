"""Shared by the GPU/NPU tests and the benchmark: the real libcudart from
the nvidia-cuda-runtime-cu12 wheel, stand-in libraries (libcuda.so.1,
libascendcl.so, libopapi.so: exact public prototypes, trivial bodies; no
GPU or NPU here) and C callers from tests/native/, built with gcc into a
temporary folder, and a probe session that collects device events from
the real loader and ring buffer."""

import importlib.util
import json
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from native import NATIVE
STANDIN_FLAGS = ["-O1", "-fno-ipa-icf", "-shared", "-fPIC"]


def cudart_path() -> Path | None:
    """libcudart.so.12 of the installed nvidia-cuda-runtime-cu12 wheel."""
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except ModuleNotFoundError:     # no nvidia.* package at all
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        lib = Path(location) / "lib" / "libcudart.so.12"
        if lib.exists():
            return lib
    return None


def gcc(args: list[str]):
    result = subprocess.run(["gcc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"gcc {' '.join(args)} failed:\n{result.stderr}")


def build_library(source: str, out_dir: Path, soname: str, flags=()) -> Path:
    out = out_dir / soname
    gcc([*STANDIN_FLAGS, *flags, f"-Wl,-soname,{soname}", "-o", str(out),
         str(NATIVE / source)])
    return out


def build_program(source: str, out_dir: Path, libs: list[Path], flags=()) -> Path:
    out = out_dir / Path(source).stem
    rpaths = sorted({f"-Wl,-rpath,{lib.parent}" for lib in libs})
    gcc(["-O1", "-pthread", *flags, "-o", str(out), str(NATIVE / source),
         *map(str, libs), *rpaths])
    return out


@dataclass
class Natives:
    dir: Path
    cudart: Path
    driver: Path        # stand-in libcuda.so.1
    ascendcl: Path      # stand-in libascendcl.so
    opapi: Path         # stand-in libopapi.so
    cudart_calls: Path
    driver_calls: Path
    ascend_calls: Path
    contended_launch: Path
    launch_loop: Path


def build_natives(out_dir: Path) -> Natives:
    cudart = cudart_path()
    if cudart is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the stand-in libraries")
    out_dir.mkdir(parents=True, exist_ok=True)
    driver = build_library("cuda_driver_standin.c", out_dir, "libcuda.so.1")
    ascendcl = build_library("ascendcl_standin.c", out_dir, "libascendcl.so")
    opapi = build_library("opapi_standin.c", out_dir, "libopapi.so")
    return Natives(
        out_dir, cudart, driver, ascendcl, opapi,
        cudart_calls=build_program("cudart_calls.c", out_dir, [cudart]),
        driver_calls=build_program("cuda_driver_calls.c", out_dir, [driver]),
        ascend_calls=build_program("ascend_calls.c", out_dir, [ascendcl, opapi]),
        contended_launch=build_program("contended_launch.c", out_dir, [cudart]),
        launch_loop=build_program("launch_loop.c", out_dir, [cudart]))


class DeviceSession:
    """The real loader with GPU/NPU probes on `libs`; collects what the
    rings deliver, as record does, names included."""

    def __init__(self, libs=(), **options):
        from mmtrace.agent.kernel import probes
        from mmtrace.agent.ingest.device_names import DeviceNames
        from mmtrace.agent.ingest.device_names import exited_process_resolver
        from mmtrace.bpf import device
        self.loaded = probes.load(probes.ProbeOptions(**options))
        self.states = []
        self.libs = [str(lib) for lib in libs]
        for lib in self.libs:
            self.states += self.loaded.device.add_path(lib)
        self.names = DeviceNames(device.default_infos(),
                                 resolver=exited_process_resolver(self.loaded,
                                                                  lambda: self.libs))
        self.op_names = []
        self.dev = []
        self.cpu = []

    @property
    def device(self):
        return self.loaded.device

    def drain(self, settle_s: float = 0.1):
        time.sleep(settle_s)
        for _ in range(100):
            batches = self.loaded.read()
            if not batches:
                break
            if "dev" in batches:
                self.op_names += self.names.process(batches["dev"])
                self.dev.append(batches["dev"])
            if "cpu" in batches:
                self.cpu.append(batches["cpu"])

    def run(self, cmd, timeout=60) -> dict:
        """Run a caller that prints its JSON line and then lingers; drain
        while it still runs (names resolve through its /proc/PID/maps)."""
        proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, text=True)
        try:
            out = json.loads(proc.stdout.readline())
            self.drain()
        finally:
            proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{cmd[0]} exited {proc.returncode}")
        return out

    def events(self, pid: int | None = None) -> np.ndarray:
        from mmtrace.bpf import device
        ev = np.concatenate(self.dev) if self.dev else np.zeros(0, device.DEV_EVENT)
        ev = ev[np.argsort(ev["ts_ns"], kind="stable")]
        return ev if pid is None else ev[ev["pid"] == pid]

    def runq(self) -> np.ndarray:
        from mmtrace.bpf import sched
        ev = np.concatenate(self.cpu) if self.cpu else np.zeros(0, sched.RUNQ_EVENT)
        return ev[np.argsort(ev["ts_ns"], kind="stable")]

    def context(self):
        """A DeviceContext as a recording's meta would give it."""
        from mmtrace.agent.recording.device_view import DeviceContext
        return DeviceContext.from_meta([
            {"op_names": self.op_names},
            {"symbol_names": {str(k): v for k, v in self.device.symbol_names().items()}}])

    def counters(self) -> dict:
        return self.loaded.counters()

    def close(self):
        self.loaded.close()


def run_json(cmd, timeout=60) -> dict:
    """Run a caller to completion; its last stdout line is JSON."""
    result = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise AssertionError(f"{cmd[0]} exited {result.returncode}: {result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def api_names(events: np.ndarray) -> list[str]:
    from mmtrace.bpf import device
    infos = device.default_infos()
    return [infos[int(a)].symbol for a in events["api"]]


@pytest.fixture(scope="session")
def natives(tmp_path_factory) -> Natives:
    return build_natives(tmp_path_factory.mktemp("gpu-natives"))
