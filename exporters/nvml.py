"""NVIDIA device state through pynvml (NVML), polled in a thread of its own.

Per device: SM and memory-bandwidth utilisation, memory used and total,
temperature, power, PCIe throughput, and the NVLink / PCIe topology to the
other devices; from those the design's two figures:

- device weight = (1 - SM util) x (1 - mem-bw util) x max(0.1, 1 / (hops + 1)):
  how much more work a device can take. `hops` is the mean number of links
  from the device to each other device: 1 over a direct NVLink, else by
  NVML's common PCIe ancestor (same board 1, one switch 2, several
  switches 3, host bridge 4, same NUMA node 5, across sockets 6); 0 alone;
- resource profile = 0.3 norm(temp, 35-100 °C) + 0.4 memory fragmentation
  + 0.3 bandwidth saturation: how close a device runs to its limits.
  NVML cannot see how an allocator's free memory is cut up, so memory
  fragmentation stands as the share of memory in use (the pressure under
  which fragmentation makes allocations fail); bandwidth saturation is
  the larger of the memory-bandwidth and the PCIe link utilisation.

Without a driver (no libnvidia-ml.so.1, or NVML will not initialise) the
monitor is off, says why once, and never raises into the agent.
"""

import logging
import threading
import time
from dataclasses import asdict, dataclass, field

log = logging.getLogger("mmtrace.nvml")

TEMP_RANGE_C = (35.0, 100.0)
# NVML's nvmlGpuTopologyLevel_t values -> links between two devices.
ANCESTOR_HOPS = {0: 1, 10: 2, 20: 3, 30: 4, 40: 5, 50: 6}
MAX_NVLINKS = 18    # NVML_NVLINK_MAX_LINKS
PCIE_TX, PCIE_RX = 0, 1
# One lane, one direction, after line encoding, per PCIe generation.
PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 985e6, 4: 1969e6, 5: 3938e6, 6: 7563e6}


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
class GpuState:
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


def finish(states: list[GpuState], ancestors: dict[tuple[int, int], int]) -> list[GpuState]:
    """Hops, weight and profile of each device, from the topology:
    `ancestors[(i, j)]` is NVML's common-ancestor level of devices i and j."""
    for s in states:
        peers = [o.index for o in states if o.index != s.index]
        links = [1 if p in s.nvlink_peers else ANCESTOR_HOPS.get(ancestors.get((s.index, p)), 6)
                 for p in peers]
        s.hops = sum(links) / len(links) if links else 0.0
        s.weight = device_weight(s.sm_util, s.mem_bw_util, s.hops)
        s.profile = resource_profile(s.temperature_c, s.memory_fragmentation,
                                     s.bandwidth_saturation)
    return states


def read_devices(nvml) -> list[GpuState]:
    """One poll of every device through the pynvml module `nvml`."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    states, bus_ids = [], []
    for index, h in enumerate(handles):
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
        bus_ids.append(bus_id)
        states.append(GpuState(
            index=index, name=_text(nvml.nvmlDeviceGetName(h)), bus_id=bus_id,
            sm_util=util.gpu / 100, mem_bw_util=util.memory / 100,
            memory_used_bytes=int(mem.used), memory_total_bytes=int(mem.total),
            temperature_c=float(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)),
            power_w=nvml.nvmlDeviceGetPowerUsage(h) / 1000,
            # NVML reports KB/s over its last 20 ms sample.
            pcie_tx_bytes_per_s=_optional(nvml, nvml.nvmlDeviceGetPcieThroughput, h,
                                          PCIE_TX) * 1024,
            pcie_rx_bytes_per_s=_optional(nvml, nvml.nvmlDeviceGetPcieThroughput, h,
                                          PCIE_RX) * 1024,
            pcie_max_bytes_per_s=_pcie_max(nvml, h)))
    for s, h in zip(states, handles):
        s.nvlink_peers = _nvlink_peers(nvml, h, bus_ids)
    ancestors = {}
    for i, hi in enumerate(handles):
        for j, hj in enumerate(handles):
            if i != j:
                try:
                    ancestors[(i, j)] = int(nvml.nvmlDeviceGetTopologyCommonAncestor(hi, hj))
                except nvml.NVMLError:
                    pass
    return finish(states, ancestors)


def _nvlink_peers(nvml, handle, bus_ids: list[str]) -> list[int]:
    peers = set()
    for link in range(MAX_NVLINKS):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                continue
            remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
        except nvml.NVMLError:
            break       # no such link (or no NVLink at all): the rest are absent too
        if remote in bus_ids:
            peers.add(bus_ids.index(remote))
    return sorted(peers)


def _pcie_max(nvml, handle) -> float | None:
    """Both directions of the link at its current generation and width."""
    try:
        gen = nvml.nvmlDeviceGetCurrPcieLinkGeneration(handle)
        width = nvml.nvmlDeviceGetCurrPcieLinkWidth(handle)
    except nvml.NVMLError:
        return None
    per_lane = PCIE_LANE_BYTES_PER_S.get(int(gen))
    return 2 * per_lane * int(width) if per_lane and width else None


def _optional(nvml, fn, *args) -> float:
    try:
        return float(fn(*args))
    except nvml.NVMLError:
        return 0.0


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def load_pynvml():
    """pynvml, initialised; raises RuntimeError saying why NVML is unusable."""
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError(f"pynvml does not import ({exc}); pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise RuntimeError("libnvidia-ml.so.1 not found: no NVIDIA driver on this host") from None
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML did not initialise: {exc}") from None
    return pynvml


class NvmlMonitor:
    """Polls every device each `interval_s` in its own thread. `devices()`
    returns the latest poll; `error` says why it is off (None when on)."""

    def __init__(self, interval_s: float = 1.0, loader=load_pynvml, clock=time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"NVML poll interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.loader = loader
        self.clock = clock
        self.error: str | None = "not started"
        self.polls = 0
        self.poll_errors = 0
        self._nvml = None
        self._devices: list[GpuState] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    @property
    def up(self) -> bool:
        return self._nvml is not None and self.error is None

    def start(self) -> bool:
        """Initialise NVML and start polling; False (one log line) without it."""
        try:
            self._nvml = self.loader()
        except RuntimeError as exc:
            self.error = str(exc)
            log.warning("NVML off: %s", exc)
            return False
        self.error = None
        self.poll()
        self._thread = threading.Thread(target=self._run, name="mmtrace-nvml", daemon=True)
        self._thread.start()
        return True

    def poll(self):
        try:
            devices = read_devices(self._nvml)
        except Exception as exc:    # a lost GPU, a driver reload: keep the agent running
            self.poll_errors += 1
            if self.error is None:
                log.warning("NVML poll failed: %s", exc)
            self.error = f"poll failed: {exc}"
            return
        with self._lock:
            self._devices = devices
        self.error = None
        self.polls += 1

    def devices(self) -> list[GpuState]:
        with self._lock:
            return list(self._devices)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.poll()

    def close(self, timeout_s: float = 2.0):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:   # noqa: BLE001 (shutting down: nothing left to do with it)
                pass
            self._nvml = None
