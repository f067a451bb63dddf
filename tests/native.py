"""Build the C workloads and stand-ins that tests and benchmarks run."""

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tests" / "workloads"
NATIVE = ROOT / "tests" / "native"
BUILD = ROOT / "tests" / "_build"


def _private_tmp(out: Path) -> Path:
    """Where one builder writes `out` before renaming it into place: two
    processes building the same binary at once must not rename one's
    half-written output (open for writing: ETXTBSY at exec) over the other's."""
    return Path(f"{out}.{os.getpid()}.tmp")


def build(source: Path, *, shared: bool = False, flags=(), out_dir: Path = BUILD,
          name: str | None = None) -> Path:
    """Compile `source` (cached by content and flags); return the binary."""
    source = Path(source)
    flags = list(flags)
    # The key covers the headers a source may include (those beside it and
    # the shared API headers in tests/native), so editing one rebuilds.
    header_paths = set(source.parent.glob("*.h")) | set(NATIVE.glob("*.h"))
    headers = b"".join(h.read_bytes() for h in sorted(header_paths))
    digest = hashlib.sha1(source.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:10]
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = name or source.stem
    out = out_dir / (f"lib{stem}-{digest}.so" if shared else f"{stem}-{digest}")
    if not out.exists():
        tmp = _private_tmp(out)
        cmd = ["gcc", "-O2", "-g", "-pthread", "-o", str(tmp), str(source)]
        if shared:
            cmd[1:1] = ["-shared", "-fPIC"]
        subprocess.run(cmd + flags, check=True, capture_output=True, text=True)
        tmp.rename(out)
    return out


def nvcc_build(source: Path, *flags: str, name: str, out_dir: Path = BUILD) -> Path:
    """Build a .cu source with the real nvcc (cached by source, flags and
    nvcc's version, like build()); None when nvcc is not installed."""
    nvcc = shutil.which("nvcc") or shutil.which("/usr/local/cuda/bin/nvcc")
    if nvcc is None:
        return None
    source = Path(source)
    version = _nvcc_version(nvcc)
    headers = b"".join(h.read_bytes() for h in sorted(NATIVE.glob("*.h")))
    digest = hashlib.sha1(source.read_bytes() + headers + " ".join(flags).encode()
                          + version.encode()).hexdigest()[:10]
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}-{digest}"
    if not out.exists():
        tmp = _private_tmp(out)
        result = subprocess.run([nvcc, "-o", str(tmp), str(source), *flags],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc {source.name} {' '.join(flags)} failed:\n"
                               f"{result.stderr}")
        tmp.rename(out)
    return out


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    """`nvcc --version`, asked once a session (every lookup of a build asks)."""
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def compile_text(out: Path, source: str, *flags: str, suffix: str = ".c") -> Path:
    """Compile a C (or, with suffix ".cpp", C++) source given as text to
    `out`, unoptimised: the tests read its symbols as written."""
    src = out.with_name(out.name + suffix)
    src.write_text(source)
    compiler = "g++" if suffix == ".cpp" else "gcc"
    subprocess.run([compiler, "-O0", "-o", str(out), str(src), *flags], check=True,
                   capture_output=True)
    return out


def finish(proc: subprocess.Popen, timeout: float = 5.0):
    """End a child that runs until its stdin closes; kill it if it lingers."""
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def workload(name: str) -> Path:
    return build(WORKLOADS / f"{name}.c")
