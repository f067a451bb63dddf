"""Ascend NPU device state through `npu-smi`, where it is installed.

Per NPU card (`npu-smi info -l`), per chip: AI Core utilisation (the SM
utilisation of the weight), HBM bandwidth utilisation, HBM capacity and
use (`npu-smi info -t usages -i N`), temperature and power (`-t common`).
npu-smi does not tell the topology in a form read here, so every NPU
counts as alone (hops 0): the weights compare by load only. Each call
spawns a process, so a card is read at most every MIN_INTERVAL_S.
"""

import shutil
import subprocess

from mmtrace.exporters.devices.device_state import DeviceMonitor, DeviceState, finish

MIN_INTERVAL_S = 5.0
TIMEOUT_S = 10.0
MIB = 1 << 20


def parse_fields(text: str) -> list[dict[str, str]]:
    """`Key : value` lines as records; a `Chip ID` line ends a chip's record
    on multi-chip cards, and a single-chip card's output is one record."""
    records, current = [], {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        current[key.strip()] = value.strip()
        if key.strip() == "Chip ID":
            records.append(current)
            current = {}
    if current and (not records or set(current) - {"NPU ID"}):
        records.append(current)
    return records


def npu_ids(text: str) -> list[int]:
    """The cards `npu-smi info -l` lists."""
    ids = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "NPU ID" and value.strip().isascii() \
                and value.strip().isdigit():
            ids.append(int(value))
    return ids


def _number(record: dict, key: str, default: float = 0.0) -> float:
    try:
        return float(record[key])
    except (KeyError, ValueError):
        return default


def chip_states(npu: int, usages: str, common: str, first_index: int) -> list[DeviceState]:
    """The chips of one card from its `-t usages` and `-t common` outputs."""
    states = []
    commons = parse_fields(common)
    for k, chip in enumerate(parse_fields(usages)):
        general = commons[k] if k < len(commons) else (commons[0] if commons else {})
        total = int(_number(chip, "HBM Capacity(MB)") * MIB)
        states.append(DeviceState(
            index=first_index + k, name=f"Ascend NPU {npu}",
            bus_id=f"npu{npu}.chip{chip.get('Chip ID', k)}",
            sm_util=_number(chip, "Aicore Usage Rate(%)") / 100,
            mem_bw_util=_number(chip, "HBM Bandwidth Usage Rate(%)") / 100,
            memory_used_bytes=int(total * _number(chip, "HBM Usage Rate(%)") / 100),
            memory_total_bytes=total,
            temperature_c=_number(general, "Temperature(C)"),
            power_w=_number(general, "NPU Real-time Power(W)",
                            _number(general, "Power Dissipation(W)")),
            pcie_tx_bytes_per_s=0.0, pcie_rx_bytes_per_s=0.0))
    return states


class NpuSmiSource:
    """npu-smi on PATH (or `binary`), read by a DeviceMonitor."""

    def __init__(self, binary: str | None = None):
        self.binary = binary or shutil.which("npu-smi")
        if self.binary is None:
            raise RuntimeError("npu-smi not found on PATH: no Ascend driver tools")
        self.ids = npu_ids(self._run("info", "-l"))
        if not self.ids:
            raise RuntimeError("npu-smi info -l lists no NPU")

    def _run(self, *args) -> str:
        try:
            done = subprocess.run([self.binary, *args], capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"npu-smi {' '.join(args)}: {exc}") from None
        if done.returncode != 0:
            raise RuntimeError(f"npu-smi {' '.join(args)} exited {done.returncode}: "
                               f"{done.stderr.strip()[:200]}")
        return done.stdout

    def read(self) -> list[DeviceState]:
        states = []
        for npu in self.ids:
            states += chip_states(npu, self._run("info", "-t", "usages", "-i", str(npu)),
                                  self._run("info", "-t", "common", "-i", str(npu)),
                                  len(states))
        return finish(states, {}, topology=False)

    def close(self):
        """Nothing held between calls."""


def available() -> bool:
    return shutil.which("npu-smi") is not None


def monitor(interval_s: float = 1.0, binary: str | None = None) -> DeviceMonitor:
    return DeviceMonitor("npu-smi", lambda: NpuSmiSource(binary),
                         max(interval_s, MIN_INTERVAL_S))
