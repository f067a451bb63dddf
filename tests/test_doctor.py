"""doctor's checks on injected filesystem roots: each missing piece is named
with its fix, and only required ones stop tracing."""

from pathlib import Path

from click.testing import CliRunner

from mmtrace.agent.doctor import host as doctor
from mmtrace.agent.cli import cli


def fake_host(tmp_path, *, caps="000001ffffffffff", tracefs=True, btf=True, uprobe=True,
              headers="own"):
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (proc / "status").write_text(f"Name:\tx\nCapEff:\t{caps}\n")
    sys_root = tmp_path / "sys"
    if tracefs:
        (sys_root / "kernel/debug/tracing/events/sched/sched_switch").mkdir(parents=True)
    if btf:
        (sys_root / "kernel/btf").mkdir(parents=True)
        (sys_root / "kernel/btf/vmlinux").write_text("")
    if uprobe:
        (sys_root / "bus/event_source/devices/uprobe").mkdir(parents=True)
    mods = tmp_path / "lib" / "modules"
    release = "6.18.0-test"
    if headers:
        name = f"linux-headers-{release}" if headers == "own" else "linux-headers-6.1.0-9-amd64"
        src = tmp_path / "usr" / "src" / name
        (src / "include" / "generated").mkdir(parents=True)
        (src / "include" / "generated" / "autoconf.h").write_text("")
        (mods / release).mkdir(parents=True)
        (mods / release / "build").symlink_to(src)
    return doctor.Host(proc=tmp_path / "proc", sys=sys_root, lib_modules=mods,
                       kernel_release=release)


def by_name(checks):
    return {c.name: c for c in checks}


def test_everything_present(tmp_path):
    host = fake_host(tmp_path)
    checks = by_name([doctor.check_privileges(host), doctor.check_tracefs(host),
                      doctor.check_btf(host), doctor.check_uprobes(host),
                      doctor.check_kernel_headers(host)])
    assert all(c.ok for c in checks.values()), checks


def test_missing_pieces_name_their_fix(tmp_path):
    host = fake_host(tmp_path, caps="0000000000000000", tracefs=False, btf=False,
                     uprobe=False, headers=None)
    checks = [doctor.check_privileges(host), doctor.check_tracefs(host),
              doctor.check_btf(host), doctor.check_uprobes(host),
              doctor.check_kernel_headers(host)]
    named = by_name(checks)
    assert not any(c.ok for c in checks)
    assert "sudo" in named["privileges"].fix
    assert "mount -t tracefs" in named["tracefs"].fix
    assert "linux-headers" in named["kernel_headers"].fix
    assert not doctor.tracing_ready(checks)
    # BTF is not needed by tracepoint and uprobe programs
    assert named["btf"].required is False
    text = doctor.format_text(checks, False)
    assert "MISSING privileges" in text and "fix: mount -t tracefs" in text


def test_cap_bpf_with_perfmon_is_enough(tmp_path):
    caps = (1 << doctor.CAP_BPF) | (1 << doctor.CAP_PERFMON)
    host = fake_host(tmp_path, caps=f"{caps:016x}")
    assert doctor.check_privileges(host).ok
    only_bpf = tmp_path / "b"
    only_bpf.mkdir()
    host = fake_host(only_bpf, caps=f"{1 << doctor.CAP_BPF:016x}")
    assert not doctor.check_privileges(host).ok


def test_headers_of_another_kernel_are_explained(tmp_path):
    check = doctor.check_kernel_headers(fake_host(tmp_path, headers="debian"))
    assert check.ok
    assert "another kernel" in check.detail and "tracepoint format" in check.detail


def test_doctor_help_has_an_example():
    result = CliRunner().invoke(cli, ["doctor", "--help"])
    assert result.exit_code == 0 and "Example" in result.output


def test_doctor_run_check_and_the_metrics_count_probes_alike():
    """One count: what is attached always, and the per-launch probes apart
    (the daemon holds those until an alarm); the scheduler's tracepoints
    are not probe points of a library."""
    from mmtrace.agent.doctor.devices import summarise
    from mmtrace.exporters.live import prometheus
    from mmtrace.exporters.live.event_counts import EventCounts
    from mmtrace.bpf import device as device_stream
    lib = "/opt/cuda/libcudart.so.12"
    rows = [{"path": lib, "symbol": "cudaLaunchKernel", "api": "cudaLaunchKernel",
             "state": "attached", "count": 1},
            {"path": lib, "symbol": "cudaMemcpyAsync", "api": "cudaMemcpyAsync",
             "state": "attached", "count": 1},
            {"path": lib, "symbol": "cudaStreamSynchronize", "api": "cudaStreamSynchronize",
             "state": "attached", "count": 1}]
    check = summarise(rows, "multi")
    assert "2 probes attached, and 1 per-launch probes attach too" in check.detail, check.detail
    # The daemon in its default (adaptive) mode: the launch probe waits.
    daemon_rows = [dict(rows[0], state="detached")] + rows[1:]
    snapshot = prometheus.DaemonSnapshot(
        counts=EventCounts(device_stream.default_infos()).snapshot(),
        program_states=[{"stream": "cpu", "state": "attached"}], device_probes=daemon_rows)
    families = {f.name: f for f in prometheus.DaemonCollector(lambda: snapshot).collect()}
    by_state = {s.labels["state"]: s.value for s in families["mmtrace_probes"].samples}
    assert (by_state["attached"], by_state["detached"]) == (2, 1), by_state
