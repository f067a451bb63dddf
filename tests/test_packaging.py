"""`pip install .` gives a working mmtrace outside the source tree, under the
mmtrace namespace only."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    return target


def run_outside(site, code, tmp_path):
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})


def test_namespace_only(installed, tmp_path):
    top = sorted(p.name for p in installed.iterdir() if not p.name.endswith(".dist-info"))
    assert top == ["bin", "mmtrace"] or top == ["mmtrace"], top
    assert not (installed / "mmtrace" / "__init__.py").exists()   # implicit namespace
    for name in ("agent", "bpf", "detectors", "exporters", "dispatch"):
        assert (installed / "mmtrace" / name / "__init__.py").exists(), name
    assert (installed / "mmtrace" / "bpf" / "sched.c").exists()
    assert (installed / "mmtrace" / "bpf" / "common.h").exists()


def test_cli_runs_from_the_install(installed, tmp_path):
    out = run_outside(installed, "import sys; from mmtrace.agent.cli import cli; "
                      "sys.argv=['mmtrace','--help']; cli()", tmp_path)
    assert out.returncode == 0, out.stderr
    assert "mmtrace record" in out.stdout
    out = run_outside(installed, "import agent", tmp_path)
    assert out.returncode != 0 and "No module named 'agent'" in out.stderr


def test_programs_are_read_from_the_install(installed, tmp_path):
    out = run_outside(installed, "from mmtrace import bpf; print(bpf.SOURCE_DIR)", tmp_path)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(installed)
