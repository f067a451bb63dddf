"""The programs signal their ring every so many records, whether or not the
drains kept up: a signal drains at once only a ring SIGNAL_DRAIN_FILL
full, in the daemon's loop and in `record`'s; below that, their timed
drain is soon enough. No eBPF: a pipe stands for the ring's descriptor."""

import os
import threading
import time
from types import SimpleNamespace

import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.daemon.loop import Daemon
from mmtrace.agent.ingest.wakeups import SIGNAL_DRAIN_FILL, Waiter
from mmtrace.agent.recording import recorder

WAIT_S = 0.3
FILLS = (SIGNAL_DRAIN_FILL / 4, SIGNAL_DRAIN_FILL)


@pytest.fixture
def ring():
    """A ring whose descriptor is a pipe: a signal is a byte written to an
    empty pipe (an edge on every kernel), read back by `settle`."""
    r, w = os.pipe()
    ring = SimpleNamespace(fill=0.0, filenos=lambda: (r,), filled=lambda: ring.fill,
                           signal=lambda: os.write(w, b"x"), settle=lambda: os.read(r, 1))
    yield ring
    os.close(r)
    os.close(w)


@pytest.mark.parametrize("signal_after_s", [0.0, 0.1])     # within tick_s of the wake, and past it
def test_the_daemon_drains_at_a_signal_only_a_ring_filling_up(tmp_path, ring, signal_after_s):
    daemon = Daemon(config_mod.DaemonConfig(state_dir=tmp_path / "state",
                                            socket=tmp_path / "s.sock"))
    daemon.probes.loaded = SimpleNamespace(rings=[ring])
    drains = []
    daemon.drain_rings = lambda: drains.append(ring.fill)
    daemon.idle_wait_s = lambda watchdog_s=None: WAIT_S
    try:
        for fill in FILLS:
            ring.fill = fill
            daemon._ticked_at = time.monotonic()
            signal = threading.Timer(signal_after_s, ring.signal)
            began = time.monotonic()
            signal.start()
            daemon._sleep(None)
            signal.join()
            if fill < SIGNAL_DRAIN_FILL:        # waited for the tick's drain
                assert drains == [] and time.monotonic() - began >= WAIT_S - 0.05
            else:
                assert drains == [fill]
            ring.settle()
    finally:
        daemon.waiter.close()


def test_record_drains_at_a_signal_only_a_ring_filling_up(ring, monkeypatch):
    monkeypatch.setattr(recorder, "IDLE_WAIT_S", 60.0)
    recording = SimpleNamespace(loaded=SimpleNamespace(rings=[ring]), telemetry=None,
                                compiling=None)
    waiter = Waiter()
    try:
        for fill, wait_s in zip(FILLS, (WAIT_S, 60.0)):
            ring.fill = fill
            ring.signal()
            began = time.monotonic()
            recorder._Recording._wait(recording, waiter, 0.025, time.monotonic() + wait_s)
            took = time.monotonic() - began
            ring.settle()
            if fill < SIGNAL_DRAIN_FILL:        # its timed drain, at the deadline
                assert took >= WAIT_S - 0.05
            else:                               # at once, not a minute later
                assert took < 30
    finally:
        waiter.close()
