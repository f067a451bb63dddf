"""The daemon's signals besides SIGINT/SIGTERM's stop flag: handlers only
set flags that the loop takes (SIGHUP: reload, SIGUSR2: write the flight
recorder's ring now), a pipe that wakes the loop when one arrives, and a
stop deadline: once asked to stop, the process ends within
STOP_DEADLINE_S whatever its closing is stuck on."""

import logging
import os
import signal
import sys
import threading

log = logging.getLogger("mmtrace.daemon")

# Under systemd's TimeoutStopSec=30, so the daemon ends on its own terms
# (its log says what was still closing) before systemd's SIGKILL.
STOP_DEADLINE_S = 10.0
EXIT_DEADLINE_PASSED = 1


class SignalFlag:
    """Set by `signum`; the loop takes it."""
    signum: int

    def __init__(self, signum: int | None = None):
        if signum is not None:
            self.signum = signum
        self.pending = False
        self._previous = None

    def install(self):
        self._previous = signal.signal(self.signum, self._on_signal)

    def restore(self):
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame):
        self.pending = True

    def take(self) -> bool:
        pending, self.pending = self.pending, False
        return pending


class SignalWakeup:
    """A pipe the interpreter writes a byte to as each signal arrives
    (signal.set_wakeup_fd): watched beside the rings, it wakes the loop at
    once, where the flags alone waited for its next wake (a quiet daemon
    sleeps 2 s). Only the main thread may install it; elsewhere fd stays
    None and the flags are taken at the next wake, as before."""

    def __init__(self):
        self.fd: int | None = None
        self._write: int | None = None
        self._previous = -1

    def install(self) -> int | None:
        """The descriptor to watch, or None where there is none."""
        if threading.current_thread() is not threading.main_thread():
            return None
        read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            self._previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            os.close(read)
            os.close(write)
            return None
        self.fd, self._write = read, write
        return read

    def drain(self):
        """Empty the pipe (the flags say which signals came)."""
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def restore(self):
        if self.fd is None:
            return
        signal.set_wakeup_fd(self._previous)
        os.close(self.fd)
        os.close(self._write)
        self.fd = self._write = None


class DumpRequest(SignalFlag):
    """SIGUSR2: write the flight recorder's ring now."""
    signum = signal.SIGUSR2


class StopDeadline:
    """Installed over the stop flag's handlers: the first SIGINT/SIGTERM
    also starts a timer, and the process exits with EXIT_DEADLINE_PASSED
    if it is still running `seconds` later (a close stuck on a collector
    or a detach must not outlast the service manager's patience)."""

    def __init__(self, seconds: float = STOP_DEADLINE_S, exit=os._exit):
        self.seconds = seconds
        self._exit = exit
        self.timer: threading.Timer | None = None
        self.signal_name = None

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            signal.signal(sig, self._chain(previous))

    def _chain(self, previous):
        def handler(signum, frame):
            if callable(previous):
                previous(signum, frame)
            self.arm(signal.Signals(signum).name)
        return handler

    def arm(self, why: str):
        if self.timer is not None:
            return
        self.signal_name = why
        self.timer = threading.Timer(self.seconds, self._expire)
        self.timer.daemon = True
        self.timer.name = "mmtrace-stop-deadline"
        self.timer.start()

    def cancel(self):
        if self.timer is not None:
            self.timer.cancel()

    def _expire(self):
        log.error("still stopping %g s after %s; exiting now without finishing "
                  "(the kernel detaches the probes as the process ends)",
                  self.seconds, self.signal_name)
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.flush()
        self._exit(EXIT_DEADLINE_PASSED)
