"""GPU device state through pynvml (NVML): per device SM and memory-bandwidth
utilisation, memory used and total, temperature, power, PCIe throughput and
the NVLink / PCIe topology to the other devices (see device_state.py for
the weight and profile computed from them)."""

import ctypes

from mmtrace.exporters.devices.device_state import DeviceMonitor, DeviceState, finish

NVML_LIBRARY = "libnvidia-ml.so.1"     # the name pynvml loads, on the same search path
MAX_NVLINKS = 18    # NVML_NVLINK_MAX_LINKS
PCIE_TX, PCIE_RX = 0, 1
# One lane, one direction, after line encoding, per PCIe generation.
PCIE_LANE_BYTES_PER_S = {1: 250e6, 2: 500e6, 3: 985e6, 4: 1969e6, 5: 3938e6, 6: 7563e6}


def read_devices(nvml) -> list[DeviceState]:
    """One poll of every device through the pynvml module `nvml`."""
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    states, bus_ids = [], []
    for index, h in enumerate(handles):
        util = nvml.nvmlDeviceGetUtilizationRates(h)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(h).busId)
        bus_ids.append(bus_id)
        states.append(DeviceState(
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
    """pynvml, initialised; raises RuntimeError saying why NVML is unusable.
    Without the driver's library pynvml is not imported at all: its 8000
    lines (200 ctypes types) would hold 2.5 MB of an agent with no GPU."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        raise RuntimeError(f"{NVML_LIBRARY} not found: no NVIDIA driver on this host") from None
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError(f"pynvml does not import ({exc}); pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise RuntimeError(f"{NVML_LIBRARY} not found: no NVIDIA driver on this host") from None
    except pynvml.NVMLError as exc:
        raise RuntimeError(f"NVML did not initialise: {exc}") from None
    return pynvml




class NvmlSource:
    """An initialised NVML, read by a DeviceMonitor."""

    def __init__(self, loader=load_pynvml):
        self.nvml = loader()

    def read(self) -> list[DeviceState]:
        return read_devices(self.nvml)

    def close(self):
        self.nvml.nvmlShutdown()


def monitor(interval_s: float = 1.0, loader=load_pynvml) -> DeviceMonitor:
    return DeviceMonitor("NVML", lambda: NvmlSource(loader), interval_s)
