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

import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

from mmtrace.agent.discovery.glob_cache import GlobCache
from mmtrace.agent.due import due
from mmtrace.agent.discovery.install_paths import (SITE_PACKAGES_GLOBS, LdconfigLibraries,
                                                   default_search_globs)
from mmtrace.agent.discovery.library_files import (LibraryFiles, LibraryTarget, Wanted,
                                                   check_extra_path)
from mmtrace.agent.discovery.process_scan import ProcessScan
from mmtrace.agent.discovery.recent import Recent

# Targets handed out at once. A probed libcudart costs 15 descriptors (14
# links and the file), and closing a link waits for a grace period: 128
# such files close in about 3 s from 48 threads, within the stop deadline.
MAX_PROBED_FILES = 128
MAX_NOTED = 8192                # problems remembered so as to count each once


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
    (targets out now), maps_read (processes whose maps were read so far),
    following_changes (1 once the kernel tells which processes changed).

    `untraceable`: path -> why, for files that carry what is traced but
    cannot be probed (a stripped executable with a static CUDA runtime);
    the first MAX_UNTRACEABLE of them.

    Processes are read as process_scan says (whole at first and after an
    exec, then every `rescan_every` polls). Libraries in install paths and
    in the site-packages of the Python processes seen are looked for every
    poll, so what `import torch` will load is probed before it loads."""

    def __init__(self, wanted: Wanted, pids: Iterable[int] | None = None,
                 extra_paths: Iterable[str | os.PathLike] = (),
                 proc_root: Path = Path("/proc"), interval_s: float = 2.0, *,
                 search_paths: Iterable[str] | None = None, clock=time.monotonic,
                 rescan_every: int = 5, max_targets: int = MAX_PROBED_FILES):
        self.wanted = wanted
        self.extra_paths = tuple(check_extra_path(p) for p in extra_paths)
        self.proc_root = Path(proc_root)
        self.interval_s = interval_s
        self.search_paths = None if search_paths is None else tuple(map(str, search_paths))
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.max_targets = max_targets
        # (dev, inode) -> target: out (handed out, held), waiting (held, over the cap).
        self._returned: dict[tuple[int, int], LibraryTarget] = {}
        self._waiting: dict[tuple[int, int], LibraryTarget] = {}
        self._released: list[LibraryTarget] = []
        self._files = LibraryFiles(wanted, self.counters)
        self._processes = ProcessScan(self._files, self._note,
                                      None if pids is None else tuple(int(p) for p in pids),
                                      self.proc_root, rescan_every)
        self._libs_without_symbols: set[str] = set()
        self._noted: Recent = Recent(MAX_NOTED)
        self._last_poll: float | None = None
        self._globs = GlobCache()
        self._ldconfig = LdconfigLibraries()

    @property
    def untraceable(self) -> dict[str, str]:
        return self._files.untraceable

    @property
    def on_read(self) -> Callable[[int], None] | None:
        """Told each pid as its maps are read (the kernel counts those that
        exit unread); until set, the pids are kept for take_read()."""
        return self._processes.on_read

    @on_read.setter
    def on_read(self, mark: Callable[[int], None] | None) -> None:
        self._processes.on_read = mark

    @property
    def targets(self) -> list[LibraryTarget]:
        """The targets out now: returned, and not released since."""
        return list(self._returned.values())

    def remembered(self) -> dict[str, int]:
        """How much is kept about files and processes (all of it bounded)."""
        return {"parsed_files": len(self._files), **self._processes.remembered(),
                "targets": len(self._returned), "waiting": len(self._waiting)}

    def take_read(self) -> list[int]:
        """The processes whose maps were read since the last call while
        there was no on_read."""
        return self._processes.take_read()

    def take_released(self) -> list[LibraryTarget]:
        """The targets released since the last call: no live process maps
        them and no path names them any more."""
        released, self._released = self._released, []
        return released

    def poll_if_due(self) -> list[LibraryTarget]:
        """poll() when interval_s has passed since the last one (agent/due.py:
        a little early counts), else []."""
        if self._last_poll is not None and not due(self.clock() - self._last_poll,
                                                   self.interval_s):
            return []
        return self.poll()

    def poll(self) -> list[LibraryTarget]:
        self._last_poll = self.clock()
        found = self._scan()
        held = {ident for ident, t in found.items() if not t.origin.startswith("maps:")}
        held |= self._processes.held()
        self._release_unheld(held)
        new = self._hand_out(found)
        self.counters["probed"] = len(self._returned)
        self.counters["waiting"] = len(self._waiting)
        self.counters["maps_read"] = self._processes.maps_read
        return new

    def follow(self, changes: Callable[[], dict[int, int] | None]) -> None:
        """Read only the processes the kernel says changed from now on
        (ProcessScan.follow); `changes` is DeviceProbes.process_changes()."""
        self._processes.follow(changes)
        self.counters["following_changes"] = 1

    def _release_unheld(self, held: set) -> None:
        gone = [ident for ident in self._returned if ident not in held]
        for ident in gone:
            self._released.append(self._returned.pop(ident))
        stale = [ident for ident in self._waiting if ident not in held]
        for ident in stale:
            del self._waiting[ident]
        self.counters["released"] += len(gone)
        # What is remembered of these files goes: found again, they are
        # looked at afresh.
        idents = set(gone) | set(stale)
        if idents:
            self._processes.forget_files(idents)
            self._files.forget(idents)

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
            self._note(self._files.look_at(found, path, "--lib")[0], path)
            if self._files.defines_nothing(path):
                # Named by the user yet defines nothing this program probes
                # (another program's library, perhaps): say so once.
                self._libs_without_symbols.add(path)
        self.counters["lib_without_wanted_symbols"] = len(self._libs_without_symbols)
        site_dirs = self._processes.scan(found)
        globbed = self._scan_site_packages(site_dirs, found)
        for pattern in self._search_globs():
            globbed.add(pattern)
            for path in self._globs.glob(pattern):
                self._note(self._files.look_at(found, path, "system", plain_path=path)[0], path)
        self._globs.forget(globbed)
        return found

    def _note(self, reason: str | None, about, count: int = 1) -> None:
        """Count a problem once per thing it is about, however many polls see
        it (of the last MAX_NOTED things)."""
        if reason and count and (reason, about) not in self._noted:
            self._noted[(reason, about)] = None
            self.counters[reason] += count

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
                    self._note(self._files.look_at(found, host, "site-packages",
                                                   plain_path=plain)[0], host)
        return patterns

    def _search_globs(self) -> list[str]:
        if self.search_paths is not None:
            return list(self.search_paths)
        return default_search_globs() + self._ldconfig.paths()
