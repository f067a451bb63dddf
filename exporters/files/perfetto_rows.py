"""Perfetto packets a batch at a time: the TracePackets of n track events
built as byte matrices (rowtext.Rows), to the same bytes as
perfetto_events writes one by one."""

import numpy as np

from mmtrace.exporters.files.perfetto_fields import (
    TRACE_PACKET, TP_TIMESTAMP, TP_SEQUENCE_ID, TP_TRACK_EVENT, TE_TYPE, TE_TRACK_UUID,
    TE_CATEGORIES, TE_NAME, TE_COUNTER_VALUE, SLICE_BEGIN, SLICE_END, COUNTER, SEQUENCE_ID)
from mmtrace.exporters.files.perfetto_tracks import thread_uuids
from mmtrace.exporters.files.protowire import field_str, field_varint, varint
from mmtrace.exporters.files.rowtext import Rows, varint_lengths


def _packet_rows(ts: np.ndarray, body: Rows) -> Rows:
    """TracePackets (timestamp, track event) around n track event bodies."""
    tag_ts = varint(TP_TIMESTAMP << 3)
    te_head = varint(TP_TRACK_EVENT << 3 | 2)
    event_len = body.lengths().copy()
    inner_len = (len(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID)) + len(tag_ts)
                 + varint_lengths(ts) + len(te_head) + varint_lengths(event_len) + event_len)
    return (Rows(body.n).const(varint(TRACE_PACKET << 3 | 2)).varint(inner_len)
            .const(field_varint(TP_SEQUENCE_ID, SEQUENCE_ID) + tag_ts).varint(ts)
            .const(te_head).varint(event_len).rows(body))


def event_rows(n: int, ts: np.ndarray, track: np.ndarray, kind: bytes, labels=b"",
                extra=None):
    """TracePackets for n events of one type: the track event is its type
    field (`kind`), the track uuid, then `labels` (fixed bytes, or (codes,
    entries) for labels that differ by row), then what `extra` (a function
    of the event body's Rows) adds."""
    body = Rows(n).const(kind).const(varint(TE_TRACK_UUID << 3)).varint(track)
    if isinstance(labels, bytes):
        body.const(labels)
    else:
        body.table(*labels)
    if extra is not None:
        body = extra(body)
    return _packet_rows(ts, body)


def slice_rows_apart(start_ns: np.ndarray, duration_ns: np.ndarray, pid: np.ndarray,
                     tid: np.ndarray, labels, track: np.ndarray | None = None,
                     extra=None) -> tuple[Rows, Rows]:
    """The begin packets and the end packets of a whole batch of slices, as
    perfetto_events.slice_packets writes them (labels and extra as
    event_rows takes them)."""
    n = len(start_ns)
    track = thread_uuids(pid, tid) if track is None else track
    begin = event_rows(n, start_ns, track, field_varint(TE_TYPE, SLICE_BEGIN), labels, extra)
    end = event_rows(n, start_ns + duration_ns, track, field_varint(TE_TYPE, SLICE_END))
    return begin, end


def slice_rows(start_ns, duration_ns, pid, tid, labels, track=None, extra=None) -> Rows:
    """A begin and an end packet per slice, a row each (slice_rows_apart)."""
    begin, end = slice_rows_apart(start_ns, duration_ns, pid, tid, labels, track, extra)
    return begin.rows(end)


def paired(begin: Rows, end: Rows, begin_ns: np.ndarray, end_ns: np.ndarray):
    """(timestamps, lengths, bytes) of slices' packets, begin then end of each."""
    ts = np.stack([np.asarray(begin_ns, np.uint64), np.asarray(end_ns, np.uint64)], axis=1)
    lengths = np.stack([begin.lengths(), end.lengths()], axis=1)
    return ts.reshape(-1), lengths.reshape(-1), begin.rows(end).bytes()


def counter_rows(ts: np.ndarray, track: np.ndarray, values: np.ndarray) -> Rows:
    """A counter packet per value, as perfetto_events.counter_packets writes it."""
    body = (Rows(len(ts)).const(field_varint(TE_TYPE, COUNTER))
            .const(varint(TE_TRACK_UUID << 3)).varint(track)
            .const(varint(TE_COUNTER_VALUE << 3)).varint(values))
    return _packet_rows(ts, body)


def labels(category: str, name: str) -> bytes:
    return field_str(TE_CATEGORIES, category) + field_str(TE_NAME, name)


def fixed64_rows(tag: bytes, values: np.ndarray) -> np.ndarray:
    """tag + 8 little-endian bytes per value, as a byte matrix."""
    return np.concatenate([np.broadcast_to(np.frombuffer(tag, np.uint8), (len(values), len(tag))),
                           values.astype("<u8").view(np.uint8).reshape(-1, 8)], axis=1)
