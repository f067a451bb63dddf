"""Library discovery against real processes, a real copy of NVIDIA's
libcudart inside a Python virtual environment, binaries built here, and
fake /proc trees for the failure cases."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from native import compile_text, finish
from mmtrace.agent.discovery.discoverer import Discoverer, find_targets
from mmtrace.agent.discovery.library_files import LibraryTarget
from mmtrace.agent.doctor.runtime_libraries import doctor_checks
from mmtrace.agent.findings import Check
from mmtrace.agent.doctor.host import Host

PYVER = f"python{sys.version_info.major}.{sys.version_info.minor}"
CUDART = (Path(sys.prefix) / "lib" / PYVER / "site-packages" / "nvidia" / "cuda_runtime"
          / "lib" / "libcudart.so.12")
NEEDS_CUDART = pytest.mark.skipif(not CUDART.exists(),
                                  reason="needs the nvidia-cuda-runtime-cu12 wheel")
NEEDS_GCC = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

CUDA_SYMBOLS = {"cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemcpy", "cudaStreamSynchronize",
                "cuLaunchKernel", "cuModuleGetFunction"}
ACLNN = re.compile(r"^aclnn[A-Z]\w*$")


def wanted(name: str) -> bool:
    """What the probe programs ask for: their symbol table plus aclnn phase 2."""
    return name in CUDA_SYMBOLS or (ACLNN.match(name) is not None
                                    and not name.endswith("GetWorkspaceSize"))


STATIC_RUNTIME_C = r"""
#include <stdio.h>
__attribute__((noinline)) int cudaLaunchKernel(const void *f) { __asm__ volatile("" :: "r"(f)); return 0; }
int main(void) { printf("ready\n"); fflush(stdout); while (getchar() != EOF) {} return cudaLaunchKernel(0); }
"""
STAND_IN_C = r"""
int aclnnAdd(void *w, unsigned long n, void *e, void *s) { return 0; }
int aclnnAddGetWorkspaceSize(void *a, void *b, void *c, void *d) { return 0; }
int aclnnMul(void *w, unsigned long n, void *e, void *s) { return 0; }
int cuLaunchKernel(void *f) { return 0; }
int unrelated_helper(void) { return 1; }
"""
WAIT_FOR_STDIN = ("import ctypes, sys\n"
                  "for path in sys.argv[1:]: ctypes.CDLL(path)\n"
                  "print('ready', flush=True)\n"
                  "sys.stdin.read()\n")


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    return compile_text(tmp_path_factory.mktemp("standin") / "libopapi.so", STAND_IN_C,
                     "-shared", "-fPIC")


class Waiting:
    """A child process that reports 'ready' and runs until its stdin closes."""

    def __init__(self, argv):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        assert line.strip() == "ready", f"child said {line!r}"
        self.pid = self.proc.pid

    def stop(self):
        finish(self.proc)


@pytest.fixture
def children():
    started = []
    yield lambda argv: started.append(Waiting(argv)) or started[-1]
    for child in started:
        child.stop()


def make_venv(root: Path) -> tuple[Path, Path]:
    """A virtual environment (pyvenv.cfg, bin/python) holding a copy of the
    real libcudart in the nvidia-cuda-runtime wheel's layout."""
    lib_dir = root / "lib" / PYVER / "site-packages" / "nvidia" / "cuda_runtime" / "lib"
    lib_dir.mkdir(parents=True)
    shutil.copy(CUDART, lib_dir / "libcudart.so.12")
    (root / "bin").mkdir()
    real_python = os.path.realpath(sys.executable)
    (root / "bin" / "python").symlink_to(real_python)
    (root / "pyvenv.cfg").write_text(f"home = {os.path.dirname(real_python)}\n"
                                     "include-system-site-packages = false\n"
                                     f"version = {sys.version.split()[0]}\n")
    return root / "bin" / "python", lib_dir / "libcudart.so.12"


def by_inode(targets: list[LibraryTarget], path: Path) -> list[LibraryTarget]:
    ino = path.stat().st_ino
    return [t for t in targets if t.inode == ino]


# ----- virtual environments and processes started later ----------------------

