"""Device memory leaks (anomaly `memory_leak`), from the memory ledger
(agent/ingest/memory_ledger.py) and the devices' used memory (NVML):

- a process whose outstanding memory grows for `grow_s` without one free,
  by at least `min_growth_bytes`: the growth is measured from its last
  free (or its first allocation), and the allocation that completes it
  must come `grow_s` after that. A free resolves it. A balanced allocator
  frees, and a caching allocator that stops growing never completes it;
- a device whose used memory (NVML for a GPU, npu-smi for an NPU), less
  what live traced processes hold on it,
  grows by `min_growth_bytes` over at least `grow_s` from its lowest
  point: memory that no live allocation accounts for (held by the driver,
  or by a process that died), the seed's case. It resolves when that
  memory falls back below half the growth.

Both are checked with `check(ledger, now_ns)`; the devices' samples come
in with `observe_used(device, used_bytes, ts_ns)`."""

from collections import deque
from dataclasses import dataclass, field

DETECTOR = "memory_leak"
MIB = 1 << 20
# NVML and the traced allocations are two views that do not move at the
# same instant: a process's exit shows in NVML's used memory before the
# agent forgets what it held, a burst of allocations shows in the ledger
# before NVML's next sample. A level must hold for SETTLE_S to count: the
# baseline is the lowest of the levels' highs, the level now is their low.
SETTLE_S = 3.0


@dataclass
class _Growth:
    base_ns: int            # the last free, or the first allocation
    base_bytes: int         # what the process held then
    frees: int              # its frees counted then
    firing: bool = False


@dataclass
class _Unaccounted:
    low_bytes: int
    low_ns: int
    last_bytes: int = 0             # the level now: the least of the last settle_s
    last_ns: int = 0
    firing: bool = False
    recent: deque = field(default_factory=deque)    # (ts_ns, unaccounted) of the last settle_s


