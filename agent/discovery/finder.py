"""Find the files to attach uprobes to: every ELF file that defines a wanted
symbol, whether running processes map it (/proc/PID/maps, opened through
/proc/PID/root so files inside containers are found), it sits in the usual
install paths or in the Python site-packages those processes use, or it
was named with --lib. Runtimes linked statically into an executable or an
extension module are found like libraries: by their symbol tables.

Uprobes are per inode, so there is one target per (dev, inode): hard links,
symlinks and the same file seen by many processes count once. A Discoverer
keeps scanning while the agent runs and hands out each target once while
something holds it: a live process that maps it, or a path that names it
(--lib, the install paths, the site-packages of live Python processes).
When nothing holds it any more, it is released (take_released()), and
everything discovery kept about it goes; found again later, it is handed
out again. Any user can load and delete library copies faster than anyone
reads them, so everything else is bounded too: at most MAX_PROBED_FILES
targets are out at once (more wait, counted), and what is remembered about
files and processes is kept for the most recently seen ones only.
"""

import glob
import os
import re
import shutil
import site
import stat
import subprocess
import sys
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from mmtrace.agent.findings import Check
from mmtrace.agent.discovery.glob_cache import GlobCache
from mmtrace.agent.discovery.symbols import (DELETED_SUFFIX, ElfError, ElfSymbols, FileKey, NotElfError,
                      ProcessMaps, in_process_root, read_maps)

# Which symbols to probe. A `prefixes` attribute (a tuple of str), where
# given, says every wanted name starts with one of them: only such names of
# a file are decoded.
Wanted = Callable[[str], bool]


@dataclass(frozen=True)
class LibraryTarget:
    """One file to attach uprobes to."""
    path: str                   # host path bcc can open (/proc/PID/root/... for containers)
    dev: int
    inode: int
    symbols: frozenset[str]     # the wanted symbols this file defines
    origin: str                 # "maps:<pid>", "site-packages", "system" or "--lib"


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

# Targets handed out at once. A probed libcudart costs 15 descriptors (14
# links and the file), and closing a link waits for a grace period: 128
# such files close in about 3 s from 48 threads, within the stop deadline.
MAX_PROBED_FILES = 128
MAX_REMEMBERED_FILES = 8192     # files whose identity and parse result are kept
MAX_NOTED = 8192                # problems remembered so as to count each once
MAX_UNTRACEABLE = 256           # untraceable files named (all are counted)

_SITE_DIR = re.compile(r"^(/.*?/(?:site|dist)-packages)/")
_PYTHON_EXECUTABLE = re.compile(r"^python3?(\.\d+)?$")
_GONE = (FileNotFoundError, ProcessLookupError)


