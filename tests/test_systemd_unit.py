"""systemd/mmtrace.service: it verifies, its exposure score stays low, every
relaxed setting says why, and the daemon runs under the unit's user,
capabilities and system call filter.

systemd is not PID 1 here, so the unit cannot be started: `systemd-analyze
verify` and `security --offline` check the file, and the bpf tests rebuild
the unit's sandbox by hand (setpriv for the user, capabilities and
no_new_privs; tests/unit_sandbox.py for SystemCallFilter= and
MemoryDenyWriteExecute=) around a real recording."""

import functools
import grp
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import MMTRACE
from gpu_fixtures import cudart_path
from unit_file import UNIT, comments, service_settings

ROOT = Path(__file__).resolve().parent.parent
SYSUSERS = ROOT / "systemd" / "mmtrace.sysusers"
SANDBOX = Path(__file__).resolve().parent / "unit_sandbox.py"
INSTALLED_MMTRACE = "/opt/mmtrace/.venv/bin/mmtrace"
# Measured 2.9 with systemd 252; a change that loosens the unit beyond this
# must say why here.
EXPOSURE_MAX = 3.0

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                           reason="needs systemd-analyze (package systemd)")


@pytest.fixture
def unit_copy(tmp_path):
    """The unit with ExecStart= pointing at this checkout's mmtrace: verify
    checks that the command exists."""
    text = UNIT.read_text()
    assert INSTALLED_MMTRACE in text
    copy = tmp_path / "mmtrace.service"
    copy.write_text(text.replace(INSTALLED_MMTRACE, str(MMTRACE)))
    return copy


