"""The stand-in libnvidia-ml.so.1 (tests/native/nvml_standin.c: NVML's
public prototypes, answering from a state file; no NVIDIA driver here),
built with gcc, and the state file the tests write and rewrite."""

import os
from dataclasses import dataclass
from pathlib import Path

from gpu_fixtures import build_library

SONAME = "libnvidia-ml.so.1"
STATE_ENV = "MMTRACE_NVML_STATE"


@dataclass
class FakeGpu:
    bus_id: str
    sm_pct: int = 0
    membw_pct: int = 0
    total_bytes: int = 80 << 30
    used_bytes: int = 0
    temp_c: int = 40
    power_mw: int = 100_000
    tx_kbps: int = 0
    rx_kbps: int = 0
    pcie_gen: int = 4
    pcie_width: int = 16
    switch: int = 0
    numa: int = 0
    nvlink_peers: tuple = ()
    name: str = "StandinGPU"

    def line(self) -> str:
        peers = ",".join(map(str, self.nvlink_peers)) or "-"
        return " ".join(str(v) for v in (
            self.bus_id, self.name, self.sm_pct, self.membw_pct, self.total_bytes,
            self.used_bytes, self.temp_c, self.power_mw, self.tx_kbps, self.rx_kbps,
            self.pcie_gen, self.pcie_width, self.switch, self.numa, peers))


def build_standin(out_dir: Path) -> Path:
    """The stand-in library, as `libnvidia-ml.so.1` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return build_library("nvml_standin.c", out_dir, SONAME)


def write_state(path: Path, gpus: list[FakeGpu]):
    """Replace the state at once: a poll never reads half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(g.line() + "\n" for g in gpus))
    os.replace(tmp, path)


def standin_env(lib: Path, state: Path, env=None) -> dict:
    """An environment in which pynvml loads the stand-in."""
    env = dict(os.environ if env is None else env)
    env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(lib.parent),
                                                    env.get("LD_LIBRARY_PATH")]))
    env[STATE_ENV] = str(state)
    return env