@NEEDS_CUDART
def test_cudart_in_a_venv_found_once_in_a_process_started_after_the_discoverer(
        tmp_path, children):
    python, cudart = make_venv(tmp_path / "venv")
    discoverer = Discoverer(wanted, search_paths=[])
    assert by_inode(discoverer.poll(), cudart) == []

    child = children([str(python), "-c", WAIT_FOR_STDIN, str(cudart)])
    found = by_inode(discoverer.poll(), cudart)
    assert len(found) == 1
    target = found[0]
    assert target.origin == f"maps:{child.pid}"
    assert target.path == str(cudart)
    assert {"cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize"} <= target.symbols
    assert not target.symbols - CUDA_SYMBOLS
    assert by_inode(discoverer.poll(), cudart) == []
    assert target in discoverer.targets


@NEEDS_CUDART
def test_venv_site_packages_found_before_the_library_is_loaded(tmp_path, children):
    python, cudart = make_venv(tmp_path / "venv")
    child = children([str(python), "-c", WAIT_FOR_STDIN])
    found = by_inode(find_targets(wanted, pids=[child.pid], search_paths=[]), cudart)
    assert [(t.path, t.origin) for t in found] == [(str(cudart), "site-packages")]


LOAD_ON_LINE = ("import ctypes, sys\n"
                "print('ready', flush=True)\n"
                "for line in sys.stdin: ctypes.CDLL(line.strip()); print('loaded', flush=True)\n")


def library_elsewhere(tmp_path: Path, stand_in: Path) -> Path:
    lib = tmp_path / "elsewhere" / "libopapi.so"      # outside every searched path
    lib.parent.mkdir()
    shutil.copy(stand_in, lib)
    return lib


@NEEDS_GCC
def test_a_library_dlopened_later_by_a_known_process_is_found_within_rescan_every_polls(
        tmp_path, stand_in, children):
    lib = library_elsewhere(tmp_path, stand_in)
    child = children([sys.executable, "-c", LOAD_ON_LINE])
    discoverer = Discoverer(wanted, pids=[child.pid], search_paths=[], rescan_every=3)
    assert by_inode(discoverer.poll(), lib) == []
    child.proc.stdin.write(f"{lib}\n")
    child.proc.stdin.flush()
    assert child.proc.stdout.readline().strip() == "loaded"
    polls = [by_inode(discoverer.poll(), lib) for _ in range(3)]
    assert sum(len(p) for p in polls) == 1           # found once, within 3 polls


@NEEDS_GCC
def test_a_discoverer_that_follows_changes_reads_only_the_processes_named(
        tmp_path, stand_in, children):
    from mmtrace.bpf.device import CHANGE_EXIT, CHANGE_LEADER_EXIT, CHANGE_MAPPED
    lib = library_elsewhere(tmp_path, stand_in)
    child = children([sys.executable, "-c", LOAD_ON_LINE])
    other = children([sys.executable, "-c", LOAD_ON_LINE])
    feed: list = []
    discoverer = Discoverer(wanted, pids=[child.pid, other.pid], search_paths=[],
                            rescan_every=1)
    discoverer.follow(lambda: feed.pop(0) if feed else {})
    assert by_inode(discoverer.poll(), lib) == []   # one whole scan: both read
    assert discoverer.counters["maps_read"] == 2
    child.proc.stdin.write(f"{lib}\n")
    child.proc.stdin.flush()
    assert child.proc.stdout.readline().strip() == "loaded"
    assert by_inode(discoverer.poll(), lib) == []   # nothing named: nothing read
    assert discoverer.counters["maps_read"] == 2
    feed.append({child.pid: CHANGE_MAPPED})
    assert [t.origin for t in by_inode(discoverer.poll(), lib)] == [f"maps:{child.pid}"]
    assert discoverer.counters["maps_read"] == 3
    feed.append({child.pid: CHANGE_LEADER_EXIT})    # its first thread only, and it lives:
    discoverer.poll()                               # kept (a kernel without group_dead)
    assert discoverer.take_released() == []
    feed.append({child.pid: CHANGE_EXIT})           # gone: what only it held goes
    discoverer.poll()
    assert [t.path for t in discoverer.take_released()] == [str(lib)]
    feed.append(None)                               # the kernel lost some: all again
    assert [t.origin for t in by_inode(discoverer.poll(), lib)] == [f"maps:{child.pid}"]
    assert discoverer.counters["maps_read"] == 5