def analyze(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


@needs_systemd_analyze
def test_unit_verifies(unit_copy):
    result = analyze("verify", unit_copy)
    # verify exits 0 on lines it ignores: any line naming the unit is a defect.
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if "mmtrace.service" in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


@needs_systemd_analyze
def test_verify_catches_a_broken_line(unit_copy):
    unit_copy.write_text(unit_copy.read_text().replace("NoNewPrivileges=yes", "NoNewPrivileges"))
    result = analyze("verify", unit_copy)
    assert "mmtrace.service" in result.stderr and "Missing '='" in result.stderr


def security_rows(unit: Path) -> tuple[float, list[str]]:
    result = analyze("security", "--offline=true", "--no-pager", unit)
    text = result.stdout + result.stderr
    score = re.search(r"Overall exposure level for mmtrace\.service: ([0-9.]+)", text)
    assert score, text
    failed = [line[2:].split()[0] for line in text.splitlines() if line.startswith("✗ ")]
    return float(score.group(1)), failed


@needs_systemd_analyze
def test_exposure_score(unit_copy):
    score, _ = security_rows(unit_copy)
    assert score <= EXPOSURE_MAX, f"exposure {score} > {EXPOSURE_MAX}"


@needs_systemd_analyze
def test_score_rises_when_hardening_is_dropped(unit_copy):
    baseline, _ = security_rows(unit_copy)
    text = unit_copy.read_text()
    for setting in ("ProtectSystem=strict", "NoNewPrivileges=yes", "RestrictNamespaces=yes"):
        text = text.replace(setting, "#" + setting)
    unit_copy.write_text(text)
    loosened, _ = security_rows(unit_copy)
    assert loosened > baseline + 0.3


@needs_systemd_analyze
def test_every_relaxed_setting_says_why(unit_copy):
    """Each setting systemd-analyze marks as exposed is named in a comment."""
    _, failed = security_rows(unit_copy)
    assert failed, "expected some settings relaxed for eBPF"
    text = comments()
    for row in failed:                          # e.g. "CapabilityBoundingSet=~CAP_BPF"
        names = re.findall(r"([A-Z][A-Za-z]+)=", row)
        assert any(name in text for name in names), f"{row}: no comment says why"


def test_capabilities_are_ambient_and_bounded_alike():
    settings = service_settings()
    bounding = set(" ".join(settings["CapabilityBoundingSet"]).split())
    ambient = set(" ".join(settings["AmbientCapabilities"]).split())
    assert bounding == ambient == {"CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH",
                                   "CAP_SYS_PTRACE", "CAP_SYS_NICE"}


def test_notify_watchdog_and_restart():
    settings = service_settings()
    assert settings["Type"] == ["notify"]
    assert int(settings["WatchdogSec"][0]) > 0
    assert settings["Restart"] == ["on-failure"]
    assert settings["ExecStart"][0].startswith(INSTALLED_MMTRACE + " run")


def test_sysusers_creates_the_units_user_and_group(tmp_path):
    if shutil.which("systemd-sysusers") is None:
        pytest.skip("needs systemd-sysusers (package systemd)")
    (tmp_path / "etc").mkdir()
    with SYSUSERS.open() as conf:
        subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "-"], stdin=conf, check=True,
                       capture_output=True)
    settings = service_settings()
    user, group = settings["User"][0], settings["Group"][0]
    passwd = {line.split(":")[0]: line.split(":") for line in
              (tmp_path / "etc" / "passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in
              (tmp_path / "etc" / "group").read_text().splitlines()}
    assert user in passwd and group in groups
    assert passwd[user][3] == groups[group][2]          # the user's primary group
    assert passwd[user][6] == "/usr/sbin/nologin"


# ----- the daemon inside the unit's sandbox (root, real eBPF) --------------

@functools.cache
def expand_filter(*tokens: str) -> frozenset[str]:
    """System calls a SystemCallFilter= list names, groups expanded."""
    out: set[str] = set()
    for token in tokens:
        if not token.startswith("@"):
            out.add(token)
            continue
        listing = analyze("syscall-filter", "--no-pager", token)
        assert listing.returncode == 0, listing.stderr
        for line in listing.stdout.splitlines()[1:]:
            line = line.strip()
            if line and not line.startswith("#"):
                out |= expand_filter(line)
    return frozenset(out)


def allowed_syscalls() -> set[str]:
    """The unit's SystemCallFilter= lines applied in order (an allow list,
    then ~ lines taking calls away)."""
    allowed: set[str] = set()
    for value in service_settings()["SystemCallFilter"]:
        if value.startswith("~"):
            allowed -= expand_filter(*value[1:].split())
        else:
            allowed |= expand_filter(*value.split())
    return allowed


@pytest.fixture(scope="module")
def unit_user():
    """The unit's user, created on this host from the sysusers file."""
    if shutil.which("systemd-sysusers") is None or shutil.which("setpriv") is None:
        pytest.skip("needs systemd-sysusers and setpriv")
    with SYSUSERS.open() as conf:
        subprocess.run(["systemd-sysusers", "-"], stdin=conf, check=True, capture_output=True)
    return pwd.getpwnam(service_settings()["User"][0])


@pytest.fixture
def open_tmp():
    """A scratch folder the unit's user can reach (pytest's is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="mmtrace-unit-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def sandboxed(user, command, scratch, caps=None, syscalls=None):
    """COMMAND as the unit would run it: its user and group, its ambient and
    bounding capabilities, no_new_privs, its system call filter."""
    if caps is None:
        caps = service_settings()["AmbientCapabilities"][0].split()
    listed = ",".join("+" + c.removeprefix("CAP_").lower() for c in caps)
    allowed = scratch / "syscalls"
    allowed.write_text("\n".join(sorted(allowed_syscalls() if syscalls is None else syscalls)))
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            f"--inh-caps=-all,{listed}", f"--ambient-caps=-all,{listed}",
            f"--bounding-set=-all,{listed}", "--no-new-privs", "--",
            sys.executable, str(SANDBOX), str(allowed), "--", *map(str, command)]


def owned_dir(path: Path, user, mode: int) -> Path:
    path.mkdir(mode=mode)
    os.chown(path, user.pw_uid, user.pw_gid)
    path.chmod(mode)
    return path


@pytest.mark.bpf
def test_sandbox_refuses_what_the_unit_refuses(unit_user, open_tmp):
    probe = ("import mmap, os\n"
             "for what, call in (('setuid', lambda: os.setuid(os.getuid())),\n"
             "                   ('wx', lambda: mmap.mmap(-1, 4096, prot=7))):\n"
             "    try: call(); print(what, 'allowed')\n"
             "    except OSError as e: print(what, e.errno)\n")
    out = subprocess.run(sandboxed(unit_user, [sys.executable, "-c", probe], open_tmp),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # setuid: removed by ~@setuid; W|X memory: MemoryDenyWriteExecute=yes.
    assert out.stdout.split("\n")[:2] == ["setuid 1", "wx 1"], out.stdout


def record_in_sandbox(user, scratch, **kwargs):
    out_dir = owned_dir(scratch / "state", user, 0o700)
    cudart = cudart_path()
    if cudart is None:
        pytest.skip("the nvidia-cuda-runtime-cu12 wheel (libcudart.so.12) is not installed")
    recording = out_dir / "unit.mmtr"
    result = subprocess.run(sandboxed(user, [MMTRACE, "record", "-o", recording, "--duration",
                                             "1", "--lib", cudart], scratch, **kwargs),
                            capture_output=True, text=True, timeout=180)
    return result, recording


@pytest.mark.bpf
def test_recording_runs_under_the_units_sandbox(unit_user, open_tmp):
    result, recording = record_in_sandbox(unit_user, open_tmp)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(subprocess.run([str(MMTRACE), "report", "--json", str(recording)],
                                       capture_output=True, text=True, check=True).stdout)
    assert report["events"].get("cpu.runq", 0) > 0
    probes = report["device_probes"]["summary"]
    assert probes["attached"] > 0 and probes["failed"] == 0, probes


@pytest.mark.bpf
def test_without_dac_read_search_tracefs_is_out_of_reach(unit_user, open_tmp):
    caps = [c for c in service_settings()["AmbientCapabilities"][0].split()
            if c != "CAP_DAC_READ_SEARCH"]
    result, _ = record_in_sandbox(unit_user, open_tmp, caps=caps)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mmtrace: error:")]
    assert len(errors) == 1 and "/sys/kernel/debug/tracing" in errors[0]
    assert "CAP_DAC_READ_SEARCH" in errors[0]


@pytest.mark.bpf
def test_daemon_serves_the_socket_to_its_group_only(unit_user, open_tmp):
    """RuntimeDirectory= 0750 and the socket's 0660 under the unit's group:
    the group connects, a user outside it does not; SIGTERM exits 0."""
    state = owned_dir(open_tmp / "state", unit_user, 0o700)
    run_dir = owned_dir(open_tmp / "run", unit_user, 0o750)
    sock = run_dir / "mmtrace.sock"
    daemon = subprocess.Popen(
        sandboxed(unit_user, [MMTRACE, "run", "--state-dir", state, "--socket", sock,
                              "--metrics-address", "127.0.0.1:0"], open_tmp),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert daemon.poll() is None, daemon.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "no socket after 120 s"
            time.sleep(0.2)
        st = sock.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert grp.getgrgid(st.st_gid).gr_name == service_settings()["Group"][0]
        nobody = pwd.getpwnam("nobody")
        for uid, gid, expect in ((nobody.pw_uid, unit_user.pw_gid, "connected"),
                                 (nobody.pw_uid, nobody.pw_gid, "refused")):
            code = (f"import os, socket\nos.setgroups([]); os.setgid({gid}); os.setuid({uid})\n"
                    "s = socket.socket(socket.AF_UNIX)\n"
                    f"try: s.connect({str(sock)!r}); print('connected')\n"
                    "except PermissionError: print('refused')\n")
            seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=30)
            assert seen.stdout.strip() == expect, (uid, gid, seen.stdout, seen.stderr)
        daemon.send_signal(signal.SIGTERM)
        _, err = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, err[-2000:]
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
