"""`mmtrace run` as operations meet it, on one real daemon: settings from
MMTRACE_* variables (over the file, under the flags, again at SIGHUP),
journal priorities on its log, the flight recorder written on SIGUSR2 and
by `mmtrace dump`, `run --check` beside it leaving its socket and port
alone, its socket closed to users outside the socket's group (real users,
made for the test), and SIGTERM ending it with status 0 within the stop
deadline."""

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import MMTRACE
from mmtrace.agent.daemon.loop import DUMP_REUSE_S
from mmtrace.agent.recording.file_format import RecordingReader
from mmtrace.agent.daemon.signals import STOP_DEADLINE_S
from mmtrace.exporters.terminal.daemon_client import ask

pytestmark = pytest.mark.bpf

CONFIG = """
tick_s = 0.025
metrics_address = "127.0.0.1:0"
state_dir = "{state}"
"""


class Users:
    """A group and two system users, one in it and one not; removed after."""

    def __init__(self):
        tag = secrets.token_hex(3)
        self.group, self.member, self.outsider = f"mmtg{tag}", f"mmtm{tag}", f"mmto{tag}"
        subprocess.run(["groupadd", "--system", self.group], check=True)
        for name, extra in ((self.member, ["-G", self.group]), (self.outsider, [])):
            subprocess.run(["useradd", "--system", "--no-create-home", "--no-user-group",
                            "--gid", "nogroup", "--shell", "/usr/sbin/nologin", *extra, name],
                           check=True)

    def run_as(self, user, *command, **kwargs) -> subprocess.CompletedProcess:
        """`command` as `user`: its uid, group nogroup, its supplementary groups."""
        return subprocess.run(["setpriv", f"--reuid={user}", "--regid=nogroup",
                               "--init-groups", *map(str, command)],
                              capture_output=True, text=True, timeout=120,
                              env={"PATH": "/usr/bin:/bin", "HOME": "/"}, **kwargs)

    def remove(self):
        for name in (self.member, self.outsider):
            subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", self.group], capture_output=True)


class Daemon:
    def __init__(self, proc, log: Path, config: Path, sock: Path, env: dict):
        self.proc, self.log, self.config, self.sock, self.env = proc, log, config, sock, env

    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, pattern, timeout=90) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.text(), re.M)
            if found:
                return found
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"no {pattern!r}: {self.text()}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def users():
    if shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs useradd and setpriv")
    made = Users()
    try:
        yield made
    finally:
        made.remove()


@pytest.fixture(scope="module")
def daemon(users, tmp_path_factory):
    """The daemon as root, its socket in a set-group-id directory of the
    test group (as /run/mmtrace is the mmtrace group's), its stderr taken
    for the journal's."""
    files = tmp_path_factory.mktemp("ops")
    sockdir = Path(tempfile.mkdtemp(prefix="mmtrace-ops-", dir="/tmp"))
    shutil.chown(sockdir, group=users.group)
    sockdir.chmod(0o2755)       # others may look in: the socket's own mode must keep them out
    config = files / "mmtrace.toml"
    config.write_text(CONFIG.format(state=files / "state"))
    log = files / "daemon.log"
    err = open(log, "w")
    st = os.fstat(err.fileno())
    env = {**os.environ, "MMTRACE_TICK_S": "0.05", "MMTRACE_SOCKET": str(sockdir / "s.sock"),
           "MMTRACE_BOGUS_KEY": "1", "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    proc = subprocess.Popen([sys.executable, "-m", "mmtrace.agent", "run", "--config", config],
                            stdout=subprocess.DEVNULL, stderr=err, env=env)
    running = Daemon(proc, log, config, sockdir / "s.sock", env)
    try:
        running.wait_for("tracing:")
        yield running
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def metrics_address(daemon) -> str:
    return daemon.wait_for(r"metrics on (127\.0\.0\.1:\d+)/metrics").group(1)


def test_the_log_carries_journal_priorities_and_names_unknown_variables(daemon):
    text = daemon.text()
    assert re.search(r"^<6>INFO mmtrace\.daemon: tracing: ", text, re.M), text
    assert re.search(r"^<4>WARNING mmtrace\.daemon: MMTRACE_BOGUS_KEY names no setting; "
                     r"ignored", text, re.M), text
    assert all(line.startswith("<") for line in text.splitlines()), text


def test_sigusr2_writes_the_ring_now(daemon):
    daemon.proc.send_signal(signal.SIGUSR2)
    path = Path(daemon.wait_for(r"flight recording \(SIGUSR2\): (\S+)$").group(1))
    assert path.parent == daemon.config.parent / "state"
    with RecordingReader(path) as rec:
        assert rec.complete
        assert rec.footer["trigger"] == {"kind": "dump", "reason": "SIGUSR2"}
        assert rec.counts["cpu.runq"] > 0           # the host switches all the time
        assert rec.meta[0]["daemon_pid"] == daemon.proc.pid


