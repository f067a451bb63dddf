"""Perfetto track ids and their descriptors: a track per process, per
thread (under its process), per GPU/NPU stream, per process that copies
(a counter of the bytes copied) and per NVML-sampled GPU counter; and the
ids of the flows from a submission to the sync that retired it. Each id
comes as a function of one value and, for the batch encoders, of arrays."""

import numpy as np

from mmtrace.exporters.files.perfetto_fields import (
    TP_TRACK_DESCRIPTOR, TD_UUID, TD_NAME,
    TD_PROCESS, TD_THREAD, TD_PARENT_UUID, TD_COUNTER, CD_UNIT, UNIT_SIZE_BYTES, PD_PID, PD_NAME,
    THD_PID, THD_TID, THD_NAME, packet)
from mmtrace.exporters.files.protowire import field_bytes, field_str, field_varint


def process_uuid(pid: int) -> int:
    return 1 << 61 | pid            # 0 is Perfetto's global track


def thread_uuid(pid: int, tid: int) -> int:
    return 1 << 62 | pid << 32 | tid


def copied_uuid(pid: int) -> int:
    return 1 << 60 | pid


# NVML's samples ("gpu.state"): per GPU a counter track of each, in percent.
GPU_COUNTERS = (("sm_util", "SM utilisation %"), ("mem_bw_util", "memory-bandwidth utilisation %"))


def gpu_counter_uuid(gpu: int, which: int) -> int:
    return 1 << 58 | gpu << 4 | which


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well spread 64-bit hash of a 64-bit value."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def stream_uuid(pid: int, handle: int) -> int:
    """Bit 63 set: apart from the process, thread and counter tracks."""
    return 1 << 63 | _mix(_mix(pid) ^ handle) >> 1


def flow_id(pid: int, op_id: int) -> int:
    """A non-zero id of a process's submission (Perfetto ignores flow 0)."""
    return _mix(_mix(pid ^ 1 << 40) ^ op_id) or 1


def _mix_array(x: np.ndarray) -> np.ndarray:
    """_mix over a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def flow_ids(pid: np.ndarray, op_id: np.ndarray) -> np.ndarray:
    """flow_id of each (pid, op_id)."""
    ids = _mix_array(_mix_array(pid.astype(np.uint64) ^ np.uint64(1 << 40)) ^ op_id)
    return np.where(ids == 0, np.uint64(1), ids)


def stream_uuids(pid: np.ndarray, handle: np.ndarray) -> np.ndarray:
    """stream_uuid of each (pid, handle)."""
    return np.uint64(1 << 63) | _mix_array(_mix_array(pid) ^ handle) >> np.uint64(1)


def thread_uuids(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """thread_uuid of each (pid, tid)."""
    return np.uint64(1 << 62) | pid.astype(np.uint64) << np.uint64(32) | tid.astype(np.uint64)


class Tracks:
    """Descriptors of the process, thread, stream and counter tracks, each
    once, before the first event that uses it."""

    def __init__(self):
        self.pids: set = set()
        self.threads: set = set()
        self.others: set = set()
        self.process_names: dict[int, str] = {}     # pid -> the name its descriptor gave
        self._main_named: set = set()               # pids named by their main thread

    def process(self, pid: int, name: str | None = None, main: bool = False):
        """The process's descriptor, once; again when its main thread
        (tid == pid) shows its name, which the UI then shows for the
        process (until then, the first thread's name stands in)."""
        renamed = main and name and pid not in self._main_named
        if pid in self.pids and not renamed:
            return
        if main and name:
            self._main_named.add(pid)
        process = field_varint(PD_PID, pid)
        if name:
            process += field_str(PD_NAME, name)
            self.process_names[pid] = name
        desc = field_varint(TD_UUID, process_uuid(pid)) + field_bytes(TD_PROCESS, process)
        self.pids.add(pid)
        yield packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def new(self, pid: int, tid: int, thread_name: str):
        yield from self.process(pid, thread_name, main=tid == pid)
        if (pid, tid) not in self.threads:
            self.threads.add((pid, tid))
            thread = (field_varint(THD_PID, pid) + field_varint(THD_TID, tid)
                      + field_str(THD_NAME, thread_name))
            desc = (field_varint(TD_UUID, thread_uuid(pid, tid))
                    + field_varint(TD_PARENT_UUID, process_uuid(pid))
                    + field_bytes(TD_THREAD, thread))
            yield packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def named(self, pid: int, uuid: int, name: str, counter: bytes | None = None):
        """A track of its own under process `pid`; a counter track when
        `counter` (a CounterDescriptor) is given."""
        yield from self.process(pid)
        if uuid not in self.others:
            self.others.add(uuid)
            desc = (field_varint(TD_UUID, uuid) + field_str(TD_NAME, name)
                    + field_varint(TD_PARENT_UUID, process_uuid(pid)))
            if counter is not None:
                desc += field_bytes(TD_COUNTER, counter)
            yield packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def stream(self, pid: int, stream: str, handle: int):
        yield from self.named(pid, stream_uuid(pid, handle), f"{stream} stream {handle:#x}")

    def gpu(self, gpu: int, which: int):
        """A GPU's counter track, global (its samples are not a process's)."""
        uuid = gpu_counter_uuid(gpu, which)
        if uuid not in self.others:
            self.others.add(uuid)
            desc = (field_varint(TD_UUID, uuid)
                    + field_str(TD_NAME, f"gpu {gpu} {GPU_COUNTERS[which][1]}")
                    + field_bytes(TD_COUNTER, b""))
            yield packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))

    def copied(self, pid: int):
        yield from self.named(pid, copied_uuid(pid), "memcpy bytes",
                              field_varint(CD_UNIT, UNIT_SIZE_BYTES))
