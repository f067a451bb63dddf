"""`mmtrace doctor`: every prerequisite of tracing, checked by feature
detection (never by kernel version), each with the exact fix."""

import ctypes
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path

from mmtrace.agent.findings import Check
from mmtrace.agent.kernel.bcc_module import check_bcc
from mmtrace.agent.kernel.privileges import CAP_BPF, CAP_PERFMON, CAP_SYS_ADMIN, effective_caps


@dataclass
class Host:
    """Filesystem roots, injectable so tests need no real /proc or /sys."""
    proc: Path = Path("/proc")
    sys: Path = Path("/sys")
    lib_modules: Path = Path("/lib/modules")
    kernel_release: str = platform.release()


def check_privileges(host: Host) -> Check:
    caps = effective_caps(host.proc)
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    if has(CAP_SYS_ADMIN):
        return Check("privileges", True, True, "root (CAP_SYS_ADMIN)")
    if has(CAP_BPF) and has(CAP_PERFMON):
        return Check("privileges", True, True, "CAP_BPF and CAP_PERFMON")
    return Check("privileges", False, True, f"effective capabilities {caps:#x} lack "
                 "CAP_BPF+CAP_PERFMON", "run as root: sudo mmtrace ...")


def check_tracefs(host: Host) -> Check:
    tracing = host.sys / "kernel" / "tracing" / "events" / "sched" / "sched_switch"
    debug = host.sys / "kernel" / "debug" / "tracing" / "events" / "sched" / "sched_switch"
    if debug.exists():
        return Check("tracefs", True, True, "scheduler tracepoints visible under "
                     "/sys/kernel/debug/tracing")
    if tracing.exists():
        return Check("tracefs", False, True,
                     "tracefs is at /sys/kernel/tracing but bcc reads /sys/kernel/debug/tracing",
                     "mount -t debugfs nodev /sys/kernel/debug")
    return Check("tracefs", False, True, "no scheduler tracepoints: tracefs not mounted",
                 "mount -t tracefs nodev /sys/kernel/tracing && "
                 "mount -t debugfs nodev /sys/kernel/debug")


def check_btf(host: Host) -> Check:
    btf = host.sys / "kernel" / "btf" / "vmlinux"
    if btf.exists():
        return Check("btf", True, False, f"{btf} present")
    return Check("btf", False, False, "no kernel BTF: struct layouts cannot be checked",
                 "use a kernel built with CONFIG_DEBUG_INFO_BTF=y (not needed by the "
                 "tracepoint and uprobe programs)")


def check_uprobes(host: Host) -> Check:
    if (host.sys / "bus" / "event_source" / "devices" / "uprobe").exists():
        return Check("uprobes", True, True, "uprobe event source present")
    return Check("uprobes", False, True, "no uprobe event source: GPU/NPU probes cannot attach",
                 "use a kernel with CONFIG_UPROBE_EVENTS=y")


def check_kernel_headers(host: Host) -> Check:
    mod = host.lib_modules / host.kernel_release
    build = mod / "build"
    fix = ("scripts/setup links Debian's generic headers: apt-get install linux-headers-amd64; "
           f"ln -s /usr/src/linux-headers-*-amd64 {build}; "
           f"ln -s /usr/src/linux-headers-*-common {mod}/source")
    if not build.exists():
        return Check("kernel_headers", False, True,
                     f"no headers at {build}: bcc cannot compile its programs", fix)
    if not (build / "include" / "generated" / "autoconf.h").exists():
        return Check("kernel_headers", False, True, f"{build} has no include/generated", fix)
    target = os.path.realpath(build)
    name = os.path.basename(target)
    if host.kernel_release not in name:
        return Check("kernel_headers", True, True,
                     f"{build} -> {target}: headers of another kernel, linked as a fallback. "
                     "Fine for mmtrace (its tracepoint programs read arguments through the "
                     "tracepoint format, its uprobes read user memory); bcc tools that read "
                     "kernel structs through headers may misread fields")
    return Check("kernel_headers", True, True, f"{build} -> {target}")


BPF_MAP_CREATE = 0
BPF_MAP_TYPE_RINGBUF = 27
SYS_BPF = {"x86_64": 321, "aarch64": 280}


def check_ringbuf() -> Check:
    """Create (and close) a one-page ring buffer map: the feature, not a version."""
    nr = SYS_BPF.get(platform.machine())
    if nr is None:
        return Check("ring_buffer", False, True, f"unknown bpf syscall on {platform.machine()}")
    attr = (ctypes.c_uint32 * 30)()
    attr[0] = BPF_MAP_TYPE_RINGBUF
    attr[3] = os.sysconf("SC_PAGE_SIZE")   # max_entries
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, BPF_MAP_CREATE, ctypes.byref(attr), ctypes.sizeof(attr))
    if fd >= 0:
        os.close(fd)
        return Check("ring_buffer", True, True, "BPF ring buffer maps can be created")
    err = ctypes.get_errno()
    if err in (1, 13):  # EPERM / EACCES: the feature is unknown, the caller is not allowed
        return Check("ring_buffer", False, True, f"bpf() refused: {os.strerror(err)}",
                     "run as root")
    return Check("ring_buffer", False, True, f"cannot create a ring buffer map: "
                 f"{os.strerror(err)}", "needs a kernel with BPF ring buffers (5.8 or later)")


def check_tools() -> Check:
    gcc = shutil.which("gcc")
    return Check("compiler", bool(gcc), False, gcc or "gcc not found (tests build stand-ins)",
                 "" if gcc else "apt-get install gcc")


def run_checks(host: Host | None = None, *, compile_apart: bool = False) -> list[Check]:
    """Every check; `compile_apart` as for probes.load_cpu (the GPU/NPU probes' check)."""
    host = host or Host()
    checks = [check_privileges(host), check_tracefs(host), check_btf(host),
              check_uprobes(host), check_bcc(), check_kernel_headers(host), check_ringbuf(),
              check_tools()]
    from mmtrace.agent.doctor.runtime_libraries import doctor_checks
    checks += doctor_checks(host)
    from mmtrace.agent.doctor.devices import device_checks
    return checks + device_checks(host, tracing_ready(checks), compile_apart=compile_apart)


def tracing_ready(checks: list[Check]) -> bool:
    return all(c.ok for c in checks if c.required)


def format_text(checks: list[Check], ready: bool) -> str:
    lines = []
    for c in checks:
        mark = "ok     " if c.ok else ("MISSING" if c.required else "absent ")
        lines.append(f"{mark} {c.name:<16} {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':8}{'':17}fix: {c.fix}")
    lines.append("")
    lines.append("tracing can run" if ready else "tracing cannot run: fix the MISSING lines")
    return "\n".join(lines)
