"""Errors that end a command with one clear line and exit status 2."""

import errno
import resource


class MmtraceError(Exception):
    """Bad input or an environment that cannot run the command. A plain
    exception, so that the library raising it needs no CLI: the CLI prints
    `mmtrace: error: <message>` and exits 2 (agent/cli.py)."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def os_failure(what: str, exc: OSError) -> MmtraceError:
    """An OSError said as one line: what could not be done, why, and for
    running out of descriptors, the limit to raise."""
    said = f"{what}: {exc.strerror or exc}"
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        said += (f" (this process may hold {soft} open descriptors, RLIMIT_NOFILE: raise it, "
                 f"with `ulimit -n` or the unit's LimitNOFILE=)")
    return MmtraceError(said)
