"""systemd's notification protocol against a NOTIFY_SOCKET listener:
readiness once tracing runs, watchdog pings from the daemon's loop, and
STOPPING=1 on SIGTERM with exit 0."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from mmtrace.agent.daemon.sd_notify import Notifier


@pytest.fixture
def listener(tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    yield sock, str(tmp_path / "notify")
    sock.close()


def received(sock, seconds):
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            out.append(sock.recv(4096).decode())
        except socket.timeout:
            pass
    return out


def test_ready_status_and_stopping(listener):
    sock, path = listener
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.ready("tracing") and n.status("busy") and n.stopping()
    assert received(sock, 0.3) == ["READY=1\nSTATUS=tracing", "STATUS=busy", "STOPPING=1"]


def test_watchdog_pings_at_half_the_interval_for_its_own_pid(listener):
    sock, path = listener
    now = [100.0]
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000",
                  "WATCHDOG_PID": str(os.getpid())}, clock=lambda: now[0])
    pings = []
    for _ in range(40):                          # 4 s in steps of 0.1 s
        pings.append(n.watchdog())
        now[0] += 0.1
    assert sum(pings) == 4 and pings[0]          # at 0, 1, 2, 3 s
    other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_s is None and not other.watchdog()


def test_abstract_socket_and_no_socket():
    name = f"mmtrace-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(1)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).ready("x")
        assert sock.recv(100) == b"READY=1\nSTATUS=x"
    assert not Notifier({}).ready("x")
    assert not Notifier({"NOTIFY_SOCKET": "/nonexistent/sock"}).ready("x")   # systemd gone


@pytest.mark.bpf
def test_the_daemon_reports_ready_pings_the_watchdog_and_stops_cleanly(listener, tmp_path):
    sock, path = listener
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "run", "--state-dir",
                             tmp_path / "state", "--socket", tmp_path / "hint.sock",
                             "--metrics-address", "off"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, got = time.monotonic() + 90, []
        while not any(m.startswith("READY=1") for m in got) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            got += received(sock, 0.5)
        assert any(m.startswith("READY=1\nSTATUS=tracing") for m in got), got
        pings = [m for m in received(sock, 2.0) if m == "WATCHDOG=1"]
        assert 6 <= len(pings) <= 12, pings           # every 0.2 s
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert "STOPPING=1" in received(sock, 0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
