"""The recording file: append-only, chunked, checksummed, versioned.

    file   := header chunk*
    header := MAGIC u16 major u16 minor u32 json_len json u32 crc32
    chunk  := "MMCK" u8 kind u8 reserved u16 schema u32 count u32 len u32 crc32 payload

The crc of a chunk covers its header fields (crc zeroed) and its payload.
EVENTS payloads are raw little-endian records of the schema named in the
file header, so a reader needs nothing but the file. A recording cut short
(kill -9, power loss) reads back up to its last complete chunk; the END
chunk tells a reader that the writer closed the file itself.
"""

import json
import os
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"MMTRACE\x00"
MAJOR = 1
MINOR = 0
_HEAD = struct.Struct("<8sHHI")
_CRC = struct.Struct("<I")
CHUNK_MAGIC = b"MMCK"
_CHUNK = struct.Struct("<4sBBHIII")

KIND_EVENTS = 1
KIND_META = 2
KIND_END = 3
KIND_NAMES = {KIND_EVENTS: "events", KIND_META: "meta", KIND_END: "end"}

MAX_HEADER_BYTES = 16 << 20
MAX_CHUNK_BYTES = 1 << 30


class RecordingError(Exception):
    """The file cannot be read as a recording at all."""


def dtype_to_json(dtype: np.dtype) -> list:
    return [[name, dtype.fields[name][0].str] for name in dtype.names]


def dtype_from_json(descr) -> np.dtype:
    try:
        return np.dtype([(str(name), str(fmt)) for name, fmt in descr])
    except (TypeError, ValueError) as exc:
        raise RecordingError(f"header describes an invalid record layout: {exc}") from None


class RecordingWriter:
    """Writes a recording; each `write_*` call appends one whole chunk."""

    def __init__(self, path, schemas: dict[str, np.dtype], info: dict | None = None,
                 fsync_interval_s: float = 1.0):
        self.path = Path(path)
        self.schemas = {name: np.dtype(dt) for name, dt in schemas.items()}
        self._schema_ids = {name: i for i, name in enumerate(self.schemas)}
        self._file = open(self.path, "wb")
        # fsync runs in a thread of its own: on a loaded host one took 2.6 s,
        # and a drain loop blocked that long let the kernel's ring overflow.
        self._closing = threading.Event()
        self._syncer = threading.Thread(target=self._sync_every, args=(fsync_interval_s,),
                                        name="mmtrace-fsync", daemon=True)
        self.events_written = 0
        self.bytes_written = 0
        self.closed = False
        header = {
            "schemas": {name: dtype_to_json(dt) for name, dt in self.schemas.items()},
            "created_unix_s": time.time(),
            "start_monotonic_ns": time.monotonic_ns(),
            "realtime_minus_monotonic_ns": time.time_ns() - time.monotonic_ns(),
            **(info or {}),
        }
        body = json.dumps(header, sort_keys=True).encode()
        head = _HEAD.pack(MAGIC, MAJOR, MINOR, len(body)) + body
        self._write(head + _CRC.pack(zlib.crc32(head)))
        self._syncer.start()

    def _sync_every(self, interval_s: float):
        """Bound what a host crash can lose to about `interval_s` of chunks;
        a killed process loses nothing written (the page cache keeps it)."""
        synced = 0
        while not self._closing.wait(interval_s):
            written = self.bytes_written
            if written != synced:
                try:
                    os.fsync(self._file.fileno())
                except (OSError, ValueError):   # closed under us: nothing left to sync
                    return
                synced = written

    def _write(self, data: bytes):
        self._file.write(data)
        self._file.flush()
        self.bytes_written += len(data)

    def _chunk(self, kind: int, schema: int, count: int, payload: bytes):
        fields = (CHUNK_MAGIC, kind, 0, schema, count, len(payload))
        crc = zlib.crc32(payload, zlib.crc32(_CHUNK.pack(*fields, 0)))
        self._write(_CHUNK.pack(*fields, crc) + payload)

    def write_events(self, schema: str, records: np.ndarray):
        if schema not in self._schema_ids:
            raise KeyError(f"schema {schema!r} is not one of {list(self._schema_ids)}")
        if records.dtype != self.schemas[schema]:
            raise TypeError(f"{schema}: expected records of {self.schemas[schema]}, "
                            f"got {records.dtype}")
        if len(records) == 0:
            return
        self._chunk(KIND_EVENTS, self._schema_ids[schema], len(records),
                    np.ascontiguousarray(records).tobytes())
        self.events_written += len(records)

    def write_meta(self, meta: dict):
        self._chunk(KIND_META, 0, 0, json.dumps(meta, sort_keys=True).encode())

    def close(self, footer: dict | None = None):
        """Write the END chunk and close; a second call does nothing."""
        if self.closed:
            return
        self._chunk(KIND_END, 0, 0, json.dumps(footer or {}, sort_keys=True).encode())
        self._closing.set()
        self._syncer.join()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.closed = True


