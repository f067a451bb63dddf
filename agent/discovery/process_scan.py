"""The files running processes map, read from /proc/PID/maps (opened
through /proc/PID/root, so files inside containers are found), and which of
them each live process holds.

A process is read whole the first poll that sees it, and again once it
exec()s; after that its maps are read again every `rescan_every` polls
(a fifth of the processes each poll), which is where new dlopen()s show.
Reading every maps file every poll was most of an idle agent's CPU.

Once the kernel tells which processes changed (follow(): exec, fork, a file
mapped executable, exit, from bpf/device.h), a poll reads those alone and
lists /proc only every SWEEP_EVERY polls (for what was missed): the cost of
a poll no longer grows with the number of processes running.
"""

import os
from pathlib import Path
from typing import Callable

from mmtrace.agent.discovery.library_files import MAX_REMEMBERED_FILES, LibraryFiles
from mmtrace.agent.discovery.proc_maps import (DELETED_SUFFIX, ProcessMaps, in_process_root,
                                               read_maps)
from mmtrace.agent.discovery.python_site_dirs import PythonSiteDirs
from mmtrace.agent.discovery.recent import Recent
from mmtrace.bpf.device import CHANGE_EXIT, CHANGE_LEADER_EXIT

_GONE = (FileNotFoundError, ProcessLookupError)
SWEEP_EVERY = 30        # polls between listings of /proc while changes are followed

# note(reason, about, count=1): count a problem once per thing it is about.
Note = Callable[..., None]


