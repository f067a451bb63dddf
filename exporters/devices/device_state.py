"""GPU and NPU device state, polled in a thread of its own, and the
design's two figures computed from it:

- device weight = (1 - SM util) x (1 - mem-bw util) x max(0.1, 1 / (hops + 1)):
  how much more work a device can take. `hops` is the mean number of links
  from the device to each other device: 1 over a direct NVLink, else by
  NVML's common PCIe ancestor (same board 1, one switch 2, several
  switches 3, host bridge 4, same NUMA node 5, across sockets 6); 0 alone;
- resource profile = 0.3 norm(temp, 35-100 °C) + 0.4 memory fragmentation
  + 0.3 bandwidth saturation: how close a device runs to its limits.
  Neither NVML nor npu-smi can see how an allocator's free memory is cut
  up, so memory fragmentation stands as the share of memory in use (the
  pressure under which fragmentation makes allocations fail); bandwidth
  saturation is the larger of the memory-bandwidth and the PCIe link
  utilisation.

The sources (exporters/devices/nvml.py, exporters/devices/npu_smi.py) read the devices; a
missing driver or tool turns a monitor off with one log line, and never
raises into the agent.
"""

import logging
import threading
from dataclasses import asdict, dataclass, field

import numpy as np

log = logging.getLogger("mmtrace.devices")

TEMP_RANGE_C = (35.0, 100.0)
# NVML's nvmlGpuTopologyLevel_t values -> links between two devices.
ANCESTOR_HOPS = {0: 1, 10: 2, 20: 3, 30: 4, 40: 5, 50: 6}
# One sample of a GPU's state, as flight recordings carry it ("gpu.state").
GPU_STATE = np.dtype([("ts_ns", "<u8"), ("sm_util", "<f8"), ("mem_bw_util", "<f8"),
                      ("mem_used_bytes", "<u8"), ("temperature_c", "<f8"), ("power_w", "<f8"),
                      ("weight", "<f8"), ("gpu", "<u4"), ("reserved", "<u4")])


def norm(value: float, low: float, high: float) -> float:
    return min(1.0, max(0.0, (value - low) / (high - low)))


def device_weight(sm_util: float, mem_bw_util: float, hops: float) -> float:
    """The design's weight; utilisations in 0..1."""
    return (1 - sm_util) * (1 - mem_bw_util) * max(0.1, 1 / (hops + 1))


def resource_profile(temperature_c: float, memory_fragmentation: float,
                     bandwidth_saturation: float) -> float:
    """The design's profile; fragmentation and saturation in 0..1."""
    return (0.3 * norm(temperature_c, *TEMP_RANGE_C) + 0.4 * memory_fragmentation
            + 0.3 * bandwidth_saturation)


@dataclass
class DeviceState:
    index: int
    name: str
    bus_id: str
    sm_util: float              # 0..1
    mem_bw_util: float          # 0..1
    memory_used_bytes: int
    memory_total_bytes: int
    temperature_c: float
    power_w: float
    pcie_tx_bytes_per_s: float
    pcie_rx_bytes_per_s: float
    pcie_max_bytes_per_s: float | None = None
    nvlink_peers: list = field(default_factory=list)   # ordinals over a direct NVLink
    hops: float = 0.0
    weight: float = 1.0
    profile: float = 0.0

    @property
    def memory_fragmentation(self) -> float:
        return self.memory_used_bytes / self.memory_total_bytes if self.memory_total_bytes else 0.0

    @property
    def bandwidth_saturation(self) -> float:
        pcie = 0.0
        if self.pcie_max_bytes_per_s:
            pcie = min(1.0, (self.pcie_tx_bytes_per_s + self.pcie_rx_bytes_per_s)
                       / self.pcie_max_bytes_per_s)
        return max(self.mem_bw_util, pcie)

    def as_dict(self) -> dict:
        return asdict(self)


def finish(states: list[DeviceState], ancestors: dict[tuple[int, int], int],
           topology: bool = True) -> list[DeviceState]:
    """Hops, weight and profile of each device, from the topology:
    `ancestors[(i, j)]` is NVML's common-ancestor level of devices i and j
    (a pair without one counts as across sockets). `topology=False`: not
    known, every device counts as alone."""
    for s in states:
        peers = [o.index for o in states if o.index != s.index] if topology else []
        links = [1 if p in s.nvlink_peers else ANCESTOR_HOPS.get(ancestors.get((s.index, p)), 6)
                 for p in peers]
        s.hops = sum(links) / len(links) if links else 0.0
        s.weight = device_weight(s.sm_util, s.mem_bw_util, s.hops)
        s.profile = resource_profile(s.temperature_c, s.memory_fragmentation,
                                     s.bandwidth_saturation)
    return states


class DeviceMonitor:
    """Polls a source's devices each `interval_s` in its own thread.
    `open_source()` returns an object with read() -> list[DeviceState] and
    close(), or raises RuntimeError saying why there is none. `devices()`
    returns the latest poll; `error` says why the monitor is off (None when on)."""

    def __init__(self, name: str, open_source, interval_s: float = 1.0):
        if interval_s <= 0:
            raise ValueError(f"{name} poll interval must be positive, got {interval_s}")
        self.name = name
        self.open_source = open_source
        self.interval_s = interval_s
        self.error: str | None = "not started"
        self.polls = 0
        self.poll_errors = 0
        self._source = None
        self._devices: list[DeviceState] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    @property
    def up(self) -> bool:
        return self._source is not None and self.error is None

    def start(self) -> bool:
        """Open the source and start polling; False (one log line) without it."""
        try:
            self._source = self.open_source()
        except RuntimeError as exc:
            self.error = str(exc)
            log.warning("%s off: %s", self.name, exc)
            return False
        self.error = None
        self.poll()
        self._thread = threading.Thread(target=self._run, name=f"mmtrace-{self.name}",
                                        daemon=True)
        self._thread.start()
        return True

    def poll(self):
        try:
            devices = self._source.read()
        except Exception as exc:    # a lost device, a driver reload: keep the agent running
            self.poll_errors += 1
            if self.error is None:
                log.warning("%s poll failed: %s", self.name, exc)
            self.error = f"poll failed: {exc}"
            return
        with self._lock:
            self._devices = devices
        self.error = None
        self.polls += 1

    def devices(self) -> list[DeviceState]:
        with self._lock:
            return list(self._devices)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self, timeout_s: float = 5.0):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._source is not None:
            try:
                self._source.close()
            except Exception:   # noqa: BLE001 (shutting down: nothing left to do with it)
                pass
            self._source = None


def state_records(states: list[DeviceState], ts_ns: int) -> np.ndarray:
    """The devices' state at `ts_ns` as GPU_STATE records."""
    out = np.zeros(len(states), GPU_STATE)
    out["ts_ns"] = ts_ns
    for i, d in enumerate(states):
        out[i]["gpu"] = d.index
        out[i]["sm_util"], out[i]["mem_bw_util"] = d.sm_util, d.mem_bw_util
        out[i]["mem_used_bytes"] = d.memory_used_bytes
        out[i]["temperature_c"], out[i]["power_w"] = d.temperature_c, d.power_w
        out[i]["weight"] = d.weight
    return out
