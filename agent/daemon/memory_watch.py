"""Device memory and hangs, live: the memory ledger fed by the ingest
path's device batches, the leak detector over it and over NVML's used
memory, and the hang detector over the calls in flight in the kernel.
Streams feeds it; the daemon's tick asks it for anomalies."""

import logging
from pathlib import Path

from mmtrace.bpf import device_memory as dm
from mmtrace.detectors.device_hang import DeviceHang
from mmtrace.detectors.memory_leak import MemoryLeak

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.ingest.memory_ledger import MemoryLedger
from mmtrace.agent.kernel import calls_in_flight

log = logging.getLogger("mmtrace.daemon")
MAX_META_PROCESSES = 32         # the processes holding most, in a flight recording


class MemoryWatch:
    def __init__(self, config: DaemonConfig, infos: dict, proc_root: Path = Path("/proc"),
                 unretired=None):
        """`unretired(pid, stream_handle)`: the process's submissions not yet
        retired on that stream and the oldest one's time (the aligner's)."""
        self.infos = infos
        self.unretired = unretired
        self.proc_root = proc_root
        self.ledger = MemoryLedger(infos)
        self.leak = MemoryLeak.of(config.memory)
        self.hang = DeviceHang.of(config.hangs)
        self.check_ns = int(config.hangs.check_s * 1e9)
        self._blocking = calls_in_flight.blocking_ids(infos)
        self._next_check = 0
        self.stuck: list[dict] = []         # the blocking calls past the threshold, last check
        self.in_flight = 0                  # the blocking calls in flight, last check
        self.kernel_forgotten = 0           # live allocations of exited processes dropped
        self._kernel_pending: set[int] = set()  # exited, their kernel entries not yet dropped

    def on_device(self, events):
        self.ledger.feed(events)

    def on_device_states(self, stream: str, states: list, now_ns: int) -> list[dict]:
        """NVML's samples ("gpu") or npu-smi's ("npu"): each device's used
        memory against what live traced
        processes hold on it, and those that exited less than grow_s ago
        (the driver frees a dead process's memory as it tears its context
        down, not at once). Exits are looked for first: NVML sees them
        before the sweep would."""
        self.forget_exited(self.proc_root, now_ns, None)
        held = self.ledger.outstanding()
        for left in self.ledger.at_exit:
            if now_ns - left["exit_ns"] < self.leak.grow_ns:
                for where, n in left["holdings"].items():
                    stream, device = where.split(":")
                    held[(stream, int(device))] = held.get((stream, int(device)), 0) + n
        out = []
        for s in states:
            out += self.leak.observe_used(s.index, s.memory_used_bytes,
                                          held.get((stream, s.index), 0), now_ns,
                                          self.ledger.at_exit, stream)
        return out

    def calls_now(self, loaded) -> list[dict]:
        """The blocking calls in flight now (for a flight recording's meta)."""
        table = loaded.device_table(calls_in_flight.MAP) if loaded is not None else None
        return calls_in_flight.blocking_calls(table, self.infos, self._blocking) \
            if table is not None else []

    def meta(self, loaded, now_ns: int) -> dict:
        """What a flight recording carries of this: the calls in flight when
        it was written, and what each process held then."""
        return {"calls_in_flight": {"now_ns": int(now_ns), "calls": self.calls_now(loaded)},
                "device_memory": [self.ledger.summary(pid) for pid in sorted(
                    self.ledger.processes, key=lambda p: -self.ledger.processes[p].outstanding)
                    [:MAX_META_PROCESSES]],
                "device_memory_at_exit": list(self.ledger.at_exit)}

    def tick(self, now_ns: int, loaded) -> list[dict]:
        """Every check_s: the hangs (calls in flight) and the leaks."""
        if now_ns < self._next_check:
            return []
        self._next_check = now_ns + self.check_ns
        out = self.leak.check(self.ledger, now_ns)
        if loaded is not None and loaded.device_table(calls_in_flight.MAP) is not None:
            calls = self.calls_now(loaded)
            self.in_flight = len(calls)
            self.stuck = self.hang.stuck(calls, now_ns)
            for call in self.stuck if self.unretired is not None else ():
                scope = self.infos[call["api_id"]].sync_scope
                n, oldest = self.unretired(call["pid"], call["stream_handle"]
                                           if scope == "stream" else None)
                call["unretired"], call["oldest_unretired_ns"] = n, oldest
            out += self.hang.check(calls, now_ns)
        return out

    def forget_exited(self, proc_root: Path, now_ns: int, loaded) -> list[dict]:
        """Processes gone: what they still held is kept (ledger.at_exit), and
        their live allocations leave the kernel's map (when `loaded` is
        given; until then they wait)."""
        gone = [pid for pid in self.ledger.processes if not (proc_root / str(pid)).exists()]
        left = []
        for pid in gone:
            held = self.ledger.forget(pid, now_ns)
            if held is not None:
                left.append(held)
                log.info("pid %d exited holding %d bytes of device memory", pid,
                         held["outstanding_bytes"])
        self._kernel_pending.update(gone)
        table = loaded.device_table(dm.ALLOCATIONS_MAP) if loaded is not None else None
        if table is not None and self._kernel_pending:
            self.kernel_forgotten += dm.forget_processes(table, self._kernel_pending)
            self._kernel_pending.clear()
        return left

    def drained(self, weights: dict | None) -> dict | None:
        """The GPUs' weights with each GPU that has a call stuck set to 0: the
        policy's prefer_device hint then sends new work elsewhere while it
        is hung (the weights are NVML's; without NVML there are none)."""
        if not weights:
            return weights
        stuck = {str(c["device"]) for c in self.stuck if c["stream"] == "gpu"}
        return {d: (0.0 if d in stuck else w) for d, w in weights.items()}

    def snapshot(self) -> dict:
        """For the metrics: outstanding bytes by (stream, device), calls
        stuck by stream, and the ledger's counts by stream."""
        stuck: dict[str, int] = {"gpu": 0, "npu": 0}
        for call in self.stuck:
            stuck[call["stream"]] = stuck.get(call["stream"], 0) + 1
        return {"outstanding": self.ledger.outstanding(), "stuck": stuck,
                "totals": self.ledger.totals()}