def test_mmtrace_dump_prints_the_file(daemon):
    result = subprocess.run([str(MMTRACE), "dump", "--socket", daemon.sock],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    with RecordingReader(path) as rec:
        assert rec.footer["trigger"] == {"kind": "dump", "reason": "dump"}
    # Requests within DUMP_REUSE_S share one file: no client can keep the disk busy.
    time.sleep(DUMP_REUSE_S)
    first, second = ask(daemon.sock, "dump", 60), ask(daemon.sock, "dump", 60)
    assert first["path"] == second["path"] != str(path)
    assert first["daemon_pid"] == daemon.proc.pid


def test_the_socket_is_closed_to_users_outside_its_group(daemon, users):
    assert daemon.sock.stat().st_gid == os.stat(daemon.sock.parent).st_gid
    assert oct(daemon.sock.stat().st_mode & 0o777) == "0o660"
    connect = ("import socket, sys; s = socket.socket(socket.AF_UNIX); "
               "s.connect(sys.argv[1]); print('connected')")
    outside = users.run_as(users.outsider, "/usr/bin/python3", "-c", connect, daemon.sock)
    assert outside.returncode != 0 and "PermissionError" in outside.stderr, outside
    refused = users.run_as(users.outsider, MMTRACE, "dump", "--socket", daemon.sock)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"mmtrace: error: cannot connect to {daemon.sock}: "
                                      "permission denied (run as root or as a member of "
                                      "the socket's group)")
    inside = users.run_as(users.member, MMTRACE, "top", "--json", "--socket", daemon.sock)
    assert inside.returncode == 0, inside.stderr
    assert json.loads(inside.stdout)["daemon_pid"] == daemon.proc.pid


def test_check_without_privileges_fails_with_one_line(users):
    result = users.run_as(users.outsider, MMTRACE, "run", "--check",
                          "--metrics-address", "off", "--socket", "/nonexistent/s.sock",
                          "--state-dir", "/nonexistent/state")
    assert result.returncode == 1, result
    assert result.stderr.strip().splitlines() == [
        "mmtrace: error: the daemon cannot start: cpu stream: loading eBPF needs root, or "
        "CAP_BPF with CAP_PERFMON; run it with sudo (mmtrace doctor lists what else is "
        "missing)"]
    assert re.search(r"^  FAIL cpu stream ", result.stdout, re.M), result.stdout


def test_check_beside_the_daemon_leaves_its_socket_and_port_alone(daemon, tmp_path):
    address = metrics_address(daemon)
    inode = daemon.sock.stat().st_ino
    # The flag goes over the variable: the check looks at the daemon's socket.
    env = {**daemon.env, "MMTRACE_SOCKET": str(tmp_path / "elsewhere.sock")}
    env.pop("JOURNAL_STREAM")
    result = subprocess.run([str(MMTRACE), "run", "--check", "--config", daemon.config,
                             "--socket", daemon.sock, "--metrics-address", address],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "mmtrace run --check:" and lines[-1] == "the daemon can start"
    assert f"  ok   configuration  config {daemon.config} with MMTRACE_SOCKET, " \
           "MMTRACE_TICK_S" in lines
    assert f"  ok   hint socket    {daemon.sock}: held by the running daemon (pid " \
           f"{daemon.proc.pid}); not touched" in lines
    assert f"  ok   metrics        {address}: served by a running mmtrace daemon; " \
           "not touched" in lines
    assert any(re.fullmatch(r"  ok   cpu stream     scheduler tracepoints attached; "
                            r"[\d,]+ run-queue events in the first .*", line) for line in lines)
    assert any(line.startswith("  --   environment    MMTRACE_BOGUS_KEY names no setting; "
                               "ignored") for line in lines), lines
    assert daemon.sock.stat().st_ino == inode and not (tmp_path / "elsewhere.sock").exists()
    assert ask(daemon.sock, "status")["daemon_pid"] == daemon.proc.pid


def test_check_names_a_port_another_program_holds(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run([str(MMTRACE), "run", "--check", "--metrics-address", address,
                                 "--socket", tmp_path / "s.sock", "--state-dir", tmp_path],
                                capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"mmtrace: error: the daemon cannot start: metrics: metrics address {address}: "
        "cannot listen (the port is taken)"]
    assert f"  ok   hint socket    {tmp_path / 's.sock'}: can listen (nothing runs there " \
           "now)" in result.stdout.splitlines()
    assert not (tmp_path / "s.sock").exists()


def test_check_creates_nothing(tmp_path):
    """Folders the daemon would create are checked, not made."""
    sock, state = tmp_path / "run" / "mmtrace" / "s.sock", tmp_path / "lib" / "mmtrace"
    result = subprocess.run([str(MMTRACE), "run", "--check", "--metrics-address", "off",
                             "--socket", sock, "--state-dir", state],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert f"  ok   hint socket    {sock}: the daemon creates {sock.parent} and listens " \
           "there" in lines, lines
    assert f"  ok   state dir      {state}: the daemon creates it; flight recordings can " \
           "be written there" in lines, lines
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_sighup_reads_the_environment_again_over_the_file(daemon):
    text = CONFIG.format(state=daemon.config.parent / "state")
    daemon.config.write_text(text.replace("tick_s = 0.025", "tick_s = 0.1")
                             + "flight_min_interval_s = 5.0\n")
    daemon.proc.send_signal(signal.SIGHUP)
    # MMTRACE_TICK_S still holds tick_s: only the file's other change applies.
    line = daemon.wait_for(r"^<6>INFO mmtrace\.daemon: reload: applied .*$").group(0)
    assert line == "<6>INFO mmtrace.daemon: reload: applied flight_min_interval_s"
    assert len(re.findall("MMTRACE_BOGUS_KEY names no setting", daemon.text())) == 2


def test_sigterm_ends_it_cleanly_within_the_deadline(daemon):
    sent = time.monotonic()
    daemon.proc.send_signal(signal.SIGTERM)
    rc = daemon.proc.wait(timeout=STOP_DEADLINE_S + 30)
    took = time.monotonic() - sent
    print(f"SIGTERM to exit: {took:.3f} s (deadline {STOP_DEADLINE_S:g} s)")
    assert rc == 0, daemon.text()
    assert took < STOP_DEADLINE_S, took
    assert "stopped by SIGTERM" in daemon.text()
    assert not daemon.sock.exists()             # the socket is gone with the daemon