@NEEDS_GCC
def test_a_followed_discoverer_reads_at_its_sweep_what_no_note_named(
        tmp_path, stand_in, children, monkeypatch):
    from mmtrace.agent.discovery import process_scan
    from mmtrace.bpf.device import CHANGE_EXIT
    monkeypatch.setattr(process_scan, "SWEEP_EVERY", 4)
    lib = library_elsewhere(tmp_path, stand_in)
    child = children([sys.executable, "-c", LOAD_ON_LINE])
    feed: list = [{}, {child.pid: CHANGE_EXIT}]     # a wrong note: it lives on
    discoverer = Discoverer(wanted, pids=[child.pid], search_paths=[], rescan_every=1)
    discoverer.follow(lambda: feed.pop(0) if feed else {})
    child.proc.stdin.write(f"{lib}\n")
    child.proc.stdin.flush()
    assert child.proc.stdout.readline().strip() == "loaded"
    assert by_inode(discoverer.poll(), lib) != []   # the whole scan after following
    discoverer.poll()
    discoverer.poll()                               # forgotten by the wrong note
    assert str(lib) in [t.path for t in discoverer.take_released()]
    assert by_inode(discoverer.poll(), lib) != []   # poll 4: the sweep reads it again


def test_the_processes_read_are_handed_over_once_and_the_gone_are_not(children):
    alive = children([sys.executable, "-c",
                      "import sys; print('ready', flush=True); sys.stdin.read()"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    discoverer = Discoverer(wanted, pids=[alive.pid, gone.pid], search_paths=[], rescan_every=2)
    discoverer.poll()
    assert discoverer.take_read() == [alive.pid]     # the kernel counts the other's exit
    assert discoverer.take_read() == []
    discoverer.poll()                                # settled: not read this poll
    discoverer.poll()
    assert discoverer.take_read() == [alive.pid]     # read again: its mark is renewed


@NEEDS_GCC
def test_a_known_process_that_execs_a_traced_program_is_read_again_at_once(tmp_path, children):
    exe = compile_text(tmp_path / "encoder_server", STATIC_RUNTIME_C)
    # A launcher (sh here) that exec()s the server under its own pid.
    child = children(["sh", "-c", 'echo ready; read line; exec "$0"', str(exe)])
    discoverer = Discoverer(wanted, pids=[child.pid], search_paths=[], rescan_every=1000)
    assert by_inode(discoverer.poll(), exe) == []
    child.proc.stdin.write("go\n")
    child.proc.stdin.flush()
    assert child.proc.stdout.readline().strip() == "ready"      # the server's own line
    assert [t.origin for t in by_inode(discoverer.poll(), exe)] == [f"maps:{child.pid}"]


@NEEDS_GCC
def test_runtime_linked_into_an_executable_is_found(tmp_path, children):
    exe = compile_text(tmp_path / "encoder_server", STATIC_RUNTIME_C)
    dynsym = subprocess.run(["nm", "-D", "--defined-only", str(exe)], capture_output=True,
                            text=True).stdout
    assert "cudaLaunchKernel" not in dynsym     # only .symtab has it
    child = children([str(exe)])
    found = by_inode(find_targets(wanted, pids=[child.pid], search_paths=[]), exe)
    assert found == [LibraryTarget(str(exe), exe.stat().st_dev, exe.stat().st_ino,
                                   frozenset({"cudaLaunchKernel"}), f"maps:{child.pid}")]


# ----- one target per inode -------------------------------------------------------

@NEEDS_GCC
def test_links_and_several_processes_give_one_target(tmp_path, stand_in, children):
    lib = tmp_path / "libopapi.so"
    shutil.copy(stand_in, lib)
    (tmp_path / "libopapi_link.so").symlink_to(lib)
    os.link(lib, tmp_path / "libopapi_hard.so")
    a = children([sys.executable, "-c", WAIT_FOR_STDIN, str(tmp_path / "libopapi_link.so")])
    b = children([sys.executable, "-c", WAIT_FOR_STDIN, str(tmp_path / "libopapi_hard.so")])
    targets = find_targets(wanted, pids=[a.pid, b.pid],
                           search_paths=[str(tmp_path / "*.so")])
    mine = by_inode(targets, lib)
    assert len(mine) == 1
    assert mine[0].symbols == {"aclnnAdd", "aclnnMul", "cuLaunchKernel"}
    assert mine[0].origin == f"maps:{a.pid}"


@NEEDS_GCC
def test_a_file_replaced_on_disk_is_returned_again(tmp_path, stand_in):
    lib_dir = tmp_path / "lib64"
    lib_dir.mkdir()
    lib = lib_dir / "libopapi.so"
    shutil.copy(stand_in, lib)
    discoverer = Discoverer(wanted, pids=[], search_paths=[str(lib_dir / "*.so*")])
    first = discoverer.poll()
    assert [t.inode for t in first] == [lib.stat().st_ino]
    assert discoverer.poll() == []
    # Hold the old inode, as a process mapping it would, so it is not reused.
    with open(lib, "rb"):
        shutil.copy(stand_in, lib_dir / "new")
        os.replace(lib_dir / "new", lib)
        second = discoverer.poll()
    assert [t.inode for t in second] == [lib.stat().st_ino]
    assert second[0].inode != first[0].inode
    assert discoverer.poll() == []
    assert discoverer.counters["targets"] == 2


# ----- fake /proc trees -------------------------------------------------------------

def fake_process(proc: Path, pid: int, maps_lines: list[str], root: str = "/") -> Path:
    d = proc / str(pid)
    d.mkdir(parents=True)
    (d / "root").symlink_to(root)
    (d / "maps").write_text("".join(line + "\n" for line in maps_lines))
    return d


def maps_line(start: int, path: Path | str, inode: int | None = None) -> str:
    if inode is None:
        inode = Path(path).stat().st_ino
    return f"{start:x}-{start + 0x1000:x} r-xp 00000000 08:01 {inode} {path}"


@NEEDS_GCC
def test_unreadable_and_odd_proc_entries_are_counted(tmp_path, stand_in):
    proc = tmp_path / "proc"
    text = tmp_path / "locale-archive"
    text.write_text("not ELF")
    truncated = tmp_path / "libtruncated.so"
    truncated.write_bytes(stand_in.read_bytes()[:200])
    fake_process(proc, 100, [maps_line(0x7F0000000000, "/nonexistent/libcudart.so.12", 99)])
    (proc / "101").mkdir()
    (proc / "101" / "maps").mkdir()                  # unreadable even for root
    (proc / "102").mkdir()                           # gone: no maps any more
    fake_process(proc, 103, [maps_line(0x7F0000000000, stand_in),
                             maps_line(0x7F0000002000, stand_in),    # same file again
                             maps_line(0x7F1000000000, text),
                             maps_line(0x7F2000000000, truncated),
                             "7f3000000000-7f3000001000 rw-p 00000000 00:00 0",
                             maps_line(0x7F4000000000, "/usr/lib/libgone.so (deleted)", 5),
                             "garbage that is not a maps line"])
    (proc / "self").symlink_to("103")
    discoverer = Discoverer(wanted, proc_root=proc, search_paths=[])
    targets = discoverer.poll()
    assert [(t.path, t.origin) for t in targets] == [(str(stand_in), "maps:103")]
    reasons = ("missing_file", "unreadable_proc", "vanished", "not_elf", "elf_unreadable",
               "deleted_mapping", "maps_malformed_lines")
    assert [discoverer.counters[r] for r in reasons] == [1] * len(reasons)
    assert discoverer.poll() == []
    # Counted once per process or file, not once per poll.
    assert [discoverer.counters[r] for r in reasons] == [1] * len(reasons)


@NEEDS_GCC
def test_files_inside_a_container_are_reached_through_proc_root(tmp_path, stand_in):
    rootfs = tmp_path / "rootfs"
    inside = rootfs / "usr" / "local" / "Ascend" / "lib64" / "libopapi.so"
    inside.parent.mkdir(parents=True)
    shutil.copy(stand_in, inside)
    proc = tmp_path / "proc"
    fake_process(proc, 200, [maps_line(0x7F0000000000, "/usr/local/Ascend/lib64/libopapi.so",
                                       inside.stat().st_ino)], root=str(rootfs))
    targets = find_targets(wanted, proc_root=proc, search_paths=[])
    assert [(t.path, t.inode, t.origin) for t in targets] == \
        [(f"{proc}/200/root/usr/local/Ascend/lib64/libopapi.so", inside.stat().st_ino,
          "maps:200")]


@NEEDS_GCC
def test_site_packages_of_a_containerised_python(tmp_path, stand_in):
    rootfs = tmp_path / "rootfs"
    site = rootfs / "opt" / "venv" / "lib" / PYVER / "site-packages"
    wheel_lib = site / "nvidia" / "cuda_runtime" / "lib"
    wheel_lib.mkdir(parents=True)
    shutil.copy(stand_in, wheel_lib / "libcudart.so.12")
    (rootfs / "opt" / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (rootfs / "opt" / "venv" / "bin").mkdir()
    proc = tmp_path / "proc"
    d = fake_process(proc, 300, [maps_line(0x55D000000000, f"/usr/bin/{PYVER}", 12)],
                     root=str(rootfs))
    (d / "cmdline").write_bytes(b"/opt/venv/bin/python\0serve.py\0")
    (d / "environ").write_bytes(b"PATH=/usr/bin\0")
    targets = find_targets(wanted, proc_root=proc, search_paths=[])
    assert [(t.path, t.origin) for t in targets] == \
        [(f"{proc}/300/root/opt/venv/lib/{PYVER}/site-packages/nvidia/cuda_runtime/lib/"
          "libcudart.so.12", "site-packages")]


# ----- --lib and install paths ---------------------------------------------------------

@NEEDS_GCC
def test_extra_paths(tmp_path, stand_in):
    targets = find_targets(wanted, pids=[], extra_paths=[stand_in], search_paths=[])
    assert [(t.path, t.origin, t.symbols) for t in targets] == \
        [(str(stand_in), "--lib", frozenset({"aclnnAdd", "aclnnMul", "cuLaunchKernel"}))]
    discoverer = Discoverer(lambda name: name == "nothing", pids=[], extra_paths=[stand_in],
                            search_paths=[])
    assert discoverer.poll() == []
    assert discoverer.counters["lib_without_wanted_symbols"] == 1


def test_bad_extra_paths_are_refused_with_the_reason(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    cases = {tmp_path / "missing.so": "no such file", tmp_path: "not a regular file",
             notes: "not an ELF file"}
    for path, reason in cases.items():
        with pytest.raises(ValueError, match=rf"--lib {re.escape(str(path))}: {reason}"):
            find_targets(wanted, pids=[], extra_paths=[path], search_paths=[])


@NEEDS_GCC
def test_poll_if_due_waits_for_the_interval(tmp_path, stand_in):
    now = [0.0]
    discoverer = Discoverer(wanted, pids=[], search_paths=[str(stand_in)], interval_s=2.0,
                            clock=lambda: now[0])
    assert len(discoverer.poll_if_due()) == 1
    shutil.copy(stand_in, tmp_path / "libopapi.so")
    discoverer.search_paths = (str(stand_in), str(tmp_path / "libopapi.so"))
    now[0] = 1.0
    assert discoverer.poll_if_due() == []
    now[0] = 1.79
    assert discoverer.poll_if_due() == []
    now[0] = 1.99            # a wake a few ms early still polls
    assert [t.path for t in discoverer.poll_if_due()] == [str(tmp_path / "libopapi.so")]


# ----- mmtrace doctor ---------------------------------------------------------------

@NEEDS_CUDART
@NEEDS_GCC
def test_doctor_checks_name_what_they_found(tmp_path, stand_in):
    (tmp_path / "proc").mkdir()
    libs = tmp_path / "libs"
    libs.mkdir()
    shutil.copy(CUDART, libs / "libcudart.so.12")
    shutil.copy(stand_in, libs / "libcuda.so.1")
    shutil.copy(stand_in, libs / "libopapi.so")
    checks = doctor_checks(Host(proc=tmp_path / "proc"), search_paths=[str(libs / "*")])
    by_name = {c.name: c for c in checks}
    assert list(by_name) == ["cuda_runtime", "cuda_driver", "nvml", "ascend_cann"]
    assert all(isinstance(c, Check) and not c.required for c in checks)
    assert by_name["cuda_runtime"].ok and str(libs / "libcudart.so.12") in \
        by_name["cuda_runtime"].detail
    assert by_name["cuda_driver"].ok and "libcuda.so.1" in by_name["cuda_driver"].detail
    assert not by_name["ascend_cann"].ok and "no libascendcl" in by_name["ascend_cann"].detail
    nvml = by_name["nvml"]
    assert nvml.ok or (nvml.fix and "nvml" in nvml.detail.lower())

    empty = {c.name: c for c in doctor_checks(Host(proc=tmp_path / "proc"), search_paths=[])}
    assert not empty["cuda_runtime"].ok and "--lib" in empty["cuda_runtime"].fix
    assert not empty["cuda_driver"].ok and empty["cuda_driver"].fix
