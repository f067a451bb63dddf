"""Run a command under the system call filter of systemd/mmtrace.service,
as systemd 252 builds it, without systemd as PID 1.

    python unit_sandbox.py ALLOWED_SYSCALLS_FILE -- COMMAND...

ALLOWED_SYSCALLS_FILE lists the allowed calls one a line (the unit's
SystemCallFilter= expanded by `systemd-analyze syscall-filter`); every other
call fails with EPERM (SystemCallErrorNumber=EPERM). MemoryDenyWriteExecute=
is added the way systemd adds it: mmap with PROT_WRITE|PROT_EXEC, mprotect
and pkey_mprotect with PROT_EXEC, shmat with SHM_EXEC fail. The filter
stays on across exec; the caller sets no_new_privs (setpriv --no-new-privs)."""

import errno
import itertools
import mmap
import os
import sys

import seccomp

SHM_EXEC = 0o100000
# Calls MemoryDenyWriteExecute= constrains: (name, argument, mask, refused value).
WRITE_EXECUTE = [
    ("mmap", 2, mmap.PROT_WRITE | mmap.PROT_EXEC, mmap.PROT_WRITE | mmap.PROT_EXEC),
    ("mprotect", 2, mmap.PROT_EXEC, mmap.PROT_EXEC),
    ("pkey_mprotect", 2, mmap.PROT_EXEC, mmap.PROT_EXEC),
    ("shmat", 2, SHM_EXEC, SHM_EXEC),
]


def _masked_values(mask: int) -> set[int]:
    """Every value the bits of mask can take (mask 0b101: 0, 1, 4, 5)."""
    bits = [1 << i for i in range(mask.bit_length()) if mask >> i & 1]
    return {sum(c) for n in range(len(bits) + 1) for c in itertools.combinations(bits, n)}


def build_filter(allowed: set[str]) -> seccomp.SyscallFilter:
    filt = seccomp.SyscallFilter(defaction=seccomp.ERRNO(errno.EPERM))
    constrained = {name for name, *_ in WRITE_EXECUTE}
    for name in sorted(allowed - constrained):
        try:
            filt.add_rule(seccomp.ALLOW, name)
        except (RuntimeError, ValueError):
            pass                # a call this architecture does not have
    for name, arg, mask, refused in WRITE_EXECUTE:
        if name not in allowed:
            continue
        for value in sorted(_masked_values(mask) - {refused}):
            filt.add_rule(seccomp.ALLOW, name, seccomp.Arg(arg, seccomp.MASKED_EQ, mask, value))
    return filt


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    allowed = {line.strip() for line in open(argv[1]) if line.strip()}
    build_filter(allowed).load()
    os.execv(argv[3], argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv))
