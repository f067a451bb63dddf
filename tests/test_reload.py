"""SIGHUP reloads the configuration without losing state: live keys change
at once, the rest wait for a restart, and a broken file changes nothing."""

import logging
import signal
import subprocess
import sys
import time

import pytest

from mmtrace.agent.config import settings as config_mod
from mmtrace.agent.daemon import reload as reload_mod
from mmtrace.agent.daemon.loop import Daemon


def daemon_from(path):
    cfg = config_mod.load_config(path)
    return Daemon(cfg)


def write(path, text):
    path.write_text(f'state_dir = "{path.parent / "state"}"\n'
                    f'socket = "{path.parent / "s.sock"}"\n' + text)


def test_live_keys_change_and_the_rest_wait_for_a_restart(tmp_path, caplog):
    path = tmp_path / "mmtrace.toml"
    write(path, "tick_s = 0.025\n")
    daemon = daemon_from(path)
    daemon.p99.series_id("runq_delay{pid=7}")                    # state that must survive
    ring = daemon.streams.runq_ring
    write(path, "tick_s = 0.05\nflight_min_interval_s = 5.0\nring_capacity = 4096\n"
                "[policy]\ndry_run = true\nttl_s = 9.0\n")
    with caplog.at_level(logging.INFO, "mmtrace.daemon"):
        assert reload_mod.reload(daemon, lambda: config_mod.load_config(path))
    assert daemon.config.tick_s == 0.05 and daemon.flight.min_interval_s == 5.0
    assert daemon.steering.policy.settings.dry_run and daemon.steering.dry_run
    assert daemon.steering.policy.settings.ttl_s == 9.0
    assert daemon.config.ring_capacity == 1 << 20 and daemon.streams.runq_ring is ring   # at restart
    assert "runq_delay{pid=7}" in daemon.p99.names
    assert "ring_capacity take effect at restart" in caplog.text
    daemon.close()


def test_a_broken_file_keeps_the_running_configuration(tmp_path, caplog):
    path = tmp_path / "mmtrace.toml"
    write(path, "tick_s = 0.025\n")
    daemon = daemon_from(path)
    before = config_mod.check(daemon.config)
    path.write_text("tick_s = 'soon'\n[p99]\nwindow_s = -1\n")
    with caplog.at_level(logging.ERROR, "mmtrace.daemon"):
        assert not reload_mod.reload(daemon, lambda: config_mod.load_config(path))
    assert daemon.config == before
    assert "2 bad settings" in caplog.text and "the running configuration stays" in caplog.text
    daemon.close()


@pytest.mark.bpf
def test_sighup_on_the_running_daemon(tmp_path):
    path = tmp_path / "mmtrace.toml"
    write(path, "metrics_address = \"off\"\n")
    log = tmp_path / "daemon.log"
    proc = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "run", "--config", path],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))

    def wait_for(text, timeout=90):
        deadline = time.monotonic() + timeout
        while text not in log.read_text():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)

    try:
        wait_for("tracing:")
        path.write_text("this is not TOML = = =\n")
        proc.send_signal(signal.SIGHUP)
        wait_for("the running configuration stays")
        write(path, "metrics_address = \"off\"\ntick_s = 0.05\n")
        proc.send_signal(signal.SIGHUP)
        wait_for("reload: applied tick_s")
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
