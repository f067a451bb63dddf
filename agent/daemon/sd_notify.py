"""systemd's notification protocol (sd_notify(3)), without libsystemd:
readiness, status lines, watchdog pings and stopping, as datagrams to
$NOTIFY_SOCKET. Where the variable is unset (not under a Type=notify
unit) every call does nothing."""

import os
import socket
import time


class Notifier:
    def __init__(self, env=os.environ, clock=time.monotonic):
        self.path = env.get("NOTIFY_SOCKET") or None
        if self.path and self.path.startswith("@"):
            self.path = "\0" + self.path[1:]            # abstract namespace
        self.clock = clock
        # The watchdog is ours when WATCHDOG_USEC is set for this very pid.
        usec = env.get("WATCHDOG_USEC", "")
        owner = env.get("WATCHDOG_PID", str(os.getpid()))
        self.watchdog_s = int(usec) / 1e6 if (usec.isascii() and usec.isdigit()
                                              and owner == str(os.getpid())) \
            else None
        self._next_ping = 0.0
        self.sent = 0

    def notify(self, *lines: str) -> bool:
        """Send `KEY=value` lines; False where there is no socket or it failed
        (systemd gone: the daemon goes on)."""
        if not self.path:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(lines).encode(), self.path)
        except OSError:
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> bool:
        return self.notify("READY=1", f"STATUS={status}")

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def watchdog(self) -> bool:
        """A ping when half the watchdog interval has passed since the last;
        call it from the loop that must prove it is alive."""
        if self.watchdog_s is None:
            return False
        now = self.clock()
        if now < self._next_ping:
            return False
        self._next_ping = now + self.watchdog_s / 2
        return self.notify("WATCHDOG=1")
