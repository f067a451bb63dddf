"""What this process may do: capabilities read from /proc, not guessed."""

from pathlib import Path

CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def effective_caps(proc_root: Path = Path("/proc")) -> int:
    for line in (proc_root / "self" / "status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def can_load_bpf(proc_root: Path = Path("/proc")) -> bool:
    caps = effective_caps(proc_root)
    has = lambda bit: bool(caps >> bit & 1)  # noqa: E731
    return has(CAP_SYS_ADMIN) or (has(CAP_BPF) and has(CAP_PERFMON))
