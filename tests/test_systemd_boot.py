"""systemd/mmtrace.service started by a real systemd: this host's /usr
booted in a systemd-nspawn container (volatile: an empty /etc and /var on
tmpfs, booted only to basic.target, nothing of the host changed), with the unit, the sysusers file and the
sample configuration installed there and this checkout's mmtrace as
ExecStart. The daemon must come up under the unit's user, capabilities,
no_new_privs and system call filter, serve its socket with the unit's
permissions, log each line at its priority in the journal, and stop cleanly
on SIGTERM.

Needs root, systemd-nspawn (package systemd-container) and eBPF."""

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MMTRACE
from unit_file import UNIT, service_settings

ROOT = Path(__file__).resolve().parent.parent
SYSUSERS = ROOT / "systemd" / "mmtrace.sysusers"
CONFIG = ROOT / "systemd" / "mmtrace.toml"
CAP_BITS = {"CAP_DAC_READ_SEARCH": 2, "CAP_SYS_PTRACE": 19, "CAP_SYS_NICE": 23,
            "CAP_PERFMON": 38, "CAP_BPF": 39}

pytestmark = [pytest.mark.bpf, pytest.mark.slow]


class Container:
    def __init__(self, nspawn: subprocess.Popen):
        self.nspawn = nspawn

    def init_pid(self) -> int | None:
        try:
            children = Path(f"/proc/{self.nspawn.pid}/task/{self.nspawn.pid}/children").read_text()
        except OSError:
            return None
        return int(children.split()[0]) if children.split() else None

    def run(self, *command, check=True) -> str:
        result = subprocess.run(["nsenter", "-t", str(self.init_pid()), "-a", *command],
                                capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(command)}: {result.stderr or result.stdout}")
        return result.stdout

    def show(self, *props) -> dict[str, str]:
        out = self.run("systemctl", "show", "mmtrace", *(f"-p{p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait(self, what, condition, timeout):
        deadline = time.monotonic() + timeout
        while True:
            assert self.nspawn.poll() is None, "the container stopped"
            value = condition()
            if value:
                return value
            assert time.monotonic() < deadline, f"no {what} after {timeout} s"
            time.sleep(0.5)


def environment_dirs() -> list[Path]:
    """Folders outside /usr that this checkout's mmtrace imports from: the
    checkout, its virtual environment's path, and where links there point."""
    python = MMTRACE.parent / "python"
    out = subprocess.run([str(python), "-c", "import sys; print('\\n'.join(sys.path))"],
                         capture_output=True, text=True, check=True).stdout
    dirs = {ROOT}
    for entry in map(Path, filter(None, out.splitlines())):
        if not entry.is_dir() or entry.resolve().is_relative_to("/usr"):
            continue
        dirs.add(entry.resolve())
        dirs |= {child.resolve().parent for child in entry.iterdir() if child.is_symlink()}
    return sorted(d for d in dirs if not any(d != o and d.is_relative_to(o) for o in dirs))


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    if shutil.which("systemd-nspawn") is None or shutil.which("nsenter") is None:
        pytest.skip("needs systemd-nspawn (package systemd-container) and nsenter")
    if os.geteuid() != 0:
        pytest.skip("needs root")
    files = tmp_path_factory.mktemp("nspawn")
    unit = files / "mmtrace.service"
    text = UNIT.read_text().replace("/opt/mmtrace/.venv/bin/mmtrace", str(MMTRACE))
    # A checkout under /tmp (a CI clone) would vanish behind the unit's
    # PrivateTmp=; installs live under /opt. Bind it back, read-only.
    in_tmp = [d for d in environment_dirs()
              if d.is_relative_to("/tmp") or d.is_relative_to("/var/tmp")]
    text = text.replace("[Service]\n", "[Service]\n" + "".join(
        f"BindReadOnlyPaths={d}\n" for d in in_tmp), 1)
    # A variable that names no setting: a warning at start, for the journal test.
    text = text.replace("[Service]\n", "[Service]\nEnvironment=MMTRACE_NO_SUCH_KEY=1\n", 1)
    unit.write_text(text)
    binds = {unit: "/etc/systemd/system/mmtrace.service",
             SYSUSERS: "/etc/sysusers.d/mmtrace.conf",
             CONFIG: "/etc/mmtrace/mmtrace.toml"}
    command = ["systemd-nspawn", "--directory=/", "--volatile=yes", "--boot",
               "--register=no", "--keep-unit", "--machine=mmtrace-unit-test",
               "--console=read-only", *(f"--bind-ro={d}" for d in environment_dirs()),
               # The container's bounding set must hold what the unit grants.
               "--capability=" + ",".join(CAP_BITS),
               "--system-call-filter=bpf perf_event_open",
               "--bind-ro=/sys/kernel/debug", "--bind-ro=/sys/kernel/tracing",
               *(f"--bind-ro={src}:{dst}" for src, dst in binds.items()),
               # No services but the basics (no network management, no
               # servers): the host's network is shared and stays untouched.
               # (--private-network would mount a fresh /sys over the binds.)
               "systemd.unit=basic.target", "systemd.firstboot=off"]
    log = (files / "console.log").open("w")
    nspawn = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    container = Container(nspawn)
    try:
        try:
            container.wait("systemd in the container", lambda: container.init_pid() and
                           container.run("systemctl", "is-system-running",
                                         check=False).strip() not in ("", "offline"), 120)
        except AssertionError as exc:
            pytest.skip(f"systemd does not boot in a container here: {exc}; "
                        f"{(files / 'console.log').read_text()[-500:]}")
        yield container
    finally:
        nspawn.terminate()
        try:
            nspawn.wait(timeout=60)
        except subprocess.TimeoutExpired:
            nspawn.kill()
            nspawn.wait()
        log.close()


def status_of(container, pid) -> dict[str, str]:
    text = container.run("cat", f"/proc/{pid}/status")
    return dict(re.findall(r"^(\w+):\s*(.*)$", text, re.M))


def test_unit_starts_the_daemon_sandboxed_and_stops_it_cleanly(booted):
    booted.run("systemctl", "start", "--no-block", "mmtrace")
    sock = "/run/mmtrace/mmtrace.sock"
    booted.wait("hint socket", lambda: booted.run("sh", "-c", f"test -S {sock} && echo yes",
                                                  check=False).strip(), 120)
    pid = int(booted.show("MainPID")["MainPID"])
    status = status_of(booted, pid)
    user = service_settings()["User"][0]
    uid = booted.run("id", "-u", user).strip()
    assert status["Uid"].split() == [uid] * 4
    wanted = sum(1 << CAP_BITS[c] for c in service_settings()["AmbientCapabilities"][0].split())
    for field in ("CapEff", "CapBnd", "CapAmb"):
        assert int(status[field], 16) == wanted, (field, status[field])
    assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
    listing = booted.run("stat", "-c", "%a %U %G %n", "/run/mmtrace", sock, "/var/lib/mmtrace")
    assert listing.splitlines() == [f"750 {user} {user} /run/mmtrace",
                                    f"660 {user} {user} {sock}",
                                    f"700 {user} {user} /var/lib/mmtrace"]
    # Type=notify: active once the daemon reports READY=1.
    booted.wait("readiness", lambda: booted.show("ActiveState")["ActiveState"] == "active", 30)
    assert booted.show("StatusText")["StatusText"].startswith("tracing")
    booted.run("systemctl", "stop", "mmtrace")
    after = booted.show("Result", "ExecMainCode", "ExecMainStatus")
    assert after == {"Result": "success", "ExecMainCode": "1", "ExecMainStatus": "0"}, after
    assert "stopped by SIGTERM" in booted.run("journalctl", "-u", "mmtrace", "--no-pager")
    # The journal took each line's <N> as its priority: -p filters on it.
    entries = [json.loads(line) for line in booted.run(
        "journalctl", "-u", "mmtrace", "-o", "json", "--no-pager").splitlines()]
    daemon_lines = {e["MESSAGE"]: e["PRIORITY"] for e in entries
                    if e.get("_PID") == str(pid) and isinstance(e.get("MESSAGE"), str)}
    warning = [p for m, p in daemon_lines.items()
               if m.startswith("WARNING mmtrace.daemon: MMTRACE_NO_SUCH_KEY names no setting")]
    # (the first INFO line: the GPU/NPU probes may still be compiling at the stop)
    live = [p for m, p in daemon_lines.items() if m.startswith("INFO mmtrace.daemon: cpu stream live")]
    assert warning == ["4"] and live == ["6"], daemon_lines
    assert not any(m.startswith("<") for m in daemon_lines), daemon_lines
    filtered = booted.run("journalctl", "-u", "mmtrace", "-p", "warning", "--no-pager",
                          "-o", "cat")
    assert "MMTRACE_NO_SUCH_KEY" in filtered and "cpu stream live" not in filtered, filtered
