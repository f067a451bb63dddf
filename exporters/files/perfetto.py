"""Native Perfetto trace (protobuf TracePacket stream) for ui.perfetto.dev.

Every thread gets a track (grouped under its process); each event that has
a duration becomes a slice on its thread's track. Each GPU/NPU stream gets a
track too, where a submission is a slice from its call to its retirement,
with a flow from the submission's call to the sync that retired it; each
process that copies gets a counter track of the bytes it has copied, and
each GPU sampled by NVML counter tracks of its utilisations. Field
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
from mmtrace.exporters.files.perfetto_rows import labels, slice_rows
from mmtrace.exporters.files.perfetto_telemetry import Telemetry, hint_packets
from mmtrace.exporters.files.perfetto_tracks import Tracks
from mmtrace.exporters.files.rowtext import BATCH, Rows, first_per_thread, write_merged


class PerfettoWriter:
    """Writes the slices of each replay step (agent/recording/replay.py) as they come:
    run-queue waits a batch at a time, GPU/NPU calls one by one."""

    def __init__(self, out):
        self.out = out
        self.tracks = Tracks()
        self.device = DeviceEncoder()
        self.slices = 0

    def _write(self, packets):
        for packet in packets:
            self.out.write(packet)

    def _tracks(self, pids, tids, comms):
        for pid, tid, comm in zip(pids, tids, comms):
            if (pid, tid) not in self.tracks.threads:
                self._write(self.tracks.new(pid, tid, comm.decode(errors="replace")))

    def _device_tracks(self, device):
        ev = device.events
        submitted = np.array([k in SUBMISSION_KINDS for k in device.kind], bool) & (
            ev["retired_ns"] != NONE)
        keys = np.unique(np.stack([ev["pid"][submitted].astype(np.uint64),
                                   ev["stream_handle"][submitted]], axis=1), axis=0)
        stream_of = dict(zip(zip(ev["pid"].tolist(), ev["stream_handle"].tolist()),
                             device.stream.tolist()))
        for pid, handle in keys.tolist():
            self._write(self.tracks.stream(pid, stream_of[(pid, handle)], handle))
        for pid in np.unique(ev["pid"][device.kind == "memcpy"]).tolist():
            self._write(self.tracks.copied(pid))

    def step(self, step):
        runq, device = step.part("cpu.runq"), step.device_rows()
        gpus = step.part("gpu.state")
        if gpus is not None:
            self._write(gpu_state_packets(gpus, self.tracks))
        if runq is not None:
            start = wait_start_ns(runq)
            order = np.argsort(start, kind="stable")
            runq, start = runq[order], start[order]
            self._tracks(*first_per_thread(runq))
        others, other_keys = [], np.zeros(0, np.uint64)
        if device is not None:
            ev = device.events
            self._tracks(*first_per_thread(ev))
            self._device_tracks(device)
            others = [packets for part in device.batches(BATCH // 4)
                      for packets in self.device.packets(part)]
            other_keys = ev["ts_ns"]
        if runq is None:
            for row in others:
                self.out.write(row)
        else:
            write_merged(self.out, _runq_slice_rows, runq, start, others, other_keys)
        self.slices += (0 if runq is None else len(runq)) + len(others)


def _runq_slice_rows(runq: np.ndarray) -> Rows:
    start = wait_start_ns(runq)
    return slice_rows(start, runq["ts_ns"] - start, runq["pid"], runq["tid"],
                      labels("cpu", "runq"))


def write_recording(steps, out, source=None, detectors=None) -> int:
    """Write the slices of `steps` (a recording's replay) to the binary
    stream `out`; returns their number. With the recording (`source`),
    its anomalies follow: the one that made a flight recording, and those
    that `detectors` (fed each step, then finished) find over the same
    steps, as `report` lists them; then its hint audit log. Request
    latencies and entropy that dispatchers reported are counter tracks."""
    writer = PerfettoWriter(out)
    telemetry = Telemetry(source)
    for step in steps:
        writer.step(step)
        writer._write(telemetry.step(step))
        if detectors is not None:
            detectors.feed(step)
    if source is not None:
        found = [{**a, "source": "replay"} for a in detectors.finish()] if detectors else []
        for packet in anomaly_packets(recorded_anomalies(source) + found):
            out.write(packet)
        for packet in hint_packets(source):
            out.write(packet)
    return writer.slices