@dataclass
class Recording:
    path: Path
    header: dict
    events: dict[str, np.ndarray]
    meta: list[dict] = field(default_factory=list)
    footer: dict | None = None
    warnings: list[str] = field(default_factory=list)
    version: tuple[int, int] = (MAJOR, MINOR)

    @property
    def complete(self) -> bool:
        return self.footer is not None


def read_recording(path) -> Recording:
    """Read a whole recording. Raises RecordingError when nothing can be
    trusted; a damaged or cut tail gives the intact prefix and a warning."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RecordingError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise RecordingError(f"{path}: is a directory, expected a recording file") from None
    except PermissionError:
        raise RecordingError(f"{path}: permission denied") from None
    header, offset, version = _read_header(path, data)
    schemas = {}
    for name, descr in header.get("schemas", {}).items():
        schemas[name] = dtype_from_json(descr)
    schema_names = list(schemas)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in schema_names}
    rec = Recording(path=path, header=header, events={}, version=version)
    index = 0
    while offset < len(data):
        problem = None
        if len(data) - offset < _CHUNK.size:
            problem = f"cut short inside the header of chunk {index}"
        else:
            magic, kind, _, schema, count, length, crc = _CHUNK.unpack_from(data, offset)
            start = offset + _CHUNK.size
            if magic != CHUNK_MAGIC:
                problem = f"chunk {index} has no chunk marker"
            elif length > MAX_CHUNK_BYTES or start + length > len(data):
                problem = f"cut short inside chunk {index}"
            else:
                payload = data[start:start + length]
                expect = zlib.crc32(payload, zlib.crc32(
                    _CHUNK.pack(magic, kind, 0, schema, count, length, 0)))
                if expect != crc:
                    problem = f"chunk {index} fails its checksum"
                else:
                    problem = _take_chunk(rec, parts, schema_names, schemas, kind,
                                          schema, count, payload, index)
        if problem:
            rec.warnings.append(
                f"{path}: {problem} (byte {offset}); read the {index} intact chunks before it")
            break
        offset = start + length
        index += 1
        if rec.footer is not None:
            if offset < len(data):
                rec.warnings.append(f"{path}: {len(data) - offset} bytes after the end chunk ignored")
            break
    if rec.footer is None and not rec.warnings:
        rec.warnings.append(
            f"{path}: no end chunk, the recording was cut short; read its {index} complete chunks")
    rec.events = {name: (np.concatenate(p) if p else np.empty(0, schemas[name]))
                  for name, p in parts.items()}
    return rec


def _read_header(path, data: bytes):
    if len(data) < _HEAD.size or not data.startswith(MAGIC):
        raise RecordingError(f"{path}: not an mmtrace recording (no MMTRACE magic at the start)")
    _, major, minor, body_len = _HEAD.unpack_from(data, 0)
    if major > MAJOR:
        raise RecordingError(
            f"{path}: recording format {major}.{minor} is newer than this mmtrace reads "
            f"({MAJOR}.x); upgrade mmtrace")
    end = _HEAD.size + body_len
    if body_len > MAX_HEADER_BYTES or end + _CRC.size > len(data):
        raise RecordingError(f"{path}: recording header is cut short or damaged")
    (crc,) = _CRC.unpack_from(data, end)
    if zlib.crc32(data[:end]) != crc:
        raise RecordingError(f"{path}: recording header fails its checksum")
    try:
        header = json.loads(data[_HEAD.size:end])
    except ValueError as exc:
        raise RecordingError(f"{path}: recording header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("schemas", {}), dict):
        raise RecordingError(f"{path}: recording header has no schema table")
    return header, end + _CRC.size, (major, minor)


def _take_chunk(rec, parts, schema_names, schemas, kind, schema, count, payload, index):
    """Add one verified chunk to `rec`; return a problem string or None."""
    if kind == KIND_EVENTS:
        if schema >= len(schema_names):
            return f"chunk {index} names schema {schema}, the header has {len(schema_names)}"
        dtype = schemas[schema_names[schema]]
        if count * dtype.itemsize != len(payload):
            return (f"chunk {index} holds {len(payload)} bytes, expected "
                    f"{count} records of {dtype.itemsize}")
        parts[schema_names[schema]].append(np.frombuffer(payload, dtype, count))
        return None
    if kind in (KIND_META, KIND_END):
        try:
            doc = json.loads(payload)
        except ValueError:
            return f"chunk {index} ({KIND_NAMES[kind]}) is not valid JSON"
        if not isinstance(doc, dict):
            return f"chunk {index} ({KIND_NAMES[kind]}) is not a JSON object"
        if kind == KIND_META:
            rec.meta.append(doc)
        else:
            rec.footer = doc
        return None
    return f"chunk {index} has unknown kind {kind}"
