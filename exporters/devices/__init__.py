"""Device state sources polled beside the probes: NVML for GPUs, npu-smi for
Ascend NPUs."""
