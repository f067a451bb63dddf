"""Names the kernel cannot give, found while the process still runs.

- cudaLaunchKernel's first argument is the kernel's host stub: its symbol
  (demangled) is the kernel's name. The address means something only in
  that process, so it is resolved at record time, once per (pid, address),
  and the recording keeps the table (`op_names` meta chunks). So is the
  host function a __cudaGetKernel call turns into a cudaKernel_t (what
  CUDA 13's <<<>>> launches with).
- A runtime launch's callers (return_ip, outer_return_ip): where one is
  nvcc's per-kernel host stub, __device_stub__<mangled kernel>, the row
  names the kernel, so that a launch whose handle names nothing (no
  __cudaGetKernel seen: it failed, or ran before tracing) is named by it.
- aclnn ops attached without a cookie (kernels older than 5.15) carry the
  probed address instead: resolved the same way.
- An opType or kernel name the kernel could not read (its page was not
  yet in memory) is read here through /proc/PID/mem at the address the
  event carries, and written into the event.

Work is per batch and per distinct key; every failure is counted by reason.
"""

import os
import re
import time
from collections import Counter, OrderedDict
from pathlib import Path

import numpy as np

from mmtrace.bpf import device as device_stream

READ_LIMIT = 4096
FORGET_EVERY_S = 1.0        # how often exited processes are looked for (a stat each)
# nvcc names the host stub of kernel K (mangled _Z...) __device_stub__Z...:
# demangled, the stub's name starts with that text.
_DEVICE_STUB = re.compile(r"^__device_stub__(Z\w+)")


_SIMPLE_NAME = re.compile(r"^_Z(\d+)")


def kernel_of_stub(raw: str, elf) -> str | None:
    """The kernel a host stub (raw symbol `raw` of ElfSymbols `elf`) launches,
    named as its host function is (what cudaLaunchKernel is given), else
    None: _Z41__device_stub__ZN6vision11patch_embedEPfiPfi ->
    "vision::patch_embed(float*, int)". The stub's name always carries a
    mangled name; an extern "C" kernel's host function has the plain one."""
    from mmtrace.agent.discovery.demangle import demangle
    match = _DEVICE_STUB.match(demangle(raw))
    if match is None:
        return None
    mangled = "_" + match.group(1)
    simple = _SIMPLE_NAME.match(mangled)
    if simple and not elf.defines(mangled):
        plain = mangled[simple.end():simple.end() + int(simple.group(1))]
        if elf.defines(plain):
            return plain
    return demangle(mangled)


