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
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmtrace.agent.bounded_json import loads_bounded
from mmtrace.agent.recording.file_checks import check_footer, check_header, check_meta
from mmtrace.agent.safe_files import create_new, replace_file, stream_in_place

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

MAX_HEADER_BYTES = 1 << 20
MAX_CHUNK_BYTES = 1 << 30
MAX_DOC_BYTES = 8 << 20         # one meta or end chunk
MAX_META_BYTES = 8 << 20        # meta kept in memory, all chunks together
PIECE_BYTES = 4 << 20           # events are handed out at most this much at a time
# Events are written in chunks of at most this much: a disk that fills up
# loses the chunk it refused, not the whole backlog of a drain.
EVENT_CHUNK_BYTES = 512 << 10


class RecordingError(Exception):
    """The file cannot be read as a recording at all."""


def dtype_to_json(dtype: np.dtype) -> list:
    return [[name, dtype.fields[name][0].str] for name in dtype.names]


class RecordingWriter:
    """Writes a recording; each `write_*` call appends one whole chunk."""

    def __init__(self, path, schemas: dict[str, np.dtype], info: dict | None = None,
                 fsync_interval_s: float = 1.0, *, exclusive: bool = False):
        """The file is created mode 0600 whatever the umask, never through a
        symbolic link: an existing regular file is replaced, unless
        `exclusive` (then FileExistsError); anything else there is refused
        with UnsafePathError (agent/safe_files.py)."""
        self.path = Path(path)
        # The header lists the schemas sorted by name (sort_keys), and a
        # reader numbers them in that order: so must the chunks.
        self.schemas = {name: np.dtype(schemas[name]) for name in sorted(schemas)}
        self._schema_ids = {name: i for i, name in enumerate(self.schemas)}
        # Unbuffered: a write the disk refuses leaves nothing pending that a
        # later write or close would push after a partial chunk.
        # A pipe or a device (/dev/null, >(zstd > r.mmtr)) is written in place.
        fd = None if exclusive else stream_in_place(self.path)
        if fd is None:
            fd = create_new(self.path) if exclusive else replace_file(self.path)
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)
        self._regular = stat.S_ISREG(st.st_mode)     # only a file is synced
        self._file = open(fd, "wb", buffering=0)
        self.failed: OSError | None = None      # the write error that ended the recording
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
        while self._regular and not self._closing.wait(interval_s):
            written = self.bytes_written
            if written != synced:
                try:
                    os.fsync(self._file.fileno())
                except (OSError, ValueError):   # closed under us: nothing left to sync
                    return
                synced = written

    def _write(self, *parts):
        """Append `parts` (bytes or buffers) whole, or not at all: when the
        disk refuses them (full, over quota, failing) the file is cut back
        to the last complete chunk, so that it reads back up to there, and
        the error is raised. One writev for all of them: a chunk's header
        and its records go out without being joined first."""
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        try:
            fd = self._file.fileno()
            while views:
                done = os.writev(fd, views)
                while views and done >= views[0].nbytes:
                    done -= views[0].nbytes
                    views.pop(0)
                if views and done:
                    views[0] = views[0][done:]
        except OSError as exc:
            self.failed = exc
            try:
                os.ftruncate(self._file.fileno(), self.bytes_written)
                self._file.seek(self.bytes_written)
            except OSError:
                pass        # a reader stops at the partial chunk all the same
            raise
        self.bytes_written += size

    def _chunk(self, kind: int, schema: int, count: int, payload):
        payload = memoryview(payload).cast("B")
        fields = (CHUNK_MAGIC, kind, 0, schema, count, payload.nbytes)
        crc = zlib.crc32(payload, zlib.crc32(_CHUNK.pack(*fields, 0)))
        self._write(_CHUNK.pack(*fields, crc), payload)

    def write_events(self, schema: str, records: np.ndarray):
        if schema not in self._schema_ids:
            raise KeyError(f"schema {schema!r} is not one of {list(self._schema_ids)}")
        if records.dtype != self.schemas[schema]:
            raise TypeError(f"{schema}: expected records of {self.schemas[schema]}, "
                            f"got {records.dtype}")
        per_chunk = max(1, EVENT_CHUNK_BYTES // records.dtype.itemsize)
        records = np.ascontiguousarray(records)     # written from where they are, not copied
        for start in range(0, len(records), per_chunk):
            part = records[start:start + per_chunk]
            self._chunk(KIND_EVENTS, self._schema_ids[schema], len(part),
                        part.view(np.uint8).reshape(-1))
            self.events_written += len(part)

    def still_at_path(self) -> bool:
        """Whether the path still names the file written (not removed with
        its directory, or replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self._identity

    def write_meta(self, meta: dict):
        self._chunk(KIND_META, 0, 0, json.dumps(meta, sort_keys=True).encode())

    def close(self, footer: dict | None = None):
        """Write the END chunk and close; a second call does nothing."""
        if self.closed:
            return
        try:
            self._chunk(KIND_END, 0, 0, json.dumps(footer or {}, sort_keys=True).encode())
            self._closing.set()
            self._syncer.join()
            if self._regular:
                os.fsync(self._file.fileno())
        finally:
            self._closing.set()
            self._syncer.join()
            self._file.close()
            self.closed = True


def _open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file: a
    FIFO, device or socket could block or never end."""
    try:
        kind = os.stat(path).st_mode
        if stat.S_ISDIR(kind):
            raise RecordingError(f"{path}: is a directory, expected a recording file")
        if not stat.S_ISREG(kind):
            raise RecordingError(f"{path}: is not a regular file, expected a recording file")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RecordingError(f"{path}: no such file") from None
    except PermissionError:
        raise RecordingError(f"{path}: permission denied") from None
    except OSError as exc:
        raise RecordingError(f"{path}: cannot open: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):     # replaced since the stat
        os.close(fd)
        raise RecordingError(f"{path}: is not a regular file, expected a recording file")
    return fd


class RecordingReader:
    """A recording read in bounded memory. Opening it checks the header and
    walks every chunk once (checksums, meta, footer, counts); pieces(schema)
    then hands out one schema's events, a piece at a time, in file order.

    Raises RecordingError when nothing can be trusted, or when a chunk whose
    checksum holds says something no writer writes; a damaged or cut tail
    gives the intact prefix and a warning."""

    def __init__(self, path, scan: bool = True, fd: int | None = None):
        """`scan=False` reads the header alone (a listing of recordings):
        nothing past it is checked, so pieces() must not be used. `fd`: a
        regular file already opened (and checked) by the caller, read
        instead of opening `path` by name again; the reader owns it."""
        self.path = Path(path)
        self._fd = _open_regular(self.path) if fd is None else fd
        self.meta: list[dict] = []
        self.footer: dict | None = None
        self.warnings: list[str] = []
        self.counts: dict[str, int] = {}
        self.ts_range: dict[str, tuple[int, int]] = {}
        self._intact_chunks = 0
        try:
            self._size = os.fstat(self._fd).st_size
            self.header, self._data_start, self.version = self._read_header()
            self._intact_end = self._scan() if scan else self._data_start
        except BaseException:
            self.close()
            raise

    @property
    def complete(self) -> bool:
        return self.footer is not None

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the file opened: what was read, whatever its
        name has become since."""
        st = os.fstat(self._fd)
        return st.st_dev, st.st_ino

    def close(self):
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _error(self, what: str) -> RecordingError:
        return RecordingError(f"{self.path}: {what}")

    def _read(self, offset: int, size: int) -> bytes:
        try:
            return os.pread(self._fd, size, offset)
        except OSError as exc:
            raise self._error(f"cannot read at byte {offset}: {exc.strerror}") from None

    def _read_header(self):
        data = self._read(0, _HEAD.size)
        if len(data) < _HEAD.size or not data.startswith(MAGIC):
            raise self._error("not an mmtrace recording (no MMTRACE magic at the start)")
        _, major, minor, body_len = _HEAD.unpack(data)
        end = _HEAD.size + body_len
        # Nothing here is trusted before the checksum: a damaged length or
        # version is a damaged header, not a newer format.
        if body_len > MAX_HEADER_BYTES or end + _CRC.size > self._size:
            raise self._error("recording header is damaged or cut short "
                              f"(it claims {body_len} bytes, the file has {self._size})")
        data = self._read(0, end + _CRC.size)
        (crc,) = _CRC.unpack_from(data, end)
        if zlib.crc32(data[:end]) != crc:
            raise self._error("recording header fails its checksum: damaged, or not a recording")
        if major > MAJOR:
            raise self._error(f"recording format {major}.{minor} is newer than this mmtrace "
                              f"reads ({MAJOR}.x); upgrade mmtrace")
        try:
            header = loads_bounded(data[_HEAD.size:end], MAX_HEADER_BYTES)
            self.schemas = check_header(header)
        except ValueError as exc:
            raise self._error(f"recording header is not valid: {exc}") from None
        self._schema_names = list(self.schemas)
        self.counts = dict.fromkeys(self._schema_names, 0)
        return header, end + _CRC.size, (major, minor)

    def _chunks(self, start: int, end: int):
        """(index, offset, kind, schema, count, length, crc) of each chunk
        header from `start`, or (index, offset, problem) where reading stops."""
        offset, index = start, 0
        while offset < end:
            head = self._read(offset, _CHUNK.size)
            if len(head) < _CHUNK.size:
                yield index, offset, f"cut short inside the header of chunk {index}"
                return
            magic, kind, _, schema, count, length, crc = _CHUNK.unpack(head)
            if magic != CHUNK_MAGIC:
                yield index, offset, f"chunk {index} has no chunk marker"
                return
            if length > MAX_CHUNK_BYTES or offset + _CHUNK.size + length > end:
                yield index, offset, f"cut short inside chunk {index}"
                return
            yield index, offset, kind, schema, count, length, crc
            offset += _CHUNK.size + length
            index += 1

    def _payload(self, start: int, length: int, step: int):
        for pos in range(0, length, step):
            data = self._read(start + pos, min(step, length - pos))
            if len(data) != min(step, length - pos):
                raise self._error("changed while being read (it got shorter)")
            yield data

    def _scan(self) -> int:
        """Check every chunk; returns where the intact chunks end."""
        kept = _MetaKept(self)
        intact = self._data_start
        for index, offset, *chunk in self._chunks(self._data_start, self._size):
            if len(chunk) == 1:
                self.warnings.append(f"{self.path}: {chunk[0]} (byte {offset}); "
                                     f"read the {index} intact chunks before it")
                return intact
            kind, schema, count, length, crc = chunk
            start = offset + _CHUNK.size
            problem, payload = self._verify(index, kind, schema, count, start, length, crc)
            if problem:
                self.warnings.append(f"{self.path}: {problem} (byte {offset}); "
                                     f"read the {index} intact chunks before it")
                return intact
            intact = start + length
            if kind == KIND_META:
                kept.add(payload, length)
            elif kind == KIND_END:
                self.footer = payload
                if intact < self._size:
                    self.warnings.append(f"{self.path}: {self._size - intact} bytes after "
                                         "the end chunk ignored")
                return intact
            self._intact_chunks = index + 1
        self.warnings.append(f"{self.path}: no end chunk, the recording was cut short; "
                             f"read its {self._intact_chunks} complete chunks")
        return intact

    def _verify(self, index, kind, schema, count, start, length, crc):
        """(problem, document) of one chunk; events are counted, a meta or
        end document is parsed and checked."""
        what = KIND_NAMES.get(kind)
        if what is None:
            return f"chunk {index} has unknown kind {kind}", None
        if kind != KIND_EVENTS and length > MAX_DOC_BYTES:
            return f"chunk {index} ({what}) holds {length} bytes, more than any writer", None
        if kind == KIND_EVENTS:
            if schema >= len(self._schema_names):
                return (f"chunk {index} names schema {schema}, "
                        f"the header has {len(self._schema_names)}"), None
            name = self._schema_names[schema]
            dtype = self.schemas[name]
            if count * dtype.itemsize != length:
                return (f"chunk {index} holds {length} bytes, expected "
                        f"{count} records of {dtype.itemsize}"), None
        expect = zlib.crc32(_CHUNK.pack(CHUNK_MAGIC, kind, 0, schema, count, length, 0))
        lo, hi, body = None, None, b""
        step = (PIECE_BYTES // dtype.itemsize) * dtype.itemsize if kind == KIND_EVENTS \
            else max(length, 1)
        for data in self._payload(start, length, step):
            expect = zlib.crc32(data, expect)
            if kind == KIND_EVENTS:
                ts = np.frombuffer(data, dtype)["ts_ns"]
                lo = min(int(ts.min()), lo if lo is not None else int(ts.min()))
                hi = max(int(ts.max()), hi if hi is not None else int(ts.max()))
            else:
                body = data
        if expect != crc:
            return f"chunk {index} fails its checksum", None
        if kind == KIND_EVENTS:
            self.counts[name] += count
            if lo is not None:
                old = self.ts_range.get(name, (lo, hi))
                self.ts_range[name] = (min(old[0], lo), max(old[1], hi))
            return None, None
        # The checksum holds: what the document says is what a writer wrote,
        # and a reader that cannot use it must say so rather than guess.
        try:
            doc = loads_bounded(body, MAX_DOC_BYTES)
            (check_meta if kind == KIND_META else check_footer)(doc)
        except ValueError as exc:
            raise self._error(f"chunk {index} ({what}) is not valid: {exc}") from None
        return None, doc

    def pieces(self, schema: str):
        """The events of `schema`, in file order, at most PIECE_BYTES at a time."""
        if schema not in self.schemas:
            return
        sid = self._schema_names.index(schema)
        dtype = self.schemas[schema]
        step = (PIECE_BYTES // dtype.itemsize) * dtype.itemsize
        for _, offset, *chunk in self._chunks(self._data_start, self._intact_end):
            if len(chunk) == 1:
                raise self._error("changed while being read")
            kind, chunk_schema, count, length, _ = chunk
            if kind == KIND_EVENTS and chunk_schema == sid:
                for data in self._payload(offset + _CHUNK.size, length, step):
                    yield np.frombuffer(data, dtype)


class _MetaKept:
    """The meta documents a reader keeps, MAX_META_BYTES of them at most. A
    writer rewrites the whole symbol table each time it grows: only the
    latest such table is kept."""

    def __init__(self, reader: RecordingReader):
        self.reader = reader
        self.bytes = 0
        self.symbols = None     # (document, bytes) of the latest symbol table
        self.full = False

    def add(self, doc: dict, length: int):
        if set(doc) == {"symbol_names"} and self.symbols is not None:
            old, old_length = self.symbols
            self.reader.meta = [d for d in self.reader.meta if d is not old]
            self.bytes -= old_length
        if self.bytes + length > MAX_META_BYTES:
            if not self.full:
                self.full = True
                self.reader.warnings.append(
                    f"{self.reader.path}: meta beyond {MAX_META_BYTES >> 20} MiB ignored "
                    "(op and symbol names may be missing)")
            return
        self.reader.meta.append(doc)
        self.bytes += length
        if set(doc) == {"symbol_names"}:
            self.symbols = (doc, length)


@dataclass
class Recording:
    """A whole recording in memory (small files, tests); the same reading
    interface as RecordingReader."""
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

    @property
    def schemas(self) -> dict[str, np.dtype]:
        return {name: records.dtype for name, records in self.events.items()}

    @property
    def counts(self) -> dict[str, int]:
        return {name: len(records) for name, records in self.events.items()}

    @property
    def ts_range(self) -> dict[str, tuple[int, int]]:
        return {name: (int(r["ts_ns"].min()), int(r["ts_ns"].max()))
                for name, r in self.events.items() if len(r)}

    def pieces(self, schema: str):
        records = self.events.get(schema)
        if records is None or not len(records):
            return
        step = max(1, PIECE_BYTES // records.dtype.itemsize)
        for lo in range(0, len(records), step):
            yield records[lo:lo + step]


def read_recording(path) -> Recording:
    """Read a whole recording into memory (see RecordingReader)."""
    with RecordingReader(path) as reader:
        events = {}
        for name, dtype in reader.schemas.items():
            parts = list(reader.pieces(name))
            events[name] = np.concatenate(parts) if parts else np.empty(0, dtype)
        return Recording(reader.path, reader.header, events, reader.meta, reader.footer,
                         reader.warnings, reader.version)