class ProcessScan:
    """Reads the maps of the processes (`pids`, or every process under
    `proc_root`), looks at each mapped file through `files`, and remembers
    which targets each live process holds."""

    def __init__(self, files: LibraryFiles, note: Note, pids: tuple[int, ...] | None,
                 proc_root: Path, rescan_every: int):
        self.files = files
        self.note = note
        self.pids = pids
        self.proc_root = Path(proc_root)
        self.rescan_every = max(1, rescan_every)
        self._polls = 0
        # The targets each live process mapped when its maps were last read.
        self._held_by_pid: dict[int, frozenset[tuple[int, int]]] = {}
        # (dev as maps prints it, inode) -> (dev, inode) of the target it is, or None.
        self._maps_seen: Recent = Recent(MAX_REMEMBERED_FILES)
        self._site_dirs = PythonSiteDirs(self.proc_root)
        # Processes read whole: what they ran then, and the site-packages
        # they use (host -> as seen).
        self._settled: dict[int, tuple[str, dict[str, str]]] = {}
        # Each process whose maps are read is told to on_read(pid) as it is
        # read (the kernel counts those that exit unread); until there is
        # one, kept for take_read().
        self.on_read: Callable[[int], None] | None = None
        self._read: Recent = Recent(MAX_REMEMBERED_FILES)
        # What the kernel says changed since the last call: pid -> CHANGE_*
        # bits, or None when it could not keep them all (the rounds of before).
        self._changes: Callable[[], dict[int, int] | None] | None = None
        self._read_all_next = True
        self.maps_read = 0

    def follow(self, changes: Callable[[], dict[int, int] | None]) -> None:
        """From the next scan on, read the processes `changes()` names
        (after one more whole scan: what changed before the kernel kept
        count is in none of its lists)."""
        self._changes = changes
        self._read_all_next = True

    def remembered(self) -> dict[str, int]:
        return {"mapped_files": len(self._maps_seen), "processes": len(self._held_by_pid)}

    def held(self) -> set[tuple[int, int]]:
        """The targets some live process mapped when last read."""
        return set().union(*self._held_by_pid.values())

    def take_read(self) -> list[int]:
        """The processes whose maps were read since the last call while
        there was no on_read."""
        pids = list(self._read)
        self._read.clear()
        return pids

    def forget_files(self, idents: set) -> None:
        """Drop which mappings were these files: found again, they are looked
        at afresh."""
        for key in [k for k, ident in self._maps_seen.items() if ident in idents]:
            del self._maps_seen[key]

    def scan(self, found: dict) -> dict[str, str]:
        """Add the targets processes map to `found`; the site-packages folders
        of their Python processes (host path -> as the process sees it)."""
        site_dirs: dict[str, str] = {}
        self._polls += 1
        # The first scan after follow() reads every process; then the notes.
        read_all = self._read_all_next and self._changes is not None
        changes = self._changes() if self._changes is not None and not read_all else None
        self._read_all_next = False
        if changes is not None:
            self._scan_changed(changes, found, site_dirs)
            return site_dirs
        # Not following, or the kernel lost some notes (a flood of new
        # processes): the rounds of before, not every process every poll.
        for pid in self._process_ids():
            known = self._settled.get(pid)
            if not read_all and known is not None and (pid + self._polls) % self.rescan_every \
                    and known[0] == self._image(pid):
                for host, seen_as in known[1].items():
                    site_dirs.setdefault(host, seen_as)
                continue
            self._scan_process(pid, found, site_dirs)
        return site_dirs

    def _scan_changed(self, changes: dict[int, int], found: dict, site_dirs: dict):
        """The processes that changed read again, those that exited
        forgotten; the others as they were."""
        if self._polls % SWEEP_EVERY == 0:
            # What the notes missed: the processes gone unseen forgotten,
            # those never read read now.
            for pid in self._process_ids():
                if pid not in self._held_by_pid and pid not in changes:
                    self._scan_process(pid, found, site_dirs)
        for pid, change in changes.items():
            if self.pids is not None and pid not in self.pids:
                continue
            if change == CHANGE_EXIT or (change == CHANGE_LEADER_EXIT and not os.path.exists(
                    f"{self.proc_root}/{pid}")):
                self._forget(pid)
            elif change != CHANGE_LEADER_EXIT:      # its threads live on: as it was
                self._scan_process(pid, found, site_dirs)
        unsettled = [pid for pid in self._held_by_pid if pid not in self._settled]
        for pid in unsettled:           # a file that could not be looked at: again
            if pid not in changes:
                self._scan_process(pid, found, site_dirs)
        for _, own in self._settled.values():
            for host, seen_as in own.items():
                site_dirs.setdefault(host, seen_as)

    def _forget(self, pid: int) -> None:
        self._settled.pop(pid, None)
        self._held_by_pid.pop(pid, None)
        self._site_dirs.forget(pid)

    def _process_ids(self) -> list[int]:
        if self.pids is not None:
            return list(self.pids)
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            self.note("unreadable_proc", str(self.proc_root))
            return []
        pids = sorted(int(n) for n in names if n.isascii() and n.isdigit())
        alive = set(pids)
        self._site_dirs.forget_gone(alive)
        for cache in (self._settled, self._held_by_pid):
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
            self.note("vanished", pid)
            self._held_by_pid.pop(pid, None)
            return
        except OSError:
            self.note("unreadable_proc", pid)
            return
        self.maps_read += 1
        self.note("maps_malformed_lines", pid, maps.malformed_lines)
        if self.on_read is not None:
            self.on_read(pid)
        else:
            self._read[pid] = None
        holding, settled = self._mapped_targets(pid, maps, found)
        self._held_by_pid[pid] = frozenset(holding)
        own = {in_process_root(self.proc_root, pid, container_dir): container_dir
               for container_dir in self._site_dirs.of_process(pid, maps)}
        for host, seen_as in own.items():
            site_dirs.setdefault(host, seen_as)
        if settled:
            self._settled[pid] = (image, own)

    def _mapped_targets(self, pid: int, maps: ProcessMaps,
                        found: dict) -> tuple[set[tuple[int, int]], bool]:
        """The targets `pid`'s mappings are, and whether every mapped file
        could be looked at."""
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
                self.note("deleted_mapping", key)
                start, end = int(maps.starts[i]), int(maps.ends[i])
                host = str(self.proc_root / str(pid) / "map_files" / f"{start:x}-{end:x}")
                ident = self.files.look_at(found, host, origin)[1]
                self._maps_seen[key] = ident     # map_files works now or never
                holding.update([ident] if ident else [])
                continue
            problem, ident = self.files.look_at(
                found, in_process_root(self.proc_root, pid, path), origin, plain_path=path)
            if problem:
                # Not reachable now (the process may be exiting): look again
                # next poll, count it once.
                self.note(problem, key)
                settled = False
            else:
                self._maps_seen[key] = ident
                holding.update([ident] if ident else [])
        return holding, settled

    def _image(self, pid: int) -> str:
        """What `pid` runs (its exe link): a process that exec()s another
        program keeps its pid, and is read whole again."""
        try:
            return os.readlink(f"{self.proc_root}/{pid}/exe")
        except OSError:
            return ""
