"""A load that fails (no tracefs, no privileges, a compile error) ends the
command with its error while the first discovery scan may still run in
its thread: the scan is waited for, since a process that exits while
that thread is inside numpy's C++ code aborts ("terminate called without
an active exception", exit -6) instead of exiting 2 with its one line."""

import threading
import time

import pytest

from mmtrace.agent.config.settings import DaemonConfig
from mmtrace.agent.daemon.live_probes import LiveProbes
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.kernel import device_sources
from mmtrace.agent.kernel import probes as probe_loader
from mmtrace.agent.recording import recorder


@pytest.fixture
def failing_load(monkeypatch):
    """load_cpu refuses, while the first scan takes half a second."""
    def refuse(*args, **kwargs):
        raise MmtraceError("tracefs is not readable here")
    monkeypatch.setattr(probe_loader, "load_cpu", refuse)
    monkeypatch.setattr(device_sources.DeviceSources, "_first_scan",
                        lambda self: time.sleep(0.5))


def scans_running() -> list:
    return [t for t in threading.enumerate() if t.name == "mmtrace-discovery" and t.is_alive()]


def test_record_waits_for_the_scan_when_its_load_fails(tmp_path, failing_load):
    before = scans_running()
    with pytest.raises(MmtraceError, match="tracefs"):
        recorder.record(tmp_path / "x.mmtr", 1.0)
    assert [t for t in scans_running() if t not in before] == []


def test_the_daemon_waits_for_the_scan_when_its_load_fails(tmp_path, failing_load):
    probes = LiveProbes(DaemonConfig(state_dir=tmp_path / "state", socket=tmp_path / "s.sock"))
    before = scans_running()
    with pytest.raises(MmtraceError, match="tracefs"):
        probes.start(None, None)
    assert [t for t in scans_running() if t not in before] == []