class MemoryLeak:
    def __init__(self, grow_s: float = 300.0, min_growth_bytes: int = 256 * MIB,
                 settle_s: float = SETTLE_S):
        if grow_s <= 0 or min_growth_bytes <= 0:
            raise ValueError(f"expected grow_s > 0 and min_growth_bytes > 0, got {grow_s} "
                             f"and {min_growth_bytes}")
        self.grow_ns = int(grow_s * 1e9)
        self.min_growth = int(min_growth_bytes)
        self.settle_ns = int(settle_s * 1e9)
        self.growth: dict[int, _Growth] = {}
        self.devices: dict[tuple, _Unaccounted] = {}    # (stream, ordinal) -> its unaccounted memory

    @classmethod
    def of(cls, settings) -> "MemoryLeak":
        return cls(settings.grow_s, int(settings.min_growth_mib * MIB))

    # ---------------------------------------------------- per process

    def check(self, ledger, now_ns: int) -> list[dict]:
        out = []
        for pid, proc in ledger.processes.items():
            frees = sum(h.frees for h in proc.holdings.values())
            last_alloc = max((h.last_alloc_ns for h in proc.holdings.values()), default=0)
            g = self.growth.get(pid)
            if g is None:
                if not proc.first_alloc_ns:
                    continue                # failed allocations only: nothing held
                g = self.growth[pid] = _Growth(proc.first_alloc_ns, 0, 0)
            if frees > g.frees:
                last_free = max(h.last_free_ns for h in proc.holdings.values())
                if g.firing:
                    g.firing = False
                    out.append(self._process(pid, proc, g, "resolved", last_free))
                g.base_ns, g.base_bytes, g.frees = last_free, proc.outstanding, frees
                continue
            grown = proc.outstanding - g.base_bytes
            if not g.firing and grown >= self.min_growth and last_alloc - g.base_ns >= self.grow_ns:
                g.firing = True
                out.append(self._process(pid, proc, g, "firing", last_alloc, ledger))
        for pid in [p for p in self.growth if p not in ledger.processes]:
            g = self.growth.pop(pid)
            if g.firing:        # the process is gone: so is the leak it held
                out.append({"detector": DETECTOR, "series": f"memory_leak{{pid={pid}}}",
                            "state": "resolved", "ts_ns": int(now_ns), "pid": pid,
                            "evidence": {"pid": pid, "kind": "process", "verdict": "memory_leak",
                                         "exited": True}})
        return out

    def _process(self, pid, proc, g: _Growth, state: str, ts_ns: int, ledger=None) -> dict:
        evidence = {"pid": pid, "kind": "process", "verdict": "memory_leak",
                    "outstanding_bytes": proc.outstanding,
                    "grown_bytes": proc.outstanding - g.base_bytes, "since_ns": g.base_ns,
                    "grow_s": self.grow_ns / 1e9, "min_growth_bytes": self.min_growth,
                    "holdings": [{"stream": s, "device": d, "outstanding_bytes": h.outstanding,
                                  "allocs": h.allocs, "frees": h.frees}
                                 for (s, d), h in sorted(proc.holdings.items())]}
        if ledger is not None:
            evidence["largest"] = ledger.largest(pid)
            seconds = max(1e-9, (ts_ns - g.base_ns) / 1e9)
            evidence["growth_bytes_per_s"] = round(evidence["grown_bytes"] / seconds)
        return {"detector": DETECTOR, "series": f"memory_leak{{pid={pid}}}", "state": state,
                "ts_ns": int(ts_ns), "pid": pid, "evidence": evidence}

    # ---------------------------------------------------- per device

    def observe_used(self, device: int, used_bytes: int, held_bytes: int,
                     ts_ns: int, exited: list | None = None, stream: str = "gpu") -> list[dict]:
        """One sample of a GPU's used memory and what the live traced
        processes hold on it; `exited`: what processes held at their exit
        (evidence of where the memory went)."""
        unaccounted = max(0, int(used_bytes) - int(held_bytes))
        u = self.devices.get((stream, device))
        if u is None:
            u = self.devices[(stream, device)] = _Unaccounted(unaccounted, ts_ns)
        u.recent.append((ts_ns, unaccounted))
        while ts_ns - u.recent[0][0] > self.settle_ns:
            u.recent.popleft()
        values = [v for _, v in u.recent]
        u.last_bytes, u.last_ns = min(values), ts_ns
        if ts_ns - u.recent[0][0] >= self.settle_ns / 2 and max(values) < u.low_bytes:
            u.low_bytes, u.low_ns = max(values), ts_ns
        grown = u.last_bytes - u.low_bytes
        if not u.firing and grown >= self.min_growth and ts_ns - u.low_ns >= self.grow_ns:
            u.firing = True
            return [self._device(stream, device, u, used_bytes, held_bytes, "firing", ts_ns,
                                 exited)]
        if u.firing and grown < self.min_growth / 2:
            u.firing = False
            return [self._device(stream, device, u, used_bytes, held_bytes, "resolved", ts_ns,
                                 exited)]
        return []

    def _device(self, stream, device, u: _Unaccounted, used, held, state, ts_ns, exited) -> dict:
        seconds = max(1e-9, (ts_ns - u.low_ns) / 1e9)
        return {"detector": DETECTOR, "series": f"memory_unaccounted{{{stream}={device}}}",
                "state": state, "ts_ns": int(ts_ns), "pid": None,
                "evidence": {"kind": "unaccounted", "verdict": "memory_leak", "stream": stream,
                             "device": device,
                             "used_bytes": int(used), "held_bytes": int(held),
                             "unaccounted_bytes": u.last_bytes,
                             "grown_bytes": u.last_bytes - u.low_bytes, "since_ns": u.low_ns,
                             "growth_bytes_per_s": round((u.last_bytes - u.low_bytes) / seconds),
                             "grow_s": self.grow_ns / 1e9, "min_growth_bytes": self.min_growth,
                             "held_at_exit": list(exited or [])}}
