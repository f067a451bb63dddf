"""Errors that end a command with one clear line and exit status 2."""


class MmtraceError(Exception):
    """Bad input or an environment that cannot run the command. A plain
    exception, so that the library raising it needs no CLI: the CLI prints
    `mmtrace: error: <message>` and exits 2 (agent/cli.py)."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
