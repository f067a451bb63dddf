"""The site-packages folders a running Python process uses: those it maps
extension modules from, its interpreter's, its venv's. Libraries wheels
install there are probed before `import torch` loads them."""

import glob
import os
import re
from pathlib import Path

from mmtrace.agent.discovery.proc_maps import ProcessMaps, in_process_root

_SITE_DIR = re.compile(r"^(/.*?/(?:site|dist)-packages)/")
_PYTHON_EXECUTABLE = re.compile(r"^python3?(\.\d+)?$")
_PREFIX_SITE_GLOBS = ("lib/python3*/site-packages", "lib/python3*/dist-packages",
                      "lib64/python3*/site-packages", "local/lib/python3*/dist-packages",
                      "lib/python3/dist-packages")


class PythonSiteDirs:
    """site-packages folders per process, as the process sees them. An
    interpreter's prefix and venv do not change: they are looked up once
    per process, until forget_gone drops it."""

    def __init__(self, proc_root: Path):
        self.proc_root = Path(proc_root)
        self._interpreter_dirs: dict[int, set[str]] = {}

    def forget(self, pid: int) -> None:
        self._interpreter_dirs.pop(pid, None)

    def forget_gone(self, alive: set[int]) -> None:
        for gone in set(self._interpreter_dirs) - alive:
            del self._interpreter_dirs[gone]

    def of_process(self, pid: int, maps: ProcessMaps) -> set[str]:
        """site-packages folders (as the process sees them) of a process: those
        it maps extension modules from, its interpreter's, its venv's."""
        dirs: set[str] = set()
        prefixes: set[str] = set()
        python = False
        for path in set(maps.paths):
            match = _SITE_DIR.match(path)
            if match:
                dirs.add(match.group(1))
            base = os.path.basename(path)
            if _PYTHON_EXECUTABLE.match(base):
                python = True
                prefixes.add(os.path.dirname(os.path.dirname(path)))
            elif base.startswith("libpython3"):
                python = True
        if python:
            if pid not in self._interpreter_dirs:
                found = self._venv_site_dirs(pid)
                for prefix in prefixes:
                    found |= self._prefix_site_dirs(pid, prefix)
                self._interpreter_dirs[pid] = found
            dirs |= self._interpreter_dirs[pid]
        return dirs

    def _prefix_site_dirs(self, pid: int, prefix: str) -> set[str]:
        root = in_process_root(self.proc_root, pid, "/")
        dirs = set()
        for pattern in _PREFIX_SITE_GLOBS:
            for host in glob.glob(in_process_root(self.proc_root, pid,
                                                  os.path.join(prefix, pattern))):
                dirs.add("/" + os.path.relpath(host, root))
        return dirs

    def _venv_site_dirs(self, pid: int) -> set[str]:
        """A venv is a folder with pyvenv.cfg, next to or above the executable
        named in argv[0] (never resolved: venv/bin/python links out of the
        venv), or the folder VIRTUAL_ENV names."""
        proc = self.proc_root / str(pid)
        roots = []
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode(
                "utf-8", "surrogateescape")
            if "/" in argv0:
                if not argv0.startswith("/"):
                    argv0 = os.path.join(os.readlink(proc / "cwd"), argv0)
                bindir = os.path.dirname(os.path.normpath(argv0))
                roots += [bindir, os.path.dirname(bindir)]
            for entry in (proc / "environ").read_bytes().split(b"\0"):
                if entry.startswith(b"VIRTUAL_ENV="):
                    roots.append(entry[len(b"VIRTUAL_ENV="):].decode("utf-8", "surrogateescape"))
        except OSError:
            pass
        dirs = set()
        for root in roots:
            if os.path.isfile(in_process_root(self.proc_root, pid, root + "/pyvenv.cfg")):
                dirs |= self._prefix_site_dirs(pid, root)
        return dirs
