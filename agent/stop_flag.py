"""The stop flag of `record` and `run`: set by SIGINT / SIGTERM, read by
their loops, which finish what they write and exit 0."""

import signal


class StopFlag:
    """Set by SIGINT / SIGTERM; the loop finishes the file and exits 0."""

    def __init__(self):
        self.reason = None
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        self.reason = signal.Signals(signum).name

    def __bool__(self):
        return self.reason is not None