class _Recent(OrderedDict):
    """A dict that keeps its `limit` most recently used entries."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def get(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)


def find_targets(wanted: Wanted, pids: Iterable[int] | None = None,
                 extra_paths: Iterable[str | os.PathLike] = (),
                 proc_root: Path = Path("/proc"),
                 search_paths: Iterable[str] | None = None) -> list[LibraryTarget]:
    """One scan: every file that defines at least one symbol `wanted` accepts.

    `pids` limits the process scan (None: every process); `extra_paths` are
    --lib paths (ValueError when one is missing or not ELF); `search_paths`
    are glob patterns replacing the default install paths and ldconfig."""
    return Discoverer(wanted, pids, extra_paths, proc_root,
                      search_paths=search_paths).poll()


class Discoverer:
    """Keeps discovering while the agent runs: poll() returns only targets
    not out already (new processes, new files, a file replaced on disk, a
    released file found again); take_released() the targets nothing holds
    any more, whose probes should go.

    `counters` counts, per reason and once per process or file (not once per
    poll), what could not be looked at: unreadable_proc (a maps file that
    cannot be read), vanished (a process or file gone while scanning: a
    process that lived less than a scan is not traced), missing_file (a
    mapped path that does not exist from the host),
    unreadable_file, not_elf, elf_unreadable (truncated or corrupt ELF),
    deleted_mapping (a mapped file deleted since; reached through map_files
    where possible), maps_malformed_lines, lib_without_wanted_symbols (a
    --lib file defining none of the wanted symbols), untraceable (files in
    `untraceable`); and examined (files parsed), targets (returned so far),
    released (targets released so far), over_cap (targets that had to wait
    because `max_targets` were out), waiting (targets waiting now), probed
    (targets out now).

    `untraceable`: path -> why, for files that carry what is traced but
    cannot be probed (a stripped executable with a static CUDA runtime);
    the first MAX_UNTRACEABLE of them.

    A process is read whole the first poll that sees it, and again once it
    exec()s; after that its maps are read again every `rescan_every` polls
    (a fifth of the processes each poll), which is where new dlopen()s
    show. Reading every maps file every poll was most of an idle agent's
    CPU. Libraries in install paths and in the site-packages of the Python
    processes seen are looked for every poll, so what `import torch` will
    load is probed before it loads."""

    def __init__(self, wanted: Wanted, pids: Iterable[int] | None = None,
                 extra_paths: Iterable[str | os.PathLike] = (),
                 proc_root: Path = Path("/proc"), interval_s: float = 2.0, *,
                 search_paths: Iterable[str] | None = None, clock=time.monotonic,
                 rescan_every: int = 5, max_targets: int = MAX_PROBED_FILES):
        self.wanted = wanted
        self.pids = None if pids is None else tuple(int(p) for p in pids)
        self.extra_paths = tuple(check_extra_path(p) for p in extra_paths)
        self.proc_root = Path(proc_root)
        self.interval_s = interval_s
        self.search_paths = None if search_paths is None else tuple(map(str, search_paths))
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.untraceable: dict[str, str] = {}
        self.max_targets = max_targets
        # (dev, inode) -> target: out (handed out, held), waiting (held, over the cap).
        self._returned: dict[tuple[int, int], LibraryTarget] = {}
        self._waiting: dict[tuple[int, int], LibraryTarget] = {}
        self._released: list[LibraryTarget] = []
        # The targets each live process mapped when its maps were last read.
        self._held_by_pid: dict[int, frozenset[tuple[int, int]]] = {}
        self._wanted_by_file: _Recent = _Recent(MAX_REMEMBERED_FILES)
        # (dev as maps prints it, inode) -> (dev, inode) of the target it is, or None.
        self._maps_seen: _Recent = _Recent(MAX_REMEMBERED_FILES)
        self._interpreter_dirs: dict[int, set[str]] = {}
        self._libs_without_symbols: set[str] = set()
        self._noted: _Recent = _Recent(MAX_NOTED)
        self._last_poll: float | None = None
        self._globs = GlobCache()
        self.rescan_every = max(1, rescan_every)
        self._polls = 0
        # Processes read whole: what they ran then, and the site-packages
        # they use (host -> as seen).
        self._settled: dict[int, tuple[str, dict[str, str]]] = {}
        # Each process whose maps are read is told to on_read(pid) as it is
        # read (the kernel counts those that exit unread); until there is
        # one, kept for take_read().
        self.on_read: Callable[[int], None] | None = None
        self._read: _Recent = _Recent(MAX_REMEMBERED_FILES)

    @property
    def targets(self) -> list[LibraryTarget]:
        """The targets out now: returned, and not released since."""
        return list(self._returned.values())

    def remembered(self) -> dict[str, int]:
        """How much is kept about files and processes (all of it bounded)."""
        return {"parsed_files": len(self._wanted_by_file), "mapped_files": len(self._maps_seen),
                "processes": len(self._held_by_pid), "targets": len(self._returned),
                "waiting": len(self._waiting)}

    def take_read(self) -> list[int]:
        """The processes whose maps were read since the last call while
        there was no on_read."""
        pids = list(self._read)
        self._read.clear()
        return pids

    def take_released(self) -> list[LibraryTarget]:
        """The targets released since the last call: no live process maps
        them and no path names them any more."""
        released, self._released = self._released, []
        return released

    def poll_if_due(self) -> list[LibraryTarget]:
        """poll() when interval_s has passed since the last one, else []."""
        if self._last_poll is not None and self.clock() - self._last_poll < self.interval_s:
            return []
        return self.poll()

    def poll(self) -> list[LibraryTarget]:
        self._last_poll = self.clock()
        found = self._scan()
        held = {ident for ident, t in found.items() if not t.origin.startswith("maps:")}
        held.update(*self._held_by_pid.values())
        self._release_unheld(held)
        new = self._hand_out(found)
        self.counters["probed"] = len(self._returned)
        self.counters["waiting"] = len(self._waiting)
        return new

    def _release_unheld(self, held: set) -> None:
        gone = [ident for ident in self._returned if ident not in held]
        for ident in gone:
            self._released.append(self._returned.pop(ident))
        stale = [ident for ident in self._waiting if ident not in held]
        for ident in stale:
            del self._waiting[ident]
        self.counters["released"] += len(gone)
        self._forget_files(set(gone) | set(stale))

    def _forget_files(self, idents: set) -> None:
        """Drop what is remembered of these files: found again, they are
        looked at afresh."""
        if not idents:
            return
        for key in [k for k, ident in self._maps_seen.items() if ident in idents]:
            del self._maps_seen[key]
        for key in [k for k in self._wanted_by_file if (k.dev, k.ino) in idents]:
            del self._wanted_by_file[key]

    def _hand_out(self, found: dict) -> list[LibraryTarget]:
        """The waiting targets, oldest first, then the new ones, while fewer
        than max_targets are out; the rest wait."""
        new = []
        candidates = list(self._waiting.values()) + [
            t for ident, t in found.items()
            if ident not in self._returned and ident not in self._waiting]
        for target in candidates:
            ident = (target.dev, target.inode)
            if len(self._returned) >= self.max_targets:
                if ident not in self._waiting:
                    self._waiting[ident] = target
                    self.counters["over_cap"] += 1
                continue
            self._waiting.pop(ident, None)
            self._returned[ident] = target
            new.append(target)
        self.counters["targets"] += len(new)
        return new

    # ----- one scan, every source, first source of a file wins -------------

    def _scan(self) -> dict[tuple[int, int], LibraryTarget]:
        found: dict[tuple[int, int], LibraryTarget] = {}
        for path in self.extra_paths:
            self._note(self._consider(found, path, "--lib"), path)
            if self._defines_nothing(path):
                # Named by the user yet defines nothing this program probes
                # (another program's library, perhaps): say so once.
                self._libs_without_symbols.add(path)
        self.counters["lib_without_wanted_symbols"] = len(self._libs_without_symbols)
        site_dirs: dict[str, str] = {}
        self._polls += 1
        for pid in self._process_ids():
            known = self._settled.get(pid)
            if known is not None and (pid + self._polls) % self.rescan_every \
                    and known[0] == self._image(pid):
                for host, seen_as in known[1].items():
                    site_dirs.setdefault(host, seen_as)
                continue
            self._scan_process(pid, found, site_dirs)
        globbed = self._scan_site_packages(site_dirs, found)
        for pattern in self._search_globs():
            globbed.add(pattern)
            for path in self._globs.glob(pattern):
                self._note(self._consider(found, path, "system", plain_path=path), path)
        self._globs.forget(globbed)
        return found

    def _note(self, reason: str | None, about, count: int = 1) -> None:
        """Count a problem once per thing it is about, however many polls see
        it (of the last MAX_NOTED things)."""
        if reason and count and (reason, about) not in self._noted:
            self._noted[(reason, about)] = None
            self.counters[reason] += count

    def _defines_nothing(self, path: str) -> bool:
        try:
            return self._wanted_by_file.get(FileKey.of(os.stat(path))) == frozenset()
        except OSError:
            return False

    def _process_ids(self) -> list[int]:
        if self.pids is not None:
            return list(self.pids)
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            self._note("unreadable_proc", str(self.proc_root))
            return []
        pids = sorted(int(n) for n in names if n.isascii() and n.isdigit())
        alive = set(pids)
        for cache in (self._interpreter_dirs, self._settled, self._held_by_pid):
            for gone in set(cache) - alive:
                del cache[gone]
        return pids

    def _scan_process(self, pid: int, found: dict, site_dirs: dict[str, str]) -> None:
        """Read `pid`'s maps; it counts as settled (read again only every
        rescan_every polls) when every mapped file could be looked at."""
        self._settled.pop(pid, None)
        image = self._image(pid)
        try:
            maps = read_maps(self.proc_root, pid)
        except _GONE:
            self._note("vanished", pid)
            self._held_by_pid.pop(pid, None)
            return
        except OSError:
            self._note("unreadable_proc", pid)
            return
        self._note("maps_malformed_lines", pid, maps.malformed_lines)
        if self.on_read is not None:
            self.on_read(pid)
        else:
            self._read[pid] = None
        origin = f"maps:{pid}"
        looked_at: set[tuple[str, int]] = set()
        holding: set[tuple[int, int]] = set()
        settled = True
        for i, path in enumerate(maps.paths):
            if not maps.file_backed(i):
                continue
            key = (maps.devs[i], int(maps.inodes[i]))
            if key in looked_at:
                continue
            looked_at.add(key)
            if key in self._maps_seen:
                ident = self._maps_seen.get(key)
                if ident is not None:
                    holding.add(ident)
                continue
            if path.endswith(DELETED_SUFFIX):
                # Replaced or removed since it was mapped: only map_files still
                # reaches the inode the process runs.
                self._note("deleted_mapping", key)
                start, end = int(maps.starts[i]), int(maps.ends[i])
                host = str(self.proc_root / str(pid) / "map_files" / f"{start:x}-{end:x}")
                ident = self._look_at(found, host, origin)[1]
                self._maps_seen[key] = ident     # map_files works now or never
                holding.update([ident] if ident else [])
                continue
            problem, ident = self._look_at(found, in_process_root(self.proc_root, pid, path),
                                           origin, plain_path=path)
            if problem:
                # Not reachable now (the process may be exiting): look again
                # next poll, count it once.
                self._note(problem, key)
                settled = False
            else:
                self._maps_seen[key] = ident
                holding.update([ident] if ident else [])
        self._held_by_pid[pid] = frozenset(holding)
        own = {in_process_root(self.proc_root, pid, container_dir): container_dir
               for container_dir in self._python_site_dirs(pid, maps)}
        for host, seen_as in own.items():
            site_dirs.setdefault(host, seen_as)
        if settled:
            self._settled[pid] = (image, own)

    def _image(self, pid: int) -> str:
        """What `pid` runs (its exe link): a process that exec()s another
        program keeps its pid, and is read whole again."""
        try:
            return os.readlink(f"{self.proc_root}/{pid}/exe")
        except OSError:
            return ""

    # ----- Python site-packages --------------------------------------------

    def _python_site_dirs(self, pid: int, maps: ProcessMaps) -> set[str]:
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
            # An interpreter's prefix and venv do not change: look them up once.
            if pid not in self._interpreter_dirs:
                found = self._venv_site_dirs(pid)
                for prefix in prefixes:
                    found |= self._prefix_site_dirs(pid, prefix)
                self._interpreter_dirs[pid] = found
            dirs |= self._interpreter_dirs[pid]
        return dirs

    def _prefix_site_dirs(self, pid: int, prefix: str) -> set[str]:
        root = in_process_root(self.proc_root, pid, "/")
        patterns = ("lib/python3*/site-packages", "lib/python3*/dist-packages",
                    "lib64/python3*/site-packages", "local/lib/python3*/dist-packages",
                    "lib/python3/dist-packages")
        dirs = set()
        for pattern in patterns:
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

    def _scan_site_packages(self, site_dirs: dict[str, str], found: dict) -> set[str]:
        """Look at the libraries wheels install in `site_dirs`; returns the
        glob patterns used."""
        seen_dirs, patterns = set(), set()
        for host_dir, container_dir in sorted(site_dirs.items()):
            try:
                st = os.stat(host_dir)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen_dirs:
                continue
            seen_dirs.add((st.st_dev, st.st_ino))
            for pattern in SITE_PACKAGES_GLOBS:
                patterns.add(os.path.join(host_dir, pattern))
                for host in self._globs.glob(os.path.join(host_dir, pattern)):
                    plain = container_dir + host[len(host_dir):]
                    self._note(self._consider(found, host, "site-packages", plain_path=plain),
                               host)
        return patterns

    def _search_globs(self) -> list[str]:
        if self.search_paths is not None:
            return list(self.search_paths)
        return default_search_globs() + ldconfig_libraries()

    # ----- one file -------------------------------------------------------

    def _consider(self, found: dict, host_path: str, origin: str,
                  plain_path: str | None = None) -> str | None:
        """Add `host_path` to `found` when it defines a wanted symbol. None
        when the file is settled (looked at, or already found); the reason
        when it cannot be reached now and is worth another look later."""
        return self._look_at(found, host_path, origin, plain_path)[0]

    def _look_at(self, found: dict, host_path: str, origin: str,
                 plain_path: str | None = None) -> tuple[str | None, tuple[int, int] | None]:
        """_consider's answer, and the (dev, inode) of the file when it is a
        target (None when it is not, or cannot be looked at now)."""
        try:
            st = os.stat(host_path)
        except FileNotFoundError:
            return "missing_file", None
        except OSError:
            return "unreadable_file", None
        if not stat.S_ISREG(st.st_mode):
            return None, None
        ident = (st.st_dev, st.st_ino)
        if ident in found:
            return None, ident
        symbols = self._wanted_symbols(host_path, st, plain_path or host_path)
        if isinstance(symbols, str):
            return symbols, None
        if not symbols:
            return None, None
        found[ident] = LibraryTarget(self._usable_path(host_path, plain_path, st),
                                     st.st_dev, st.st_ino, symbols, origin)
        return None, ident

    def _wanted_symbols(self, path: str, st: os.stat_result,
                        shown_as: str) -> frozenset[str] | str:
        """The wanted symbols `path` defines, at any binding (a static
        runtime's are local), parsed once per file version; a reason string
        when the file cannot be read now."""
        key = FileKey.of(st)
        cached = self._wanted_by_file.get(key)
        if cached is not None:
            return cached
        try:
            elf = ElfSymbols.read(path)
        except NotElfError:
            self.counters["not_elf"] += 1
            result = frozenset()
        except ElfError:
            self.counters["elf_unreadable"] += 1
            result = frozenset()
        except _GONE:
            return "vanished"
        except OSError:
            return "unreadable_file"
        else:
            self.counters["examined"] += 1
            key = elf.key
            prefixes = getattr(self.wanted, "prefixes", None)
            names = (elf.defined_functions_starting(prefixes) if prefixes
                     else elf.defined_functions(local=True))
            result = frozenset(name for name in names if self.wanted(name))
            why = untraceable_reason(elf) if not result else None
            if why and shown_as not in self.untraceable:
                if len(self.untraceable) < MAX_UNTRACEABLE:
                    self.untraceable[shown_as] = why
                self.counters["untraceable"] += 1
        self._wanted_by_file[key] = result
        return result

    @staticmethod
    def _usable_path(host_path: str, plain_path: str | None, st: os.stat_result) -> str:
        """The plain path, symlinks resolved, when it names the same file on
        the host (no container in between), else the /proc/PID/root path."""
        if plain_path:
            try:
                plain = os.stat(plain_path)
            except OSError:
                return host_path
            if (plain.st_dev, plain.st_ino) == (st.st_dev, st.st_ino):
                return os.path.realpath(plain_path)
        return host_path


def untraceable_reason(elf: ElfSymbols) -> str | None:
    """Why a file that defines no probed symbol still runs CUDA code that
    cannot be traced, else None: a CUDA runtime linked statically (nvcc's
    default) into a file stripped of its symbol table. The runtime's
    functions then have no names to attach to. Its signs: kernels embedded
    (.nvFatBinSegment) and neither libcudart nor libcuda linked."""
    if elf.has_symbol_table or ".nvFatBinSegment" not in elf.section_names:
        return None
    if any(lib.startswith(("libcudart.so", "libcuda.so")) for lib in elf.needed):
        return None
    return ("carries a static CUDA runtime (embedded kernels in .nvFatBinSegment, no "
            "libcudart linked) and has no symbol table (stripped): its CUDA calls cannot "
            "be probed; build it with -cudart shared, or keep its symbols (no strip, no -s)")


def check_extra_path(path: str | os.PathLike) -> str:
    """A --lib path made absolute; ValueError naming the path and the problem."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"--lib {path}: no such file; expected an ELF shared library "
                         "or executable") from None
    except OSError as exc:
        raise ValueError(f"--lib {path}: cannot stat it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"--lib {path}: not a regular file; expected an ELF shared library "
                         "or executable")
    try:
        ElfSymbols.read(path)
    except NotElfError as exc:
        raise ValueError(f"--lib {path}: not an ELF file ({exc})") from None
    except ElfError as exc:
        raise ValueError(f"--lib {path}: unreadable ELF file ({exc})") from None
    except OSError as exc:
        raise ValueError(f"--lib {path}: cannot read it ({exc.strerror})") from None
    return path


