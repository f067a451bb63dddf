"""Where the drain loops sleep (the daemon's and `record`'s): on the
descriptors that bring them work (the ring buffers, the hint socket), with
a deadline for what runs on time (detector windows, the watchdog,
discovery, record's drain timer). An idle host costs a few wake-ups a
second instead of a poll every tick; a busy one wakes the loop once per
batch, as the eBPF programs signal it (bpf/common.h)."""

import select
import time

# The programs signal their ring every so many records, whether or not the
# drains kept up. A signal drains at once a ring written this full and not
# yet read; below, the loop's next timed drain comes soon enough (at the
# rated 20 000 run-queue events a second, a quarter second's worth is 4 %
# of the 8 MiB ring), and a drain less is a batch less to every sink.
SIGNAL_DRAIN_FILL = 1 / 16


def rings_filling(rings) -> bool:
    """A ring of `rings` (StreamRing) at least SIGNAL_DRAIN_FILL full."""
    return any(ring.filled() >= SIGNAL_DRAIN_FILL for ring in rings)


class Waiter:
    def __init__(self, clock=time.monotonic):
        self._epoll_fd: select.epoll | None = None     # opened on first use, again after close
        self._fds: set[int] = set()
        self.clock = clock
        self.wakeups = 0            # returns from wait(), data or deadline
        self.data_wakeups = 0       # ... of which a descriptor was ready
        self.ready: list[int] = []  # the descriptors the last wait() found ready

    def watch(self, fd: int, edge: bool = False):
        """Wake on `fd` becoming readable. `edge`: only when its producer
        signals (a ring buffer is readable whenever it holds a record;
        its programs signal once per batch)."""
        if fd in self._fds:
            return
        self._epoll().register(fd, select.EPOLLIN | (select.EPOLLET if edge else 0))
        self._fds.add(fd)

    def watch_rings(self, rings) -> set[int]:
        """Wake on each of `rings` (StreamRing) when its programs signal;
        their descriptors (to tell a ring's wake from the others')."""
        fds = {fd for ring in rings for fd in ring.filenos()}
        for fd in fds:
            self.watch(fd, edge=True)
        return fds

    def forget(self, fd: int):
        if fd in self._fds:
            self._fds.discard(fd)
            try:
                self._epoll().unregister(fd)
            except OSError:         # closed already: the kernel dropped it
                pass

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a watched descriptor is ready or `timeout_s` has
        passed; True when woken by one."""
        ready = self._epoll().poll(max(0.0, timeout_s))
        self.wakeups += 1
        if ready:
            self.data_wakeups += 1
        self.ready = [fd for fd, _ in ready]
        return bool(ready)

    def _epoll(self) -> select.epoll:
        if self._epoll_fd is None:
            self._epoll_fd = select.epoll()
        return self._epoll_fd

    def close(self):
        if self._epoll_fd is not None:
            self._epoll_fd.close()
            self._epoll_fd = None
        self._fds.clear()
