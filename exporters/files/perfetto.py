"""Native Perfetto trace (protobuf TracePacket stream) for ui.perfetto.dev.

Every thread gets a track (grouped under its process); each event that has
a duration becomes a slice on its thread's track. Each GPU/NPU stream gets a
track too, where a submission is a slice from its call to its retirement,
with a flow from the submission's call to the sync that retired it; each
process that copies gets a counter track of the bytes it has copied, and
each GPU sampled by NVML counter tracks of its utilisations, and each
process that allocates device memory a counter track of what it holds. Field
numbers are those of Perfetto's trace_packet.proto / track_event.proto /
track_descriptor.proto / counter_descriptor.proto.
"""

import numpy as np

from mmtrace.bpf.device import NOT_RETIRED as NONE
from mmtrace.bpf.device import SUBMISSION_KINDS
from mmtrace.bpf.sched import wait_start_ns

from mmtrace.exporters.files.perfetto_anomalies import anomaly_packets, recorded_anomalies
from mmtrace.exporters.files.perfetto_device import DeviceEncoder
from mmtrace.exporters.files.perfetto_events import gpu_state_packets
from mmtrace.exporters.files.perfetto_fields import (ANOMALY_SEQUENCE, HINT_SEQUENCE,
                                                    MEMORY_SEQUENCE, sequence_start, trace_start)
from mmtrace.exporters.files.perfetto_memory import memory_packets
from mmtrace.exporters.files.perfetto_order import PacketOrder, on_sequence
from mmtrace.exporters.files.perfetto_rows import labels, paired, slice_rows_apart
from mmtrace.exporters.files.perfetto_telemetry import Telemetry, hint_packets
from mmtrace.exporters.files.perfetto_tracks import Tracks
from mmtrace.exporters.files.rowtext import BATCH, first_per_thread, records_at


class PerfettoWriter:
    """Writes the slices of each replay step (agent/recording/replay.py) as they
    come: track descriptors at once, timed packets through PacketOrder,
    so that timestamps never go backwards within a sequence."""

    def __init__(self, out, realtime_minus_monotonic_ns: int | None = None,
                 start_ns: int = 0):
        self.out = out
        self.order = PacketOrder(out)
        self.tracks = Tracks()
        self.device = DeviceEncoder()
        self.slices = 0
        out.write(trace_start(start_ns, realtime_minus_monotonic_ns))

    def _write(self, packets):
        """Packets as (timestamp or None, bytes): descriptors at once, the
        rest in time order."""
        ts, timed = [], []
        for stamp, packet in packets:
            if stamp is None:
                self.out.write(packet)
            else:
                ts.append(stamp)
                timed.append(packet)
        self.order.add_packets(ts, timed)

    def _descriptors(self, packets):
        for packet in packets:
            self.out.write(packet)

    def _tracks(self, pids, tids, comms):
        for pid, tid, comm in zip(pids, tids, comms):
            if (pid, tid) not in self.tracks.threads:
                self._descriptors(self.tracks.new(pid, tid, comm.decode(errors="replace")))

    def _device_tracks(self, device):
        ev = device.events
        by_api = device.api_groups()
        submitted = np.flatnonzero(by_api.of_kinds(*SUBMISSION_KINDS)
                                   & (ev["retired_ns"] != NONE))
        rows = np.stack([ev["pid"].astype(np.uint64), ev["stream_handle"]], axis=1)
        # A track is named by the stream of the last row on its (process,
        # handle), of any kind: found per distinct key, not per row.
        every, last = np.unique(rows[::-1], axis=0, return_index=True)
        stream_of = dict(zip(map(tuple, every.tolist()),
                             device.stream[len(rows) - 1 - last].tolist()))
        for pid, handle in np.unique(rows[submitted], axis=0).tolist():
            self._descriptors(self.tracks.stream(pid, stream_of[(pid, handle)], handle))
        for pid in np.unique(ev["pid"][by_api.of_kinds("memcpy")]).tolist():
            self._descriptors(self.tracks.copied(pid))

    def step(self, step, extra=()):
        """One replay step; `extra`: more (timestamp or None, packet) of it."""
        runq, device = step.part("cpu.runq"), step.device_rows()
        newest = [int(part["ts_ns"][-1]) for part in step.records.values() if len(part)]
        gpus = step.part("gpu.state")
        if gpus is not None:
            self._write(gpu_state_packets(gpus, self.tracks))
        if runq is not None:
            # By the waits' begins, a batch at a time (not a sorted copy of the step).
            order = np.argsort(wait_start_ns(runq), kind="stable")
            self._tracks(*first_per_thread(runq, order))
            for lo in range(0, len(runq), BATCH):
                self.order.add(*_runq_slice_packets(records_at(runq, order[lo:lo + BATCH])))
            self.slices += len(runq)
        if device is not None:
            ev = device.events
            self._tracks(*first_per_thread(ev))
            self._device_tracks(device)
            for part in device.batches(BATCH // 4):
                ts, lengths, blob, starts = self.device.timed_packets(part)
                self.order.add(ts, lengths, blob, starts)
            newest.append(int(ev["ts_ns"].max()))
            self.slices += len(device)
        self._write(extra)
        if newest:
            self.order.passed(max(newest))

    def finish(self):
        self.order.finish()


def _runq_slice_packets(runq: np.ndarray):
    """(timestamps, lengths, bytes) of run-queue waits' slices."""
    start = wait_start_ns(runq)
    begin, end = slice_rows_apart(start, runq["ts_ns"] - start, runq["pid"], runq["tid"],
                                  labels("cpu", "runq"))
    return paired(begin, end, start, runq["ts_ns"])


def write_recording(steps, out, source=None, detectors=None) -> int:
    """Write the slices of `steps` (a recording's replay) to the binary
    stream `out`; returns their number. With the recording (`source`),
    its clocks go in a ClockSnapshot, and its anomalies follow: the one
    that made a flight recording, and those that `detectors` (fed each
    step, then finished) find over the same steps, as `report` lists them;
    then its hint audit log. Request latencies and entropy that
    dispatchers reported are counter tracks."""
    header = getattr(source, "header", None) or {}
    start = header.get("start_monotonic_ns")
    writer = PerfettoWriter(out, header.get("realtime_minus_monotonic_ns"),
                            start if isinstance(start, int) and start >= 0 else 0)
    telemetry = Telemetry(source)
    for step in steps:
        writer.step(step, telemetry.step(step))
        if detectors is not None:
            detectors.feed(step)
    writer.finish()
    if source is not None:
        found = [{**a, "source": "replay"} for a in detectors.finish()] if detectors else []
        for sequence, packets in ((ANOMALY_SEQUENCE,
                                   anomaly_packets(recorded_anomalies(source) + found)),
                                  (HINT_SEQUENCE, hint_packets(source)),
                                  (MEMORY_SEQUENCE, memory_packets(source, writer.tracks))):
            _write_sequence(out, sequence, packets)
    return writer.slices


def _write_sequence(out, sequence: int, packets):
    """(timestamp or None, packet) on `sequence` of their own, descriptors
    first, the rest in time order."""
    packets = list(packets)
    if not packets:
        return
    out.write(sequence_start(sequence))
    for _, packet in sorted(packets, key=lambda item: -1 if item[0] is None else item[0]):
        out.write(on_sequence(packet, sequence))
