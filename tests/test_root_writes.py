"""What root writes, attacked by a local user the test creates: links
planted in a sticky world-writable directory (fs.protected_symlinks off,
as on this host), a state directory the user owns or can write into,
predictable flight-recording names taken beforehand, and odd entries in
the state directory. The victim is a root-only file: never changed, and
a target the link names never created. What root creates outside systemd
is not readable by that user, whatever the umask."""

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from mmtrace.agent.recording.flight import FlightRecorder
from mmtrace.agent.safe_files import UnsafePathError, private_dir
from test_recording import write_sample

MMTRACE = Path(sys.executable).parent / "mmtrace"
SCHEMA = np.dtype([("ts_ns", "<u8"), ("value", "<f8")])


class Attacker:
    """A system user with no rights of its own, removed after."""

    def __init__(self):
        self.name = f"mmta{secrets.token_hex(3)}"
        subprocess.run(["useradd", "--system", "--no-create-home", "--no-user-group", "--gid",
                        "nogroup", "--shell", "/usr/sbin/nologin", self.name], check=True)

    def run(self, *command) -> subprocess.CompletedProcess:
        return subprocess.run(["setpriv", f"--reuid={self.name}", "--regid=nogroup",
                               "--clear-groups", *map(str, command)], capture_output=True,
                              text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/"})


@pytest.fixture(scope="module")
def attacker():
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        pytest.skip("needs root, useradd and setpriv")
    user = Attacker()
    yield user
    subprocess.run(["userdel", user.name], capture_output=True)


@pytest.fixture
def sticky_tmp():
    """A world-writable sticky directory, as /tmp is."""
    path = Path(tempfile.mkdtemp(prefix="mmtrace-sticky-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "root-only"
    path.write_text("root's own\n")
    path.chmod(0o600)
    return path


def plant_link(attacker, link: Path, target: Path):
    planted = attacker.run("ln", "-s", target, link)
    assert planted.returncode == 0, planted.stderr
    assert link.is_symlink() and link.lstat().st_uid != 0


def one_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmtrace: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("dangling", [False, True])
def test_export_never_writes_through_a_users_link(attacker, sticky_tmp, victim, tmp_path,
                                                  dangling):
    rec = write_sample(tmp_path / "r.mmtr")
    target = tmp_path / "created-by-root" if dangling else victim
    link = sticky_tmp / "trace.json"
    plant_link(attacker, link, target)
    for fmt in ("jsonl", "chrome", "perfetto"):
        result = subprocess.run([MMTRACE, "export", rec, "--format", fmt, "-o", link],
                                capture_output=True, text=True, timeout=120)
        assert "is a symbolic link" in one_line(result)
    assert victim.read_text() == "root's own\n" and victim.stat().st_mode & 0o777 == 0o600
    assert not (tmp_path / "created-by-root").exists()
    assert sorted(p.name for p in sticky_tmp.iterdir()) == ["trace.json"]


def test_a_state_directory_another_user_owns_or_can_write_is_refused_at_start(attacker,
                                                                             sticky_tmp):
    owned = sticky_tmp / "mmtrace"
    assert attacker.run("mkdir", "-m", "0755", owned).returncode == 0
    result = subprocess.run([MMTRACE, "run", "--state-dir", owned, "--metrics-address", "off",
                             "--socket", sticky_tmp / "s.sock"], capture_output=True,
                            text=True, timeout=120)
    assert f"{owned}: owned by uid " in one_line(result)
    writable = sticky_tmp / "open"
    writable.mkdir()
    writable.chmod(0o777)
    result = subprocess.run([MMTRACE, "run", "--state-dir", writable, "--metrics-address",
                             "off", "--socket", sticky_tmp / "s.sock"], capture_output=True,
                            text=True, timeout=120)
    assert "lets other users write into it" in one_line(result)
    assert sorted(p.name for p in owned.iterdir()) == [] and not (sticky_tmp / "s.sock").exists()


def windows(now_ns):
    return {"x": np.array([(now_ns - 1000, 1.0)], dtype=SCHEMA)}


def test_export_never_streams_into_another_users_pipe_or_a_device_behind_a_link(
        attacker, sticky_tmp, tmp_path):
    """A FIFO the user made in /tmp, with a reader of theirs waiting on it,
    and the user's link to a device: root writes into neither. Its own
    FIFO and its own descriptors (/dev/stdout) it still streams into."""
    rec = write_sample(tmp_path / "r.mmtr")
    fifo = sticky_tmp / "trace.json"
    assert attacker.run("mkfifo", fifo).returncode == 0
    reader = subprocess.Popen(["setpriv", f"--reuid={attacker.name}", "--regid=nogroup",
                               "--clear-groups", "cat", str(fifo)], stdout=subprocess.PIPE)
    try:
        result = subprocess.run([MMTRACE, "export", rec, "--format", "jsonl", "-o", fifo],
                                capture_output=True, text=True, timeout=120)
        assert f"{fifo}: a FIFO owned by uid " in one_line(result)
        assert "another user's pipe or device" in result.stderr
    finally:
        reader.kill()
        leaked, _ = reader.communicate()
    assert leaked == b""
    device = sticky_tmp / "out.json"
    plant_link(attacker, device, Path("/dev/null"))
    result = subprocess.run([MMTRACE, "export", rec, "--format", "jsonl", "-o", device],
                            capture_output=True, text=True, timeout=120)
    assert "is a symbolic link" in one_line(result)
    own = tmp_path / "own.fifo"
    os.mkfifo(own)
    reader = subprocess.Popen(["cat", str(own)], stdout=subprocess.PIPE)
    held = os.open(own, os.O_WRONLY)        # waits for cat's open: a reader is there
    try:
        result = subprocess.run([MMTRACE, "export", rec, "--format", "jsonl", "-o", own],
                                capture_output=True, text=True, timeout=120)
    finally:
        os.close(held)
    assert result.returncode == 0, result.stderr
    assert len(reader.communicate(timeout=60)[0].splitlines()) == 40


def test_in_place_writes_check_what_they_opened_and_take_only_own_writable_descriptors(
        tmp_path, monkeypatch):
    from mmtrace.agent import safe_files
    others = tmp_path / "others.fifo"
    os.mkfifo(others)
    os.chown(others, 54321, -1)
    keep_open = os.open(others, os.O_RDONLY | os.O_NONBLOCK)      # a reader: open succeeds
    try:
        with pytest.raises(UnsafePathError, match="a FIFO owned by uid 54321; refusing"):
            safe_files.stream_in_place(others)
        # a "descriptor" path that climbs out of /dev/fd is a path like any other
        climbing = Path("/dev/fd/../../../" + str(others).lstrip("/"))
        assert os.stat(climbing).st_ino == os.stat(others).st_ino
        with pytest.raises(UnsafePathError, match="owned by uid 54321"):
            safe_files.stream_in_place(climbing)
    finally:
        os.close(keep_open)
    # the name swapped for a link after it was looked at: the open refuses it
    mine = tmp_path / "mine.fifo"
    os.mkfifo(mine)
    link = tmp_path / "swapped"
    link.symlink_to(mine)
    real_lstat = os.lstat
    monkeypatch.setattr(safe_files.os, "lstat",
                        lambda p: real_lstat(mine) if str(p) == str(link) else real_lstat(p))
    with pytest.raises(OSError, match="symbolic links"):
        safe_files.stream_in_place(link)
    monkeypatch.undo()
    # the caller's own descriptors: a copy, writable ones only
    reading = os.open(tmp_path / "r", os.O_RDONLY | os.O_CREAT)
    writing = os.open(tmp_path / "w", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(UnsafePathError, match="open for reading only"):
            safe_files.stream_in_place(f"/dev/fd/{reading}")
        copy = safe_files.stream_in_place(f"/proc/self/fd/{writing}")
        assert copy not in (None, writing)
        os.write(copy, b"in place\n")
        os.close(copy)
        assert (tmp_path / "w").read_text() == "in place\n"
    finally:
        os.close(reading)
        os.close(writing)


def test_flight_names_taken_beforehand_are_passed_over(victim, tmp_path):
    """Predictable names (flight-<time>-dump-dump.mmtr) planted for the next
    seconds: each dump goes under a name of its own, the victim untouched."""
    state = private_dir(tmp_path / "state", 0o700)
    now = time.time()
    for second in range(-2, 12):
        stamp = time.strftime("%Y%m%dT%H%M%S%z", time.localtime(now + second))
        (state / f"flight-{stamp}-dump-dump.mmtr").symlink_to(
            victim if second % 2 else tmp_path / "created-by-root")   # dangling
        os.mkfifo(state / f"flight-{stamp}-dump-dump-2.mmtr")
    flight = FlightRecorder(state, keep=1000)
    written = [flight.dump_now(windows(10**9), {"x": SCHEMA}, [], reason="dump", now_ns=10**9)
               for _ in range(3)]
    assert all(p.name.endswith(("-3.mmtr", "-4.mmtr", "-5.mmtr")) for p in written), written
    assert all(p.is_file() and not p.is_symlink() for p in written)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in written)
    assert victim.read_text() == "root's own\n" and not (tmp_path / "created-by-root").exists()


def test_no_entry_of_the_state_directory_stops_the_recorder(tmp_path):
    """A dangling link, a directory and a FIFO named like recordings, and a
    recording removed behind the recorder's back: dumps and pruning go on,
    and only real recordings are pruned or listed."""
    state = private_dir(tmp_path / "state", 0o700)
    (state / "flight-0-dangling.mmtr").symlink_to(tmp_path / "nonexistent")
    (state / "flight-1-dir.mmtr").mkdir()
    os.mkfifo(state / "flight-2-fifo.mmtr")
    flight = FlightRecorder(state, keep=2)
    paths = []
    for n in range(5):
        paths.append(flight.dump_now(windows(10**9), {"x": SCHEMA}, [], reason=f"r{n}",
                                     now_ns=10**9))
        if n == 2:
            paths[0].unlink(missing_ok=True)        # gone before the prune looks
    assert flight.written == 5 and flight.failed == 0
    assert flight.recordings() == paths[-2:]
    odd = {"flight-0-dangling.mmtr", "flight-1-dir.mmtr", "flight-2-fifo.mmtr"}
    assert odd <= {p.name for p in state.iterdir()}


def test_odd_entries_of_the_state_directory_stop_no_anomaly_or_dump_of_the_daemon(tmp_path):
    """The daemon as it runs (its socket, its recorder, `mmtrace dump` from
    the command line): a dangling link, a directory and a FIFO named
    flight-*.mmtr sit in its state directory through six anomalies and two
    dumps; every recording is written, the newest are kept, the odd
    entries are left alone and the daemon answers to the end."""
    from mmtrace.agent.config.settings import DaemonConfig
    from mmtrace.agent.daemon.loop import Daemon
    from mmtrace.agent.socket.hint_socket import HintServer

    state = private_dir(tmp_path / "state", 0o700)
    (state / "flight-0-dangling.mmtr").symlink_to(tmp_path / "nonexistent")
    (state / "flight-1-dir.mmtr").mkdir()
    os.mkfifo(state / "flight-2-fifo.mmtr")
    odd = sorted(p.name for p in state.iterdir())
    cfg = DaemonConfig(state_dir=state, socket=tmp_path / "s.sock", flight_min_interval_s=0)
    daemon = Daemon(cfg)
    daemon.flight.keep = 3
    daemon.server = HintServer(cfg.socket)
    written = []
    try:
        for n in range(6):
            daemon.alarms.act([{"detector": "p99_drift", "series": f"runq_delay{{pid={n}}}",
                          "state": "firing", "ts_ns": n, "evidence": {"p99": 0.1}}])
            written.append(daemon.alarms.anomalies[-1]["flight_recording"])
            daemon.tick()
            if n in (2, 5):
                asked = subprocess.Popen([MMTRACE, "dump", "--socket", cfg.socket],
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
                deadline = time.monotonic() + 60
                while asked.poll() is None:
                    assert time.monotonic() < deadline, "mmtrace dump got no answer"
                    daemon.tick()
                out, err = asked.communicate()
                assert asked.returncode == 0, err
                written.append(out.strip())
                if n == 2:
                    time.sleep(5.1)             # past the dump's reuse: a file of its own
        status = daemon.status()
    finally:
        daemon.close()
    assert len(set(written)) == 8 and daemon.flight.failed == 0, written
    assert [str(p) for p in daemon.flight.recordings()] == written[-3:]
    assert sorted(p.name for p in state.iterdir() if p.name in odd) == odd
    assert (state / "flight-0-dangling.mmtr").is_symlink() and \
        not (tmp_path / "nonexistent").exists()
    assert status["type"] == "status" and len(status["anomalies"]) == 6, status


def test_what_root_creates_is_not_readable_by_another_user(attacker, sticky_tmp):
    """Outside systemd, with a permissive umask: the state directory 0700,
    the socket's directory 0750, recordings 0600; the user cannot read them."""
    old = os.umask(0)
    try:
        state = private_dir(sticky_tmp / "state", 0o700)
        sockets = private_dir(sticky_tmp / "run", 0o750)
        flight = FlightRecorder(state)
        recording = flight.dump_now(windows(10**9), {"x": SCHEMA}, [], reason="dump",
                                    now_ns=10**9)
        exported = write_sample(sticky_tmp / "recorded.mmtr")
    finally:
        os.umask(old)
    assert (state.stat().st_mode & 0o777, sockets.stat().st_mode & 0o777) == (0o700, 0o750)
    assert recording.stat().st_mode & 0o777 == 0o600
    assert exported.stat().st_mode & 0o777 == 0o600
    for path in (recording, exported):
        seen = attacker.run("cat", path)
        assert seen.returncode != 0 and "Permission denied" in seen.stderr, seen
    assert attacker.run("ls", state).returncode != 0


def test_an_unsafe_directory_is_named_with_what_is_wrong(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(UnsafePathError, match="expected a directory, got a symbolic link"):
        private_dir(tmp_path / "link", 0o700)
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafePathError, match="expected a directory, got a regular file"):
        private_dir(tmp_path / "file", 0o700)


@pytest.mark.bpf
@pytest.mark.parametrize("dangling", [False, True])
def test_record_never_writes_through_a_users_link(attacker, sticky_tmp, victim, tmp_path,
                                                  dangling):
    target = tmp_path / "created-by-root" if dangling else victim
    link = sticky_tmp / "incident.mmtr"
    plant_link(attacker, link, target)
    result = subprocess.run([MMTRACE, "record", "-o", link, "--duration", "0.5"],
                            capture_output=True, text=True, timeout=180)
    line = one_line(result)
    assert f"-o {link}: is a symbolic link" in line
    assert victim.read_text() == "root's own\n" and not (tmp_path / "created-by-root").exists()


@pytest.mark.bpf
def test_record_says_so_when_its_file_was_removed_while_it_wrote(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "r.mmtr"
    proc = subprocess.Popen([MMTRACE, "record", "-o", output, "--duration", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not output.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "record never created its file"
        time.sleep(0.05)
    shutil.rmtree(out_dir)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    errors = [line for line in err.splitlines() if line.startswith("mmtrace: error:")]
    assert len(errors) == 1, err
    assert errors[0].startswith(f"mmtrace: error: -o {output}: removed or replaced while it "
                                "was written; the ")
    assert errors[0].endswith(" events recorded are lost with it")
    assert "wrote " not in err


def test_an_export_to_a_pipe_or_a_device_is_written_in_place(tmp_path):
    """/dev/stdout (a link to the pipe here) and /dev/null: nothing is
    created or replaced, so a link to either is taken."""
    rec = write_sample(tmp_path / "r.mmtr")
    result = subprocess.run([MMTRACE, "export", rec, "--format", "jsonl", "-o", "/dev/stdout"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 40
    assert subprocess.run([MMTRACE, "export", rec, "--format", "perfetto", "-o", "/dev/null"],
                          capture_output=True, timeout=120).returncode == 0


@pytest.mark.bpf
def test_record_to_dev_null_runs(tmp_path):
    result = subprocess.run([MMTRACE, "record", "-o", "/dev/null", "--duration", "0.5"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "wrote /dev/null:" in result.stderr
