"""Shared fixtures; the `bpf` marker's skip-or-fail rule.

Tests marked `bpf` load real eBPF programs. Where this host cannot (not
root, no bcc, no tracefs, no headers) they are skipped with the reason,
except in CI (CI=true), where such a skip is a failure: the eBPF tests must
run there."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Property tests draw the same examples on every run (derandomize), keep no
# example database between runs, and have no per-example deadline (a loaded
# 2-core host is slow, not wrong). MMTRACE_HYPOTHESIS=search draws new ones,
# as bench/fuzz does for the fuzz targets.
settings.register_profile("suite", derandomize=True, database=None, deadline=None,
                          print_blob=True)
settings.register_profile("search", derandomize=False, database=None, deadline=None,
                          print_blob=True)
settings.load_profile(os.environ.get("MMTRACE_HYPOTHESIS", "suite"))

import native  # noqa: E402

VENV_BIN = Path(sys.executable).parent
MMTRACE = VENV_BIN / "mmtrace"


@functools.cache
def bpf_unavailable_reason() -> str | None:
    from mmtrace.agent.doctor import host as doctor
    checks = {c.name: c for c in doctor.run_checks()}
    for name in ("privileges", "tracefs", "bcc", "kernel_headers", "ring_buffer", "uprobes"):
        check = checks.get(name)
        if check is not None and not check.ok:
            return f"{name}: {check.detail} (fix: {check.fix})"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("bpf") is None:
        return
    reason = bpf_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"eBPF test cannot run in CI: {reason}", pytrace=False)
    pytest.skip(f"needs eBPF: {reason}")


@pytest.fixture(scope="session")
def workloads():
    """Compiled C workloads: workloads.path('ctxswitch')."""
    class Workloads:
        @staticmethod
        def path(name):
            return native.workload(name)
    return Workloads()


@pytest.fixture
def mmtrace_cli():
    """Run the installed `mmtrace` console script as a user would."""
    def run(*args, timeout=120, **kwargs):
        return subprocess.run([str(MMTRACE), *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, **kwargs)
    return run
