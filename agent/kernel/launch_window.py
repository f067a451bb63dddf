"""A bounded time with the per-launch probes on: a timer thread ends it,
whatever the owner is doing."""

import threading
import time
from typing import Callable


class LaunchWindow:
    """At most one window at a time; `end` is time.monotonic() at which the
    open one ends, else None."""

    def __init__(self, on_end: Callable[[], None]):
        self.on_end = on_end
        self.end: float | None = None
        self._timer: threading.Timer | None = None

    def open(self, duration_s: float):
        """Call on_end in `duration_s` seconds (from a timer thread)."""
        self.cancel()
        self.end = time.monotonic() + duration_s
        self._timer = threading.Timer(duration_s, self.on_end)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.end = None
