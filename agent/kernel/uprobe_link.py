"""Attach loaded BPF programs to uprobes with BPF cookies, which bcc 0.26
cannot do.

A cookie is a number per attachment that the program reads with
bpf_get_attach_cookie(): it tells one program serving many symbols which
symbol fired (which API, which aclnn operator), exactly, even when the
process has exited before userspace could read its /proc/PID/maps.

- UprobeMultiLink (Linux 6.6+): one BPF_LINK_CREATE of type
  BPF_TRACE_UPROBE_MULTI attaches a program to many offsets of one file,
  each with its cookie; closing it removes them all after one RCU grace
  period. Removing uprobes one at a time costs a grace period each (about
  0.1 s on a VM): hundreds of aclnn ops, or the per-launch probes of the
  adaptive mode, would take seconds or minutes to detach.
- CookieLink (Linux 5.15+): one uprobe perf event and a BPF_PERF_EVENT link.
"""

import ctypes
import errno
import functools
import os
import platform
import struct
from pathlib import Path

UPROBE_PMU = Path("/sys/bus/event_source/devices/uprobe")
SYS_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
SYS_BPF = {"x86_64": 321, "aarch64": 280}
PERF_FLAG_FD_CLOEXEC = 8
PERF_ATTR_SIZE = 128            # PERF_ATTR_SIZE_VER7
BPF_LINK_CREATE = 28
BPF_PERF_EVENT = 41             # enum bpf_attach_type
BPF_TRACE_UPROBE_MULTI = 48     # enum bpf_attach_type
BPF_TRACE_UPROBE_SESSION = 57   # enum bpf_attach_type (Linux 6.13+)
BPF_F_UPROBE_MULTI_RETURN = 1
BPF_ATTR_SIZE = 64

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


BTF_VMLINUX = Path("/sys/kernel/btf/vmlinux")


@functools.lru_cache(maxsize=16)
def _btf_names(btf: Path, *names: bytes) -> bool:
    """Whether the kernel's BTF holds every one of `names`. No BTF: no.
    Read once per question: the running kernel does not change, and a
    load asks several times (the attach mode, the session programs)."""
    try:
        data = btf.read_bytes()
    except OSError:
        return False
    return all(b"\0" + name + b"\0" in data for name in names)


def uprobe_multi_available(btf: Path = BTF_VMLINUX) -> bool:
    """Feature detection: a kernel with uprobe_multi links has the
    bpf_uprobe_multi_link type in its BTF."""
    return _btf_names(btf, b"bpf_uprobe_multi_link")


def uprobe_session_available(btf: Path = BTF_VMLINUX) -> bool:
    """A kernel whose uprobe_multi links can be sessions (Linux 6.13+: one
    program at entry and, where its entry returned 0, at return) names the
    attach type in its BTF."""
    return _btf_names(btf, b"bpf_uprobe_multi_link", b"BPF_TRACE_UPROBE_SESSION")


class LinkError(OSError):
    """The kernel refused the perf event or the link; errno says why."""


def _syscall_number(table: dict, what: str) -> int:
    number = table.get(platform.machine())
    if number is None:
        raise LinkError(f"{what}: no syscall number for {platform.machine()}")
    return number


def uprobe_pmu() -> tuple[int, int]:
    """(PMU type, bit of config that makes a uretprobe)."""
    pmu_type = int((UPROBE_PMU / "type").read_text())
    fmt = (UPROBE_PMU / "format" / "retprobe").read_text().strip()   # "config:0"
    return pmu_type, int(fmt.split(":", 1)[1])


