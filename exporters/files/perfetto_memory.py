"""Device memory on Perfetto counter tracks: per process, what it holds
(bytes allocated and not freed, on every stream and device together),
stepped at each allocation and free that changed it
(bpf/device_memory.py). Written on a sequence of its own after the
replay: the replay's device rows carry the exported kinds only."""

import numpy as np

from mmtrace.bpf import device_memory as dm
from mmtrace.exporters.files.perfetto_fields import (
    CD_UNIT, COUNTER, TE_COUNTER_VALUE, TE_TRACK_UUID, TE_TYPE, TP_TIMESTAMP, TP_TRACK_EVENT,
    UNIT_SIZE_BYTES, packet)
from mmtrace.exporters.files.perfetto_tracks import Tracks
from mmtrace.exporters.files.protowire import field_bytes, field_varint


def memory_uuid(pid: int) -> int:
    return 1 << 56 | pid


def memory_packets(source, tracks: Tracks):
    """(None, descriptor) and (timestamp, counter packet) of each process's
    device memory held, from the recording's allocation records."""
    if source is None or "dev.event" not in getattr(source, "schemas", {}):
        return
    held: dict[int, int] = {}
    for piece in source.pieces("dev.event"):
        mine = piece[np.isin(piece["kind"], (dm.ALLOC, dm.FREE))]
        if not len(mine):
            continue
        mine = mine[np.argsort(mine["ts_ns"], kind="stable")]
        add, drop = dm.held(mine), dm.released(mine)
        for i in np.flatnonzero(add | drop).tolist():
            pid, size = int(mine["pid"][i]), int(mine["bytes"][i])
            now = held.get(pid, 0)
            now = now + size if add[i] else max(0, now - size)
            held[pid] = now
            for descriptor in tracks.named(pid, memory_uuid(pid), "device memory held",
                                           field_varint(CD_UNIT, UNIT_SIZE_BYTES)):
                yield None, descriptor
            ts = int(mine["ts_ns"][i])
            event = (field_varint(TE_TYPE, COUNTER) + field_varint(TE_TRACK_UUID, memory_uuid(pid))
                     + field_varint(TE_COUNTER_VALUE, now))
            yield ts, packet(field_varint(TP_TIMESTAMP, ts), field_bytes(TP_TRACK_EVENT, event))
