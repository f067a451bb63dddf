"""A log line that a flood of events cannot turn into a flood of lines."""

import logging
import time


class RateLimitedLog:
    """At most one line per `interval_s`; the next line that gets out says
    how many were held back in between."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, clock=time.monotonic):
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: float | None = None
        self.suppressed = 0

    def log(self, level: int, message: str, *args, exc_info=None) -> bool:
        """Log unless a line went out less than `interval_s` ago; True if logged."""
        now = self.clock()
        if self._last is not None and now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        self._last = now
        if self.suppressed:
            message += f" ({self.suppressed} more like it in the last {self.interval_s:g} s)"
            self.suppressed = 0
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True

    def warning(self, message: str, *args) -> bool:
        return self.log(logging.WARNING, message, *args)
