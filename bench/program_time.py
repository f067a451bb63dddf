"""What an eBPF program itself costs per run, as the kernel times it.

Wall time per call is the trap plus the program, and on a shared host its
noise is as large as the differences between decoders. The kernel can time
each program run (BPF_ENABLE_STATS: on while the descriptor it returns is
open, for this process's benchmark alone, no sysctl touched) and gives the
sum and the count in the program's fdinfo. The trap is not in it: the
difference between two decoders is.
"""

import ctypes
import os
from pathlib import Path

BPF_SYSCALL = 321           # x86-64
BPF_ENABLE_STATS = 32
BPF_STATS_RUN_TIME = 0


class RunTimeStats:
    """Program run-time statistics on while this lives (a context manager)."""

    def __enter__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        attr = (ctypes.c_uint32 * 32)()
        attr[0] = BPF_STATS_RUN_TIME
        fd = libc.syscall(BPF_SYSCALL, BPF_ENABLE_STATS, attr, ctypes.sizeof(attr))
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"BPF_ENABLE_STATS: expected a descriptor, got {os.strerror(err)}")
        self.fd = fd
        return self

    def __exit__(self, *_):
        os.close(self.fd)


def run_time(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of the program behind descriptor `fd`."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines() if ":" in line)
    return int(fields["run_time_ns"]), int(fields["run_cnt"])


def timed_runs(fds, run) -> tuple[float, float]:
    """run()'s result, and ns per program run of the programs `fds` during it."""
    before = [run_time(fd) for fd in fds]
    result = run()
    after = [run_time(fd) for fd in fds]
    ns = sum(a[0] - b[0] for a, b in zip(after, before))
    count = sum(a[1] - b[1] for a, b in zip(after, before))
    return result, ns / count if count else float("nan")
