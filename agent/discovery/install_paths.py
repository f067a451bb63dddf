"""Where CUDA and CANN install their libraries: the usual install folders,
the dynamic linker's cache (`ldconfig -p`) and the folders pip wheels put
them in inside site-packages."""

import glob
import os
import re
import shutil
import site
import stat
import subprocess
import sys
from pathlib import Path
from typing import Iterable

# Where CUDA and CANN install their libraries. In the shared system library
# folders only the runtime and driver are of interest; every library of a
# CANN lib64 is looked at, because which one defines aclrt* varies by release.
DEFAULT_SEARCH_GLOBS = (
    "/usr/local/cuda*/lib64/libcudart.so*",
    "/usr/local/cuda*/lib/libcudart.so*",
    "/usr/local/cuda*/targets/*-linux/lib/libcudart.so*",
    "/usr/lib/x86_64-linux-gnu/libcuda.so*",
    "/usr/lib/x86_64-linux-gnu/libcudart.so*",
    "/usr/lib/aarch64-linux-gnu/libcuda.so*",
    "/usr/lib/aarch64-linux-gnu/libcudart.so*",
    "/usr/lib64/libcuda.so*",
    "/usr/lib64/libcudart.so*",
    "/usr/lib/wsl/lib/libcuda.so*",
    "/usr/local/Ascend/ascend-toolkit/latest/*-linux/lib64/*.so*",
    "/usr/local/Ascend/ascend-toolkit/latest/lib64/*.so*",
)
# Environment variables CANN's set_env.sh exports, pointing at a toolkit.
ASCEND_HOME_VARIABLES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
LDCONFIG_NAMES = re.compile(r"^lib(cuda|cudart|ascendcl|acl_op_compiler|opapi)\.so(\.\d+)*$")
# Libraries that pip wheels install inside site-packages.
SITE_PACKAGES_GLOBS = ("nvidia/*/lib/*.so*", "torch/lib/*.so*", "torch_npu/lib/*.so*")


def default_search_globs(environ=os.environ) -> list[str]:
    globs = list(DEFAULT_SEARCH_GLOBS)
    for var in ASCEND_HOME_VARIABLES:
        home = environ.get(var)
        if home:
            globs += [f"{home}/lib64/*.so*", f"{home}/*-linux/lib64/*.so*"]
    return globs


class LdconfigLibraries:
    """Paths of the CUDA / CANN libraries the dynamic linker's cache lists
    (`ldconfig -p`), read again only when the cache file changes."""

    def __init__(self, cache_file: Path = Path("/etc/ld.so.cache")):
        self.cache_file = cache_file
        self._stamp: tuple | None = None
        self._paths: list[str] = []

    def paths(self) -> list[str]:
        try:
            st = os.stat(self.cache_file)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except OSError:
            return []
        if stamp != self._stamp:
            self._paths = _ldconfig_listing()
            self._stamp = stamp
        return self._paths


def _ldconfig_listing() -> list[str]:
    ldconfig = shutil.which("ldconfig") or shutil.which("ldconfig", path="/sbin:/usr/sbin")
    paths = []
    if ldconfig:
        try:
            out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True,
                                 timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            out = ""
        for line in out.splitlines():
            name, sep, path = line.strip().partition(" => ")
            if sep and LDCONFIG_NAMES.match(name.split(" ", 1)[0]):
                paths.append(path.strip())
    return paths


def installed_files(search_paths: Iterable[str] | None) -> list[str]:
    """Existing files in the install paths, the ldconfig cache and this
    interpreter's site-packages, one per inode."""
    patterns = (list(search_paths) if search_paths is not None
                else default_search_globs() + LdconfigLibraries().paths())
    if search_paths is None:
        own_sites = set(site.getsitepackages()) | {p for p in sys.path
                                                   if p.endswith(("site-packages",
                                                                  "dist-packages"))}
        patterns += [os.path.join(d, g) for d in sorted(own_sites) for g in SITE_PACKAGES_GLOBS]
    seen, files = set(), []
    for pattern in patterns:
        for path in sorted(glob.glob(pattern)):
            try:
                st = os.stat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                files.append(os.path.realpath(path))
    return files
