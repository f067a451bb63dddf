"""Name the function a runtime address of a running process is in, from its
/proc/PID/maps and the ELF files mapped there."""

import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from mmtrace.agent.discovery.demangle import demangle
from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.discovery.elf_reader import ElfError, NotElfError
from mmtrace.agent.discovery.elf_symbols import ElfSymbols
from mmtrace.agent.discovery.proc_maps import (DELETED_SUFFIX, ProcessMaps,
                                               mapped_file_candidates, read_maps)

_GONE = (FileNotFoundError, ProcessLookupError)

class AddressResolver:
    """Turn (pid, runtime address) into the demangled name of the function
    holding it. Never raises for a vanished process, an unreadable /proc
    entry or a truncated or replaced file: each failure is counted in
    `counters` by reason and the answer is None.

    Counters: resolved, no_symbol (inside a mapped ELF, between functions),
    no_mapping, not_file_backed (heap, stack, JIT code), process_gone,
    maps_unreadable, maps_malformed_lines, file_missing, file_unreadable,
    file_deleted (deleted and map_files unavailable), not_elf,
    elf_unreadable (truncated or corrupt), name_truncated; with `images`,
    resolved_after_exit and unresolved_after_exit.

    `images(pid)` -> [(load bias, ElfSymbols)], where given, names the
    addresses of a process that has exited from its files on disk
    (agent/discovery/process_images.py).

    `elf_cache` holds the files that mapped addresses are resolved against,
    shared with whoever forgets released files; without one the resolver
    makes its own."""

    def __init__(self, proc_root: Path = Path("/proc"), *, max_processes: int = 4096,
                 refresh_interval_s: float = 0.05, max_name_len: int = 4096,
                 clock=time.monotonic, images=None, elf_cache: ElfCache | None = None):
        self.images = images
        self.elf_cache = elf_cache if elf_cache is not None else ElfCache()
        self.proc_root = Path(proc_root)
        self.max_processes = max_processes
        # A miss re-reads the maps (a library dlopen'ed since), at most this
        # often per process: JIT code never resolves and must not cost a read
        # per event.
        self.refresh_interval_s = refresh_interval_s
        self.max_name_len = max_name_len
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self._maps: OrderedDict[int, ProcessMaps] = OrderedDict()
        self._lock = threading.Lock()
        self._next_forget = 0.0

    def forget(self, pid: int) -> None:
        """Drop what is cached for `pid` (the process exited; its pid may be reused)."""
        with self._lock:
            self._maps.pop(pid, None)

    # How often forget_exited looks: it costs a stat per cached process.
    FORGET_EXITED_EVERY_S = 1.0

    def forget_exited(self) -> int:
        """Drop the maps of the processes that have exited, at most every
        FORGET_EXITED_EVERY_S (a call in between does nothing); returns how
        many. A short-lived process's maps would otherwise stay until
        max_processes newer ones pushed them out."""
        now = self.clock()
        if now < self._next_forget:
            return 0
        self._next_forget = now + self.FORGET_EXITED_EVERY_S
        with self._lock:
            pids = list(self._maps)
        gone = [pid for pid in pids if not (self.proc_root / str(pid)).exists()]
        with self._lock:
            for pid in gone:
                self._maps.pop(pid, None)
        forget = getattr(self.images, "forget", None)
        if forget is not None:
            forget(self.proc_root)
        return len(gone)

    def resolve(self, pid: int, addr: int) -> str | None:
        if addr < 0 or addr >= 1 << 64:
            self.counters["no_mapping"] += 1
            return None
        return self.resolve_many(pid, np.array([addr], dtype=np.uint64))[0]

    def resolve_many(self, pid: int, addrs: np.ndarray, namer=None) -> list[str | None]:
        """Resolve a batch of addresses of one process: a dict lookup for the
        addresses seen before (a model launches the same kernels over and
        over), one vectorised pass for the rest. `namer(raw symbol, ElfSymbols)`
        -> name or None replaces demangling (its answers are not cached)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        out: list[str | None] = [None] * len(addrs)
        if not len(addrs):
            return out
        maps = self._process_maps(pid, refresh=False)
        if maps is None:
            return self._after_exit(pid, addrs, out, namer)
        pending = np.arange(len(addrs)) if namer else np.array(
            self._from_cache(maps, addrs, out), dtype=np.int64)
        if not len(pending):
            return out
        where = maps.find_many(addrs[pending])
        if (where < 0).any() and self.clock() - maps.read_at >= self.refresh_interval_s:
            fresh = self._process_maps(pid, refresh=True)
            if fresh is None:
                return out
            maps, where = fresh, fresh.find_many(addrs[pending])
        self.counters["no_mapping"] += int((where < 0).sum())
        for i in np.unique(where[where >= 0]).tolist():
            rows = pending[where == i]
            for row, name, reason in zip(rows.tolist(), *self._in_mapping(
                    pid, maps, i, addrs[rows], namer)):
                out[row] = name
                self.counters[reason] += 1
                if namer is None:
                    self._remember(maps, int(addrs[row]), name, reason)
        return out

    def _after_exit(self, pid: int, addrs: np.ndarray, out: list, namer=None) -> list:
        """Names from the files the process had loaded, where the kernel
        told where (images); the process itself is gone."""
        if self.images is None:
            return out
        found = self.images.images(pid)
        for row, addr in enumerate(addrs.tolist()):
            for bias, elf in found:
                vaddr = (addr - bias) % (1 << 64)
                raw = elf.function_at(vaddr) if elf.segments.holds_vaddr(vaddr) else None
                if raw is not None:
                    out[row] = namer(raw, elf) if namer else self._present(raw)
                    break
            self.counters["resolved_after_exit" if out[row] else "unresolved_after_exit"] += 1
        return out

    # Outcomes are cached per maps version; a process that resolves this many
    # distinct addresses (JIT code) starts its cache over.
    MAX_CACHED_ADDRESSES = 1 << 16

    def _from_cache(self, maps: ProcessMaps, addrs: np.ndarray, out: list) -> list[int]:
        """Fill `out` from the cache; return the rows still to resolve."""
        pending = []
        cache = maps.outcomes
        for row, addr in enumerate(addrs.tolist()):
            hit = cache.get(addr)
            if hit is None:
                pending.append(row)
            else:
                out[row] = hit[0]
                self.counters[hit[1]] += 1
        return pending

    def _remember(self, maps: ProcessMaps, addr: int, name: str | None, reason: str) -> None:
        if len(maps.outcomes) >= self.MAX_CACHED_ADDRESSES:
            maps.outcomes.clear()
        maps.outcomes[addr] = (name, reason)

    def _in_mapping(self, pid: int, maps: ProcessMaps, i: int, addrs: np.ndarray,
                    namer=None):
        """(names, reasons) for addresses inside mapping i."""
        elf = self._mapping_elf(pid, maps, i)
        if not isinstance(elf, ElfSymbols):
            return [None] * len(addrs), [elf] * len(addrs)
        offsets = addrs - maps.starts[i] + maps.offsets[i]
        vaddrs, ok = elf.segments.vaddrs_of_offsets(offsets)
        names, reasons = [], []
        for valid, raw in zip(ok.tolist(), elf.functions_at(vaddrs)):
            found = valid and raw is not None
            names.append(None if not found else namer(raw, elf) if namer
                         else self._present(raw))
            reasons.append("resolved" if found else "no_symbol")
        return names, reasons

    def _present(self, raw: str) -> str:
        name = demangle(raw)
        if len(name) > self.max_name_len:
            self.counters["name_truncated"] += 1
            name = name[:self.max_name_len - 1] + "\u2026"
        return name

    def _process_maps(self, pid: int, refresh: bool) -> ProcessMaps | None:
        with self._lock:
            cached = self._maps.get(pid)
            if cached is not None and not refresh:
                self._maps.move_to_end(pid)
                return cached
        try:
            maps = read_maps(self.proc_root, pid)
        except _GONE:
            self.counters["process_gone"] += 1
            self.forget(pid)
            return None
        except OSError:
            self.counters["maps_unreadable"] += 1
            return None
        maps.read_at = self.clock()
        self.counters["maps_malformed_lines"] += maps.malformed_lines
        with self._lock:
            self._maps[pid] = maps
            self._maps.move_to_end(pid)
            while len(self._maps) > self.max_processes:
                self._maps.popitem(last=False)
        return maps

    def _mapping_elf(self, pid: int, maps: ProcessMaps, i: int):
        """ElfSymbols of mapping i, or the counter name saying why not."""
        cached = maps.elfs.get(i)
        if cached is not None:
            return cached
        result = self._open_mapping(pid, maps, i)
        maps.elfs[i] = result
        return result

    def _open_mapping(self, pid: int, maps: ProcessMaps, i: int):
        if not maps.file_backed(i):
            return "not_file_backed"
        reason = "file_deleted" if maps.paths[i].endswith(DELETED_SUFFIX) else "file_missing"
        for candidate in mapped_file_candidates(self.proc_root, pid, maps, i):
            try:
                return self.elf_cache.open(candidate)
            except NotElfError:
                return "not_elf"
            except ElfError:
                return "elf_unreadable"
            except FileNotFoundError:
                continue
            except OSError:
                reason = "file_unreadable"
        return reason