class CookieLink:
    """One uprobe with a cookie; close() detaches it."""
    descriptors = 2     # the perf event and its link

    def __init__(self, prog_fd: int, path: bytes, offset: int, cookie: int,
                 retprobe: bool = False):
        pmu_type, ret_bit = uprobe_pmu()
        path_buf = ctypes.create_string_buffer(path)
        attr = ctypes.create_string_buffer(PERF_ATTR_SIZE)
        struct.pack_into("<IIQ", attr, 0, pmu_type, PERF_ATTR_SIZE,
                         (1 << ret_bit) if retprobe else 0)
        # config1: the path (uprobe_path), config2: the file offset (probe_offset)
        struct.pack_into("<QQ", attr, 56, ctypes.addressof(path_buf), offset)
        perf_fd = _libc.syscall(_syscall_number(SYS_PERF_EVENT_OPEN, "perf_event_open"),
                                attr, -1, 0, -1, PERF_FLAG_FD_CLOEXEC)
        if perf_fd < 0:
            err = ctypes.get_errno()
            raise LinkError(err, f"perf_event_open(uprobe {path.decode(errors='replace')}"
                                 f"+{offset:#x}): {os.strerror(err)}")
        link = ctypes.create_string_buffer(BPF_ATTR_SIZE)
        struct.pack_into("<IIIIQ", link, 0, prog_fd, perf_fd, BPF_PERF_EVENT, 0, cookie)
        link_fd = _libc.syscall(_syscall_number(SYS_BPF, "bpf"), BPF_LINK_CREATE, link,
                                BPF_ATTR_SIZE)
        if link_fd < 0:
            err = ctypes.get_errno()
            os.close(perf_fd)
            raise LinkError(err, f"BPF_LINK_CREATE with a cookie: {os.strerror(err)} "
                                 "(needs Linux 5.15 or later)")
        self.perf_fd = perf_fd
        self.link_fd = link_fd

    def close(self):
        for name in ("link_fd", "perf_fd"):
            fd = getattr(self, name)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)


ENOTSUPP = 524      # the kernel's internal "not supported", which reaches user space as is


def multi_link_failure(err: int) -> str:
    """Why the kernel refused a uprobe_multi link, in words. Placing a
    uprobe in a file that a process maps checks the instruction there at
    once: one the kernel cannot single-step (hlt, int3, a damaged file)
    fails the whole link with ENOTSUPP or ENOSYS."""
    if err in (ENOTSUPP, errno.ENOSYS):
        return (f"the kernel cannot probe the instruction at this address "
                f"({'ENOTSUPP' if err == ENOTSUPP else 'ENOSYS'}: not code it can single-step; "
                "the file may be damaged or the symbol not a function)")
    return f"{os.strerror(err)} (needs Linux 6.6 or later)"


class UprobeMultiLink:
    """One program on many offsets of one file, a cookie each; close()
    detaches them all. The program must have been loaded with expected
    attach type BPF_TRACE_UPROBE_MULTI, or BPF_TRACE_UPROBE_SESSION for a
    `session` link."""
    descriptors = 1

    def __init__(self, prog_fd: int, path: bytes, offsets: list[int], cookies: list[int],
                 retprobe: bool = False, session: bool = False):
        if len(offsets) != len(cookies) or not offsets:
            raise ValueError(f"expected as many cookies as offsets (at least one), got "
                             f"{len(offsets)} offsets and {len(cookies)} cookies")
        path_buf = ctypes.create_string_buffer(path)
        offs = (ctypes.c_uint64 * len(offsets))(*offsets)
        cks = (ctypes.c_uint64 * len(cookies))(*cookies)
        attr = ctypes.create_string_buffer(BPF_ATTR_SIZE)
        if retprobe and session:
            raise ValueError("a session link runs at entry and return: not a retprobe")
        attach_type = BPF_TRACE_UPROBE_SESSION if session else BPF_TRACE_UPROBE_MULTI
        struct.pack_into("<IIII", attr, 0, prog_fd, 0, attach_type, 0)
        # link_create.uprobe_multi: path, offsets, ref_ctr_offsets, cookies, cnt, flags, pid
        struct.pack_into("<QQQQIII", attr, 16, ctypes.addressof(path_buf),
                         ctypes.addressof(offs), 0, ctypes.addressof(cks), len(offsets),
                         BPF_F_UPROBE_MULTI_RETURN if retprobe else 0, 0)
        link_fd = _libc.syscall(_syscall_number(SYS_BPF, "bpf"), BPF_LINK_CREATE, attr,
                                BPF_ATTR_SIZE)
        if link_fd < 0:
            err = ctypes.get_errno()
            raise LinkError(err, f"BPF_LINK_CREATE uprobe_{'session' if session else 'multi'} "
                                 f"({len(offsets)} offsets): "
                                 f"{multi_link_failure(err)}")
        self.link_fd = link_fd

    def close(self):
        if self.link_fd is not None:
            os.close(self.link_fd)
            self.link_fd = None
