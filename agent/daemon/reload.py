"""SIGHUP: read the configuration again without losing state. What can
change on a running daemon changes at once; what sizes memory, opens
sockets or shapes the detectors' windows is reported as waiting for a
restart. A configuration that does not load leaves the running one as it
was, and the error is logged."""

import logging
import signal
from dataclasses import fields

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.daemon.signals import SignalFlag

log = logging.getLogger("mmtrace.daemon")

# Top-level keys the daemon reads afresh (its loop, the flight recorder,
# the launch bursts), and sections applied whole.
LIVE_KEYS = {"tick_s", "flight_min_interval_s", "launch_burst_s"}
LIVE_SECTIONS = {"policy"}


class ReloadRequest(SignalFlag):
    """Set by SIGHUP; the loop takes it (signal handlers only set flags)."""
    signum = signal.SIGHUP


def changes(old: DaemonConfig, new: DaemonConfig) -> tuple[list[str], list[str]]:
    """(keys applied live, keys that wait for a restart) that differ."""
    live, later = [], []
    for f in fields(DaemonConfig):
        if getattr(old, f.name) == getattr(new, f.name):
            continue
        (live if f.name in LIVE_KEYS | LIVE_SECTIONS else later).append(f.name)
    return live, later


def reload(daemon, load) -> bool:
    """Load the configuration with `load()` and apply what can be applied
    to `daemon`; False (and the old configuration kept) when it fails."""
    try:
        new = load()
    except MmtraceError as exc:
        log.error("reload: %s; the running configuration stays", exc.message)
        return False
    old = daemon.config
    live, later = changes(old, new)
    for key in live:
        setattr(old, key, getattr(new, key))
    if "policy" in live:
        daemon.steering.policy.settings = old.policy
    daemon.flight.min_interval_s = old.flight_min_interval_s
    log.info("reload: applied %s%s", ", ".join(live) or "nothing new",
             f"; {', '.join(later)} take effect at restart" if later else "")
    return True
