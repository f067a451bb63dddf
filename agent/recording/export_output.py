"""Where an export goes: a temporary file beside the output, renamed into
place only when everything was written (a failed export leaves nothing
behind and an existing file as it was), never the input itself, or
standard output, where a reader that goes away (`| head`) is not an error."""

import errno
import os
import stat
import sys
from pathlib import Path

from mmtrace.agent.safe_files import DirFile, UnsafePathError, refuse_link, stream_in_place

BUFFER_BYTES = 1 << 20


class OutputError(Exception):
    """The output cannot be written."""


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class ExportOutput:
    """`with ExportOutput(path, source=input_path) as out: out.stream.write(...)`;
    path "-" is standard output. The path is never resolved: a symbolic
    link named as the output is refused (root must not write through a
    link a user planted in /tmp), and the temporary file is created and
    renamed relative to the output's directory (agent/safe_files.py)."""

    def __init__(self, output: str, source):
        self.output = output
        self.source = Path(source)
        self.stream = None
        self._file: DirFile | None = None

    def __enter__(self):
        if self.output == "-":
            sys.stdout.flush()
            self.stream = sys.stdout.buffer
            return self
        final = Path(self.output)
        try:
            existing = os.lstat(final)
            # A pipe or a device (/dev/null, /dev/stdout, >(gzip)): written
            # in place, nothing created or replaced (safe_files says whose).
            fd = stream_in_place(final) if existing is not None else None
        except FileNotFoundError:
            existing = fd = None
        except UnsafePathError as exc:
            raise OutputError(f"cannot write {exc}") from None
        except OSError as exc:
            raise OutputError(f"cannot write {self.output}: {exc.strerror}") from None
        if fd is not None:
            self.stream = os.fdopen(fd, "wb", buffering=BUFFER_BYTES)
            return self
        try:
            refuse_link(final, existing)
        except UnsafePathError as exc:
            raise OutputError(f"cannot write {exc}") from None
        if existing is not None and _same_file(existing, os.stat(self.source)):
            raise OutputError(f"{self.output} is the input recording {self.source}; "
                              "refusing to overwrite it")
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise OutputError(f"cannot write {self.output}: it is a directory")
        if existing is not None and not stat.S_ISREG(existing.st_mode):
            raise OutputError(f"cannot write {self.output}: expected a regular file, a pipe "
                              "or a device, got a socket or another special file")
        try:
            # a file replaced keeps its permissions; a new one takes the umask's
            self._file = DirFile(final, stat.S_IMODE(existing.st_mode) if existing else None)
        except OSError as exc:
            raise OutputError(f"cannot write {self.output}: {exc.strerror or exc}") from None
        self.stream = os.fdopen(self._file.fd, "wb", buffering=BUFFER_BYTES)
        return self

    def __exit__(self, kind, exc, tb):
        if self.output == "-":
            return self._exit_stdout(exc)
        failure = exc
        try:
            self.stream.close()
        except OSError as close_exc:
            failure = failure or close_exc
        if self._file is not None:
            try:
                if failure is None:
                    self._file.commit()
            except OSError as rename_exc:
                failure = rename_exc
            finally:
                try:
                    self._file.close()
                except OSError as close_exc:    # the temporary file could not be removed
                    failure = failure or close_exc
        if isinstance(failure, OSError):
            raise OutputError(f"cannot write {self.output}: "
                              f"{failure.strerror or failure}") from None
        return False

    def _exit_stdout(self, exc):
        failure = exc
        if failure is None:
            try:
                self.stream.flush()
            except OSError as flush_exc:
                failure = flush_exc
        if not isinstance(failure, OSError):
            return False
        _quiet_stdout()
        if isinstance(failure, BrokenPipeError) or failure.errno == errno.EPIPE:
            return True     # the reader went away (`| head`): not an error
        raise OutputError(f"cannot write standard output: {failure.strerror or failure}") from None


def _quiet_stdout():
    """Point standard output at /dev/null, so that the interpreter's own
    flush at exit does not fail again on what is left in the buffer."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass    # not a real descriptor (a test runner's capture)