def default_search_globs(environ=os.environ) -> list[str]:
    globs = list(DEFAULT_SEARCH_GLOBS)
    for var in ASCEND_HOME_VARIABLES:
        home = environ.get(var)
        if home:
            globs += [f"{home}/lib64/*.so*", f"{home}/*-linux/lib64/*.so*"]
    return globs


_ldconfig_cache: dict[tuple, list[str]] = {}


def ldconfig_libraries(cache_file: Path = Path("/etc/ld.so.cache")) -> list[str]:
    """Paths of the CUDA / CANN libraries the dynamic linker's cache lists
    (`ldconfig -p`), read again only when the cache file changes."""
    try:
        st = os.stat(cache_file)
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError:
        return []
    if stamp in _ldconfig_cache:
        return _ldconfig_cache[stamp]
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
    _ldconfig_cache.clear()
    _ldconfig_cache[stamp] = paths
    return paths


# ----- mmtrace doctor --------------------------------------------------------

def _installed_files(search_paths: Iterable[str] | None) -> list[str]:
    """Existing files in the install paths, the ldconfig cache and this
    interpreter's site-packages, one per inode."""
    patterns = (list(search_paths) if search_paths is not None
                else default_search_globs() + ldconfig_libraries())
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
    files = _installed_files(search_paths)
    return [check_cuda_runtime(files), check_cuda_driver(files, host), check_nvml(),
            check_ascend(files)]
