"""Flight recorder: when an anomaly fires, the recent past (the rings) goes
to a recording file in the state directory, at most once per interval; on
request (`mmtrace dump`, SIGUSR2) it goes there at once."""

import logging
import os
import re
import stat
import time
from pathlib import Path

import numpy as np

from mmtrace.agent.ingest.record_arrays import stamped_from
from mmtrace.agent.recording.file_format import RecordingWriter
from mmtrace.agent.safe_files import private_dir

log = logging.getLogger(__name__)
STATE_DIR_MODE = 0o700
MAX_NAME_TRIES = 100


class FlightRecorder:
    def __init__(self, state_dir: Path, seconds: float = 30.0, min_interval_s: float = 60.0,
                 keep: int = 50, clock=time.monotonic):
        self.state_dir = Path(state_dir)
        self.seconds = seconds
        self.min_interval_s = min_interval_s
        self.keep = keep
        self.clock = clock
        self._last = None
        self.written = 0
        self.suppressed = 0
        self.failed = 0
        self.last_error = ""

    def dump(self, windows: dict, schemas: dict, anomaly: dict, meta: list[dict],
             now_ns: int) -> Path | None:
        """Write `windows` ({schema: records, or an iterable of record
        pieces}) trimmed to the last `seconds`
        for a firing anomaly; returns the file, or None when rate-limited or
        the write failed."""
        now = self.clock()
        if self._last is not None and now - self._last < self.min_interval_s:
            self.suppressed += 1
            return None
        self._last = now
        label = str(anomaly.get("series", anomaly.get("kind", "anomaly")))
        return self._write(windows, schemas, {"anomaly": anomaly}, label, meta, now_ns)

    def dump_now(self, windows: dict, schemas: dict, meta: list[dict], *, reason: str,
                 now_ns: int) -> Path:
        """The same write on request (`mmtrace dump`, SIGUSR2), past the
        interval; the file's header and footer say `trigger`
        {"kind": "dump", "reason": reason} instead of an anomaly. OSError
        when it cannot be written."""
        trigger = {"trigger": {"kind": "dump", "reason": reason}}
        path = self._write(windows, schemas, trigger, f"dump-{reason}", meta, now_ns)
        if path is None:
            raise OSError(self.last_error)
        return path

    def _write(self, windows: dict, schemas: dict, why: dict, label: str, meta: list[dict],
               now_ns: int) -> Path | None:
        since = now_ns - int(self.seconds * 1e9)
        label = re.sub(r"[^A-Za-z0-9_.=-]+", "_", label)
        # Local time with its offset from UTC: names sort, and say when.
        stem = f"flight-{time.strftime('%Y%m%dT%H%M%S%z')}-{label[:60]}"
        path = self.state_dir / f"{stem}.mmtr"
        try:
            private_dir(self.state_dir, STATE_DIR_MODE)
            path, writer = self._new_file(stem, {"flight_recorder": True, **why}, schemas)
            try:
                for m in meta:
                    writer.write_meta(m)
                for schema, records in windows.items():
                    # An array, or an iterable of pieces written one by one.
                    for piece in [records] if isinstance(records, np.ndarray) else records:
                        recent = stamped_from(piece, since)
                        if len(recent):
                            writer.write_events(schema, recent)
            finally:
                writer.close({**why, "window_s": self.seconds, "end_monotonic_ns": now_ns})
        except OSError as exc:
            self.failed += 1
            self.last_error = f"cannot write {path}: {exc.strerror or exc}"
            log.error("flight recorder: %s", self.last_error)
            return None
        self.written += 1
        self._prune()
        return path

    def prepare(self):
        """The state directory made, or checked, as the recordings need it:
        UnsafePathError where another user owns it or can write into it."""
        private_dir(self.state_dir, STATE_DIR_MODE)

    def _new_file(self, stem: str, info: dict, schemas: dict) -> tuple[Path, RecordingWriter]:
        """A recording under a name not taken yet, created exclusively: two
        writes within a second keep both, and a name planted beforehand (a
        link, a FIFO) is passed over, never written through."""
        for n in range(1, MAX_NAME_TRIES + 1):
            path = self.state_dir / (f"{stem}.mmtr" if n == 1 else f"{stem}-{n}.mmtr")
            try:
                return path, RecordingWriter(path, schemas, info=info, exclusive=True)
            except FileExistsError:
                continue
        raise FileExistsError(f"{MAX_NAME_TRIES} names like {stem}.mmtr are taken")

    def recordings(self) -> list[Path]:
        """The flight recordings held, oldest first: regular files only; a
        link, a directory, a FIFO or a file gone meanwhile is passed over."""
        found = []
        try:
            with os.scandir(self.state_dir) as entries:
                for entry in entries:
                    if not (entry.name.startswith("flight-") and entry.name.endswith(".mmtr")):
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime_ns, entry.name))
        except OSError as exc:
            log.warning("flight recorder: cannot list %s: %s", self.state_dir, exc.strerror)
        return [self.state_dir / name for _, name in sorted(found)]

    def _prune(self):
        """Keep the newest `keep` flight recordings; an incident storm must not
        fill the disk."""
        for old in self.recordings()[:-self.keep]:
            try:
                old.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("flight recorder: cannot remove %s: %s", old, exc.strerror)
