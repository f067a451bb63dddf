"""GPU and NPU device state beside the probes: NVML and, where it is
installed, npu-smi, each polled in a thread of its own. The dispatcher's
device weights and the flight recorder's once-a-second samples come from
here."""

from mmtrace.exporters.devices import npu_smi, nvml

from mmtrace.agent.due import due

GPU_SAMPLE_INTERVAL_NS = 10**9


class DeviceMonitors:
    def __init__(self):
        self.nvml = None                    # DeviceMonitor of the GPUs
        self.npu = None                     # ... of the Ascend NPUs, where npu-smi is
        self._last_gpu_sample = self._last_npu_sample = None    # monotonic ns

    def start(self, interval_s: float):
        if interval_s <= 0:
            return
        self.nvml = nvml.monitor(interval_s)
        self.nvml.start()
        if npu_smi.available():
            self.npu = npu_smi.monitor(interval_s)
            self.npu.start()

    def state(self) -> dict:
        """Device state for the dispatcher: per GPU / NPU its weight, resource
        profile and the figures they come from; for each source, "up" or why not."""
        out = {}
        for kind, monitor in (("gpus", self.nvml), ("npus", self.npu)):
            out[kind] = [d.as_dict() for d in monitor.devices()] if monitor else []
            out[f"{kind}_source"] = (monitor.error or "up") if monitor else "off"
        return out

    def gpu_sample_due(self, now_ns: int) -> list:
        """NVML's latest states, once a second (else none), for the flight
        recorder's ring."""
        if self.nvml is None or not _due(self._last_gpu_sample, now_ns):
            return []
        self._last_gpu_sample = now_ns
        return self.nvml.devices()

    def npu_sample_due(self, now_ns: int) -> list:
        """npu-smi's latest states, once a second (else none)."""
        if self.npu is None or not _due(self._last_npu_sample, now_ns):
            return []
        self._last_npu_sample = now_ns
        return self.npu.devices()

    def has_devices_to_sample(self) -> bool:
        """Whether a monitor has devices to sample once a second now."""
        return any(m is not None and m.devices() for m in (self.nvml, self.npu))

    def gpu_weights(self) -> dict | None:
        """The GPUs' weights by ordinal (the gpu label of the metrics), where NVML answers."""
        gpus = self.nvml.devices() if self.nvml is not None else []
        return {str(d.index): d.weight for d in gpus} or None

    def close(self):
        for monitor in (self.nvml, self.npu):
            if monitor is not None:
                monitor.close()
        self.nvml = self.npu = None


def _due(last_ns: int | None, now_ns: int) -> bool:
    """A sample once a second (agent/due.py: a little early counts)."""
    return last_ns is None or due(now_ns - last_ns, GPU_SAMPLE_INTERVAL_NS)
