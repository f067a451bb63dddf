"""mmtrace doctor's checks of the GPU/NPU software a host has installed:
the CUDA runtime, the CUDA driver, NVML and Ascend CANN, none required
(copies that processes load from elsewhere are found while tracing)."""

import os
import re
from pathlib import Path
from typing import Iterable

from mmtrace.agent.discovery.elf_reader import ElfError
from mmtrace.agent.discovery.elf_symbols import ElfSymbols
from mmtrace.agent.discovery.install_paths import installed_files
from mmtrace.agent.findings import Check


def _named(files: list[str], prefix: str) -> list[str]:
    return [f for f in files if re.match(re.escape(prefix) + r"\.so(\.\d+)*$",
                                         os.path.basename(f))]


def _defines(path: str, symbol: str) -> bool:
    try:
        return symbol in ElfSymbols.read(path).defined_dynamic_functions()
    except (ElfError, OSError):
        return False


def check_cuda_runtime(files: list[str]) -> Check:
    found = _named(files, "libcudart")
    usable = [f for f in found if _defines(f, "cudaLaunchKernel")]
    fix = ("install the CUDA runtime (pip install nvidia-cuda-runtime-cu12, or the CUDA "
           "toolkit), or name it with --lib PATH; copies that processes load from elsewhere "
           "are found while tracing, through /proc/PID/maps")
    if usable:
        return Check("cuda_runtime", True, False, "libcudart defining cudaLaunchKernel at "
                     + ", ".join(usable))
    if found:
        return Check("cuda_runtime", False, False, "libcudart found at " + ", ".join(found)
                     + " but none defines cudaLaunchKernel", fix)
    return Check("cuda_runtime", False, False, "no libcudart in /usr/local/cuda*, the "
                 "system library folders, the ldconfig cache or this interpreter's "
                 "site-packages", fix)


def check_cuda_driver(files: list[str], host) -> Check:
    found = _named(files, "libcuda")
    version_file = Path(host.proc) / "driver" / "nvidia" / "version"
    try:
        version = version_file.read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        version = ""
    if found:
        detail = "libcuda at " + ", ".join(found) + (f"; {version}" if version else "")
        return Check("cuda_driver", True, False, detail)
    return Check("cuda_driver", False, False,
                 "no libcuda.so.1: no NVIDIA driver on this host"
                 + (f" (yet {version_file} says: {version})" if version else ""),
                 "install the NVIDIA driver (it provides libcuda.so.1); without it the "
                 "runtime probes still fire but every CUDA call fails")


def check_nvml() -> Check:
    try:
        import pynvml
    except ImportError as exc:
        return Check("nvml", False, False, f"pynvml does not import ({exc})",
                     "pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return Check("nvml", False, False, "nvmlInit: libnvidia-ml.so.1 not found",
                     "install the NVIDIA driver (it provides libnvidia-ml.so.1)")
    except pynvml.NVMLError_DriverNotLoaded:
        return Check("nvml", False, False, "nvmlInit: the NVIDIA kernel driver is not loaded",
                     "modprobe nvidia, or check dmesg for why it failed to load")
    except pynvml.NVMLError_NoPermission:
        return Check("nvml", False, False, "nvmlInit: permission denied on /dev/nvidia*",
                     "run as root or add the user to the group owning /dev/nvidiactl")
    except pynvml.NVMLError as exc:
        return Check("nvml", False, False, f"nvmlInit failed: {exc}",
                     "check that the NVIDIA driver works: nvidia-smi")
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        return Check("nvml", True, False, f"NVML sees {count} GPU(s), driver {driver}")
    except pynvml.NVMLError as exc:
        return Check("nvml", False, False, f"NVML initialised, then failed: {exc}",
                     "check that the NVIDIA driver works: nvidia-smi")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def check_ascend(files: list[str]) -> Check:
    acl = _named(files, "libascendcl")
    opapi = _named(files, "libopapi")
    if acl or opapi:
        parts = [f"libascendcl at {', '.join(acl)}" if acl else "no libascendcl",
                 f"libopapi at {', '.join(opapi)}" if opapi else "no libopapi (no aclnn ops)"]
        return Check("ascend_cann", bool(acl), False, "; ".join(parts),
                     "" if acl else "install the CANN toolkit, or source its set_env.sh")
    return Check("ascend_cann", False, False,
                 "no Ascend CANN libraries (libascendcl.so, libopapi.so) in "
                 "/usr/local/Ascend/ascend-toolkit/latest or $ASCEND_TOOLKIT_HOME",
                 "on an Ascend host: install the CANN toolkit and source "
                 "/usr/local/Ascend/ascend-toolkit/set_env.sh, or name libraries with --lib")


def doctor_checks(host, search_paths: Iterable[str] | None = None) -> list[Check]:
    """CUDA runtime, CUDA driver, NVML and Ascend CANN, none required."""
    files = installed_files(search_paths)
    return [check_cuda_runtime(files), check_cuda_driver(files, host), check_nvml(),
            check_ascend(files)]
