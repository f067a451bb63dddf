"""Anomalies in a Perfetto trace: an instant each on one global track, its
evidence as debug annotations (scalars as they are, the rest as JSON)."""

import json
import struct

from mmtrace.exporters.files.protowire import field_bytes, field_str, field_varint, varint

from mmtrace.exporters.files.perfetto_fields import (INSTANT, TD_NAME, TD_UUID, TE_CATEGORIES, TE_NAME, TE_TRACK_UUID,
                              TE_TYPE, TP_TIMESTAMP, TP_TRACK_DESCRIPTOR, TP_TRACK_EVENT,
                              packet)

TE_DEBUG_ANNOTATIONS = 4
# DebugAnnotation
DA_BOOL = 2
DA_INT = 4
DA_DOUBLE = 5
DA_STRING = 6
DA_NAME = 10

ANOMALY_TRACK = 1 << 59         # apart from the process, thread and stream tracks
TRACK_NAME = "mmtrace anomalies"
CATEGORY = "mmtrace.anomaly"
INT64 = 1 << 63


def recorded_anomalies(source) -> list[dict]:
    """The anomaly that made a flight recording (its header, else its
    footer), stamped at the anomaly's time or else the recording's end."""
    footer = getattr(source, "footer", None) or {}
    anomaly = (getattr(source, "header", None) or {}).get("anomaly") or footer.get("anomaly")
    if not isinstance(anomaly, dict):
        return []
    anomaly = {**anomaly, "source": "flight recording"}
    if not isinstance(anomaly.get("ts_ns"), int):
        end = footer.get("end_monotonic_ns")
        if not isinstance(end, int):
            return []
        anomaly["ts_ns"] = end
    return [anomaly]


def annotation(name: str, value) -> bytes:
    body = field_str(DA_NAME, name)
    if isinstance(value, bool):
        body += field_varint(DA_BOOL, int(value))
    elif isinstance(value, int) and -INT64 <= value < INT64:
        body += field_varint(DA_INT, value)
    elif isinstance(value, float):
        body += varint(DA_DOUBLE << 3 | 1) + struct.pack("<d", value)
    elif isinstance(value, str):
        body += field_str(DA_STRING, value)
    else:
        body += field_str(DA_STRING, json.dumps(value, default=str))
    return field_bytes(TE_DEBUG_ANNOTATIONS, body)


def anomaly_event(anomaly: dict) -> bytes:
    """The TrackEvent of one anomaly: what fired (detector, series or kind,
    state, ...) then each piece of its evidence, by name."""
    what = anomaly.get("series") or anomaly.get("kind") or "anomaly"
    name = f"{anomaly.get('detector', 'anomaly')} {what} {anomaly.get('state', '')}".strip()
    body = (field_varint(TE_TYPE, INSTANT) + field_varint(TE_TRACK_UUID, ANOMALY_TRACK)
            + field_str(TE_CATEGORIES, CATEGORY) + field_str(TE_NAME, name))
    for key, value in anomaly.items():
        if key not in ("evidence", "ts_ns"):
            body += annotation(key, value)
    evidence = anomaly.get("evidence")
    if isinstance(evidence, dict):
        for key, value in evidence.items():
            body += annotation(f"evidence.{key}", value)
    return body


def anomaly_packets(anomalies: list[dict]):
    """The anomalies' track, then an instant per anomaly, as (timestamp
    or None for the descriptor, packet)."""
    if not anomalies:
        return
    desc = field_varint(TD_UUID, ANOMALY_TRACK) + field_str(TD_NAME, TRACK_NAME)
    yield None, packet(field_bytes(TP_TRACK_DESCRIPTOR, desc))
    for a in anomalies:
        ts = min(max(0, int(a.get("ts_ns", 0))), INT64 - 1)    # a crafted file's too
        yield ts, packet(field_varint(TP_TIMESTAMP, ts),
                         field_bytes(TP_TRACK_EVENT, anomaly_event(a)))
