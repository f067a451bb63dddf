"""Device memory leaks and hangs over a recording, as the daemon finds
them live: the memory ledger and the leak detector over the allocation
records ("dev.event") and NVML's samples ("gpu.state"), in time order;
and the hang detector over the blocking calls a flight recording says
were in flight when it was written (meta "calls_in_flight": a call that
never returned left no record of its own)."""

import numpy as np

from mmtrace.bpf import device_memory as dm
from mmtrace.detectors.device_hang import DeviceHang
from mmtrace.detectors.memory_leak import MemoryLeak

from mmtrace.agent.ingest.memory_ledger import MemoryLedger
from mmtrace.agent.recording.device_view import DeviceContext


class MemoryReplay:
    def __init__(self, rec, settings):
        self.rec = rec
        self.settings = settings
        self.ledger = MemoryLedger(DeviceContext.from_meta(rec.meta).infos)
        self.found: list[dict] = []

    def feed(self, step):
        """Nothing per step: the allocation records are read in one pass of
        their own (the replay's device rows are the exported kinds only)."""

    def finish(self) -> list[dict]:
        leak = MemoryLeak.of(self.settings.memory)
        samples = self._gpu_samples()
        at = 0
        for piece in self.rec.pieces("dev.event") if "dev.event" in self.rec.schemas else ():
            mine = piece[np.isin(piece["kind"], (dm.ALLOC, dm.FREE))]
            if not len(mine):
                continue
            mine = mine[np.argsort(mine["ts_ns"], kind="stable")]
            end = int(mine["ts_ns"][-1])
            at = self._samples_until(leak, samples, at, int(mine["ts_ns"][0]))
            self.ledger.feed(mine)
            self.found += leak.check(self.ledger, end)
        self._samples_until(leak, samples, at, None)
        self.found += self._hangs()
        return self.found

    def summary(self, limit: int = 20) -> dict:
        """After finish(): what each process held at the end of the
        recording (those holding most first), and its failed allocations."""
        ledger = self.ledger
        pids = sorted(ledger.processes, key=lambda p: -ledger.processes[p].outstanding)
        return {"processes": [ledger.summary(pid) for pid in pids[:limit]],
                "unmatched_frees": ledger.unmatched_frees,
                "live_overflow": ledger.live_overflow}

    def _gpu_samples(self) -> np.ndarray:
        if "gpu.state" not in self.rec.schemas:
            return np.zeros(0)
        pieces = list(self.rec.pieces("gpu.state"))
        if not pieces:
            return np.zeros(0)
        states = np.concatenate(pieces)
        return states[np.argsort(states["ts_ns"], kind="stable")]

    def _samples_until(self, leak: MemoryLeak, samples, at: int, limit) -> int:
        held = self.ledger.outstanding()
        while at < len(samples) and (limit is None or samples["ts_ns"][at] <= limit):
            s = samples[at]
            gpu = int(s["gpu"])
            self.found += leak.observe_used(gpu, int(s["mem_used_bytes"]),
                                            held.get(("gpu", gpu), 0), int(s["ts_ns"]))
            at += 1
        return at

    def _hangs(self) -> list[dict]:
        hang = DeviceHang.of(self.settings.hangs)
        out = []
        for doc in self.rec.meta:
            held = doc.get("calls_in_flight")
            if isinstance(held, dict) and isinstance(held.get("calls"), list):
                calls = [c for c in held["calls"] if _call(c)]
                out += hang.check(calls, int(held.get("now_ns", 0)))
        return out


def _call(c) -> bool:
    keys = ("pid", "tid", "api_id", "ts_ns", "stream_handle", "device")
    return isinstance(c, dict) and all(isinstance(c.get(k), int) for k in keys) \
        and isinstance(c.get("api"), str) and c.get("stream") in ("gpu", "npu")
