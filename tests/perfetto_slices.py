"""A recording's events as Perfetto slices, all at once: what the tests
compare the streaming writer (exporters/files/perfetto.py) with."""

from mmtrace.agent.recording.device_view import DeviceContext, decode
from mmtrace.exporters.files.perfetto_events import Slice, device_items, runq_slices


def recording_slices(events: dict, meta=()) -> list[Slice]:
    slices = []
    names = {}
    runq = events.get("cpu.runq")
    if runq is not None and len(runq):
        slices = runq_slices(runq)
        names = {(s.pid, s.tid): s.thread_name for s in slices}
    device = events.get("dev.event")
    if device is not None and len(device):
        rows = decode(device, DeviceContext.from_meta(list(meta)))
        for pid, tid, comm in zip(device["pid"].tolist(), device["tid"].tolist(),
                                  device["comm"].tolist()):
            names.setdefault((pid, tid), comm.decode(errors="replace"))
        slices += [items[0] for items in device_items(rows, names)]
    return slices