class DeviceNames:
    def __init__(self, infos: dict, resolver=None, proc_root: Path = Path("/proc"),
                 max_cached: int = 1 << 18):
        self.proc_root = Path(proc_root)
        self.resolver = resolver if resolver is not None else _default_resolver()
        self.max_cached = max_cached
        self.counters: Counter[str] = Counter()
        # pid -> the addresses of it named (or found nameless) so far, the
        # processes seen last at the end; max_cached addresses in all.
        self._seen: OrderedDict[int, set[int]] = OrderedDict()
        self._seen_count = 0
        self._next_forget = 0.0
        by_symbol = {info.symbol: info for info in infos.values()}
        cudart = {i: info for i, info in infos.items() if info.library == "cudart"}
        # Launches take the host function, or a cudaKernel_t named through
        # the __cudaGetKernel call that made it (its host function, alias).
        # As lookups by API id (device_stream.id_table), not np.isin's sort per batch.
        self._stub_apis = device_stream.id_table(
            i for i, info in cudart.items() if info.kind == "launch")
        self._alias_apis = device_stream.id_table(
            i for i, info in cudart.items() if info.kind == "function_name")
        self._caller_apis = self._stub_apis
        aclnn = by_symbol.get("aclnn")
        self._aclnn_api = aclnn.id if aclnn else None

    def report(self) -> dict[str, int]:
        """Every count of what was named and why not: these, the address
        resolver's (process_gone, no_symbol, resolved_after_exit, ...) and
        its images' (no_load_frames, build_id_unknown)."""
        out = dict(self.counters)
        resolver = self.resolver
        for source in (getattr(resolver, "counters", {}),
                       getattr(getattr(resolver, "images", None), "counters", {})):
            for name, value in source.items():
                out[f"address_{name}"] = out.get(f"address_{name}", 0) + int(value)
        return out

    def process(self, batch: np.ndarray) -> list[list]:
        """Fill unread names in `batch` (in place); return the new
        [pid, address, name] rows for the recording's op_names table."""
        if not len(batch):
            return []
        self._read_missing_strings(batch)
        rows = []
        for pid, addrs in self._addresses(batch):
            rows += self._resolve(pid, addrs)
        for pid, addrs in self._callers(batch):
            rows += self._resolve_callers(pid, addrs)
        return rows

    # ----- addresses of this batch that name something -------------------

    def _addresses(self, batch: np.ndarray):
        """(pid, distinct addresses not seen before) for each process."""
        api = batch["api"]
        stub = device_stream.in_table(api, self._stub_apis) & (batch["handle"] != 0)
        alias = device_stream.in_table(api, self._alias_apis) & (batch["alias"] != 0)
        # A cudaKernel_t is named through its host function (alias), never
        # looked up as an address of the process itself.
        made = alias & (batch["handle"] != 0) & (batch["handle"] != batch["alias"])
        for pid, handle in zip(batch["pid"][made].tolist(), batch["handle"][made].tolist()):
            self._remember((pid, handle))
        by_ip = np.zeros(len(batch), bool)
        if self._aclnn_api is not None:
            by_ip = (batch["api"] == self._aclnn_api) & (batch["symbol_id"] == 0)
        wanted = stub | alias | by_ip
        addrs = np.where(stub, batch["handle"],
                         np.where(alias, batch["alias"], batch["probe_ip"]))[wanted]
        yield from self._fresh(batch["pid"][wanted], addrs)

    def _callers(self, batch: np.ndarray):
        # The three fields, not the launches' whole records: a batch is tens
        # of thousands of launches at the rates the probes allow.
        launch = device_stream.in_table(batch["api"], self._caller_apis)
        both = np.concatenate([batch["return_ip"][launch], batch["outer_return_ip"][launch]])
        pid = batch["pid"][launch]
        pids = np.concatenate([pid, pid])
        known = both != 0
        yield from self._fresh(pids[known], both[known])

    def _fresh(self, pids: np.ndarray, addrs: np.ndarray):
        """(pid, distinct addresses not seen before) for each process."""
        if not len(addrs):
            return
        # A burst repeats its few kernels and callers: runs of one (pid,
        # address) go first, in one pass, so that the sorts below see few.
        new = np.ones(len(addrs), bool)
        new[1:] = (addrs[1:] != addrs[:-1]) | (pids[1:] != pids[:-1])
        pids, addrs = pids[new], addrs[new]
        for pid in np.unique(pids).tolist():
            distinct = np.unique(addrs[pids == pid]).tolist()
            known = self._seen.get(pid, ())
            fresh = [a for a in distinct if a not in known]
            if fresh:
                yield pid, np.array(fresh, np.uint64)

    def _resolve(self, pid: int, addrs: np.ndarray) -> list[list]:
        rows = []
        if self.resolver is None:
            self.counters["no_resolver"] += len(addrs)
            return rows
        names = self.resolver.resolve_many(int(pid), addrs)
        for addr, name in zip(addrs.tolist(), names):
            self._remember((pid, addr))
            if name is None:
                self.counters["unresolved"] += 1
                continue
            rows.append([pid, addr, name])
            self.counters["resolved"] += 1
        return rows

    def _resolve_callers(self, pid: int, addrs: np.ndarray) -> list[list]:
        """Rows for the callers that are kernels' host stubs; other callers
        (the program's own code calling cudaLaunchKernel) name nothing."""
        rows = []
        if self.resolver is None:
            return rows
        kernels = self.resolver.resolve_many(int(pid), addrs, namer=kernel_of_stub)
        for addr, kernel in zip(addrs.tolist(), kernels):
            self._remember((pid, addr))
            if kernel is not None:
                rows.append([pid, addr, kernel])
                self.counters["callers_named"] += 1
        return rows

    def _remember(self, key):
        pid, addr = key
        known = self._seen.get(pid)
        if known is None:
            known = self._seen[pid] = set()
        self._seen.move_to_end(pid)
        if addr in known:
            return
        known.add(addr)
        self._seen_count += 1
        while self._seen_count > self.max_cached:
            if len(self._seen) == 1:                # one process named them all
                self._seen_count -= len(known)
                known.clear()
                break
            self._seen_count -= len(self._seen.popitem(last=False)[1])

    def forget_exited(self):
        """Drop what is kept about processes that have exited: the addresses
        named here (every FORGET_EVERY_S), the resolver's maps and images."""
        forget = getattr(self.resolver, "forget_exited", None)
        if forget is not None:
            forget()
        now = time.monotonic()
        if now < self._next_forget:
            return
        self._next_forget = now + FORGET_EVERY_S
        for pid in [p for p in self._seen if not (self.proc_root / str(p)).exists()]:
            self._seen_count -= len(self._seen.pop(pid))

    # ----- strings the kernel could not read ----------------------------

    def _read_missing_strings(self, batch: np.ndarray):
        failed = np.flatnonzero(((batch["flags"] & device_stream.FLAG_READ_FAILED) != 0)
                                & (batch["name_addr"] != 0))
        missing = failed[batch["name"][failed] == b""]     # names compared only where wanted
        if not len(missing):
            return
        cache: dict[tuple[int, int], bytes | None] = {}
        for row in missing.tolist():
            key = (int(batch["pid"][row]), int(batch["name_addr"][row]))
            if key not in cache:
                cache[key] = self._read_string(*key)
            text = cache[key]
            if text is None:
                continue
            limit = device_stream.NAME_LEN - 1
            batch["name"][row] = text[:limit]
            flags = device_stream.FLAG_NAME_FROM_USERSPACE
            if len(text) > limit:
                flags |= device_stream.FLAG_NAME_TRUNCATED
            batch["flags"][row] |= flags

    def _read_string(self, pid: int, addr: int) -> bytes | None:
        try:
            fd = os.open(self.proc_root / str(pid) / "mem", os.O_RDONLY)
        except FileNotFoundError:
            self.counters["string_process_gone"] += 1
            return None
        except OSError:
            self.counters["string_unreadable"] += 1
            return None
        try:
            data = os.pread(fd, READ_LIMIT, addr)
        except OSError:
            self.counters["string_unreadable"] += 1
            return None
        finally:
            os.close(fd)
        end = data.find(b"\0")
        self.counters["string_read"] += 1
        return data if end < 0 else data[:end]


def _default_resolver():
    from mmtrace.agent.discovery.address_resolver import AddressResolver
    return AddressResolver()


def exited_process_resolver(loaded, known_files):
    """An AddressResolver that also names the addresses of processes gone by
    the time their events are read, from the load frames the kernel took."""
    from mmtrace.agent.discovery.process_images import ProcessImages
    from mmtrace.agent.discovery.address_resolver import AddressResolver
    device = loaded.device
    # The probed files (released ones still open included) reach deleted files too.
    files = device.decoding_files if device is not None else known_files
    return AddressResolver(images=ProcessImages(loaded.bpf, files, elf_cache=loaded.elf_cache),
                           elf_cache=loaded.elf_cache)


def device_names(loaded, known_files) -> DeviceNames:
    """The names of the device stream's ops, for `record` and `run` alike:
    exited processes' addresses named from what the kernel kept of them."""
    return DeviceNames(device_stream.default_infos(),
                       resolver=exited_process_resolver(loaded, known_files))
