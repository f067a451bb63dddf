"""What dispatchers reported and what the agent told them, in a Perfetto
trace: request latency per series and mean attention entropy per
modality as counter tracks, and the hint audit log as instants."""

import struct

import numpy as np

from mmtrace.exporters.files.perfetto_fields import (COUNTER, INSTANT, TD_COUNTER, TD_NAME, TD_UUID, TE_CATEGORIES,
                              TE_DOUBLE_COUNTER_VALUE, TE_NAME, TE_TRACK_UUID, TE_TYPE,
                              TP_TIMESTAMP, TP_TRACK_DESCRIPTOR, TP_TRACK_EVENT, packet)
from mmtrace.exporters.files.perfetto_anomalies import INT64, annotation
from mmtrace.exporters.files.protowire import field_bytes, field_str, field_varint, varint

REQUEST_TRACK = 1 << 57         # | series id
ENTROPY_TRACK = 1 << 56         # | modality id
HINT_TRACK = 1 << 55
HINT_KEYS = ("kind", "target", "value", "step", "outcome", "reason", "id")


def latest_table(source, key: str) -> list[str]:
    """The last version of a name table in the recording's meta (tables grow)."""
    for doc in reversed(getattr(source, "meta", None) or []):
        if isinstance(doc, dict) and isinstance(doc.get(key), list):
            return [str(x) for x in doc[key]]
    return []


class Telemetry:
    """Each replay step's request latencies and entropy samples, as
    (timestamp, packet); a track's descriptor first, as (None, packet)."""

    def __init__(self, source=None):
        self.source = source
        self.tracks: set = set()

    def step(self, step):
        requests = step.part("request.latency")
        if requests is not None:
            names = latest_table(self.source, "request_series")
            yield from self._counters(REQUEST_TRACK, requests["series"], requests["ts_ns"],
                                      requests["value_s"] * 1e3,
                                      lambda i: f"request latency ms {_name(names, i)}")
        entropy = step.part("model.entropy")
        if entropy is not None:
            names = latest_table(self.source, "modalities")
            # one point per (modality, time): the mean over the heads sampled then
            keys, at = np.unique(np.stack([entropy["modality"].astype(np.uint64),
                                           entropy["ts_ns"].astype(np.uint64)], axis=1),
                                 axis=0, return_inverse=True)
            at = at.reshape(-1)
            means = np.bincount(at, entropy["value"]) / np.bincount(at)
            yield from self._counters(ENTROPY_TRACK, keys[:, 0], keys[:, 1], means,
                                      lambda i: f"attention entropy {_name(names, i)}")

    def _counters(self, base: int, ids, ts, values, name):
        for i, t, v in zip(ids.tolist(), ts.tolist(), values.tolist()):
            uuid = base | int(i) & 0xFFFFFFFF
            if uuid not in self.tracks:
                self.tracks.add(uuid)
                desc = (field_varint(TD_UUID, uuid) + field_str(TD_NAME, name(int(i)))
                        + field_bytes(TD_COUNTER, b""))
                yield None, packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))
            event = (field_varint(TE_TYPE, COUNTER) + field_varint(TE_TRACK_UUID, uuid)
                     + varint(TE_DOUBLE_COUNTER_VALUE << 3 | 1) + struct.pack("<d", v))
            yield int(t), packet(field_varint(TP_TIMESTAMP, int(t)),
                                 field_bytes(TP_TRACK_EVENT, event))


def hint_packets(source):
    """The hint audit log of a recording (its latest copy in the meta): an
    instant per decision, sent, held back by the cap, or dry-run; as
    (timestamp, packet), the track's descriptor as (None, packet)."""
    audit = []
    for doc in getattr(source, "meta", None) or []:
        if isinstance(doc, dict) and isinstance(doc.get("hint_audit"), list):
            audit = doc["hint_audit"]
    entries = [e for e in audit if isinstance(e, dict) and isinstance(e.get("ts_ns"), int)]
    if not entries:
        return
    desc = field_varint(TD_UUID, HINT_TRACK) + field_str(TD_NAME, "mmtrace hints")
    yield None, packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))
    for e in entries:
        body = (field_varint(TE_TYPE, INSTANT) + field_varint(TE_TRACK_UUID, HINT_TRACK)
                + field_str(TE_CATEGORIES, "mmtrace.hint")
                + field_str(TE_NAME, f"{e.get('kind')} {e.get('target')} -> {e.get('value')}"))
        for key in HINT_KEYS:
            if key in e:
                body += annotation(key, e[key])
        ts = min(max(0, e["ts_ns"]), INT64 - 1)
        yield ts, packet(field_varint(TP_TIMESTAMP, ts), field_bytes(TP_TRACK_EVENT, body))


def _name(table: list[str], i: int) -> str:
    return table[i] if 0 <= i < len(table) else str(i)
