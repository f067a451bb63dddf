"""The daemon's log lines on stderr. Where stderr is the journal (systemd
sets JOURNAL_STREAM to its device:inode), each line starts with the
syslog priority as `<N>` (sd-daemon(3)), so `journalctl -p warning` can
filter, and the journal's own timestamps replace ours. Elsewhere lines
keep their time and level in plain text."""

import logging
import os
import sys

PLAIN = "%(asctime)s %(levelname)s %(name)s: %(message)s"
JOURNAL = "%(levelname)s %(name)s: %(message)s"


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (LOG_CRIT .. LOG_DEBUG)."""
    if levelno >= logging.CRITICAL:
        return 2
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


class JournalFormatter(logging.Formatter):
    """Every line of a record (a traceback's too) with the record's `<N>`:
    the journal reads each line as an entry of its own."""

    def __init__(self):
        super().__init__(JOURNAL)

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{priority(record.levelno)}>"
        return prefix + super().format(record).replace("\n", "\n" + prefix)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()      # int() refuses "²", which isdigit() takes


def stream_is_journal(stream, environ=os.environ) -> bool:
    """True when `stream` is the journal's: JOURNAL_STREAM names its device and inode."""
    dev, sep, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not _digits(dev) or not _digits(inode):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(inode))


def configure(level: str, stream=None, environ=os.environ) -> logging.Handler:
    """Log records at `level` and above to `stream` (stderr), in the
    journal's format where it is the journal. Called again, it replaces
    the handler it added before."""
    stream = stream or sys.stderr
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JournalFormatter() if stream_is_journal(stream, environ)
                         else logging.Formatter(PLAIN))
    handler.mmtrace = True
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "mmtrace", False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler
