"""Recordings put together byte by byte, with valid checksums around any
content: what a writer never writes, but a file can still say."""

import json
import struct
import zlib

from mmtrace.agent.recording import file_format as recording
from mmtrace.bpf.sched import RUNQ_EVENT

RUNQ_SCHEMA = recording.dtype_to_json(RUNQ_EVENT)


def header(schemas=None, major=recording.MAJOR, minor=recording.MINOR, body=None) -> bytes:
    if body is None:
        body = json.dumps({"schemas": {"cpu.runq": RUNQ_SCHEMA} if schemas is None
                           else schemas}).encode()
    head = recording.MAGIC + struct.pack("<HHI", major, minor, len(body)) + body
    return head + struct.pack("<I", zlib.crc32(head))


def chunk(kind: int, payload: bytes, schema: int = 0, count: int = 0) -> bytes:
    fields = (recording.CHUNK_MAGIC, kind, 0, schema, count, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(recording._CHUNK.pack(*fields, 0)))
    return recording._CHUNK.pack(*fields, crc) + payload


def meta(doc) -> bytes:
    return chunk(recording.KIND_META, doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def end(doc) -> bytes:
    return chunk(recording.KIND_END, doc if isinstance(doc, bytes) else json.dumps(doc).encode())


def events(records, schema: int = 0) -> bytes:
    return chunk(recording.KIND_EVENTS, records.tobytes(), schema, len(records))


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth
