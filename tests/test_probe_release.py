"""What the probes, discovery and the name caches hold is owned by what it
is about, and goes with it: a file no traced process maps any more is
released (and found again, probed again), at most MAX_PROBED_FILES files
are out at once, exited processes' caches are dropped, and a recording's
meta stays within what its reader keeps, whatever the host did."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from native import compile_text
from mmtrace.agent.kernel.probes import CPU_PROBE_STATE
from mmtrace.agent.discovery.discoverer import Discoverer
from mmtrace.agent.discovery.process_images import LOAD_FRAMES_LAYOUT, ProcessImages
from mmtrace.agent.recording.file_format import MAX_META_BYTES, RecordingReader, RecordingWriter
from mmtrace.agent.recording.meta_budget import (META_BUDGET_BYTES, META_CHUNK_BYTES, MetaBudget,
                                                 fit_meta)
from mmtrace.agent.recording.recorder import SCHEMAS
from mmtrace.agent.discovery.address_resolver import AddressResolver

NEEDS_GCC = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

LIBRARY_C = r"""
int cudaLaunchKernel(const void *f) { return 0; }
int cudaStreamSynchronize(void *s) { return 1; }
int unrelated_helper(void) { return 2; }
"""


def wanted(name: str) -> bool:
    return name in ("cudaLaunchKernel", "cudaStreamSynchronize")


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    return compile_text(tmp_path_factory.mktemp("release") / "libcudart.so.12", LIBRARY_C,
                        "-shared", "-fPIC")


class FakeProc:
    """A /proc tree whose processes map given files; a process exits when
    its folder goes."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir()

    def start(self, pid: int, *files: Path):
        d = self.root / str(pid)
        d.mkdir()
        (d / "root").symlink_to("/")
        lines = [f"{0x7F0000000000 + i * 0x10000:x}-{0x7F0000001000 + i * 0x10000:x} r-xp "
                 f"00000000 08:01 {f.stat().st_ino} {f}\n" for i, f in enumerate(files)]
        (d / "maps").write_text("".join(lines))

    def exit(self, pid: int):
        shutil.rmtree(self.root / str(pid))


def copies(library: Path, folder: Path, n: int) -> list[Path]:
    folder.mkdir(exist_ok=True)
    out = []
    for i in range(n):
        out.append(folder / f"libcopy-{i}.so")
        shutil.copy(library, out[-1])
    return out


def inodes(targets) -> list[int]:
    return sorted(t.inode for t in targets)


# ----- discovery: held, released, found again ------------------------------------

@NEEDS_GCC
def test_a_file_is_released_when_its_last_process_exits_and_probed_again_when_mapped(
        tmp_path, library):
    proc = FakeProc(tmp_path / "proc")
    lib, = copies(library, tmp_path / "libs", 1)
    proc.start(100, lib)
    proc.start(101, lib)
    discoverer = Discoverer(wanted, proc_root=proc.root, search_paths=[])
    assert inodes(discoverer.poll()) == [lib.stat().st_ino]
    proc.exit(100)
    assert discoverer.poll() == [] and discoverer.take_released() == []   # 101 maps it
    proc.exit(101)
    assert discoverer.poll() == []
    assert inodes(discoverer.take_released()) == [lib.stat().st_ino]
    assert discoverer.take_released() == []
    assert discoverer.targets == []
    proc.start(102, lib)
    assert inodes(discoverer.poll()) == [lib.stat().st_ino]
    assert (discoverer.counters["targets"], discoverer.counters["released"]) == (2, 1)


@NEEDS_GCC
def test_a_process_read_only_every_few_polls_keeps_its_files(tmp_path, library):
    proc = FakeProc(tmp_path / "proc")
    lib, = copies(library, tmp_path / "libs", 1)
    proc.start(100, lib)
    discoverer = Discoverer(wanted, proc_root=proc.root, search_paths=[], rescan_every=5)
    assert len(discoverer.poll()) == 1
    for _ in range(12):
        assert discoverer.poll() == []
    assert discoverer.take_released() == []
    assert inodes(discoverer.targets) == [lib.stat().st_ino]


@NEEDS_GCC
def test_an_install_path_holds_its_file_until_the_file_goes(tmp_path, library):
    lib, = copies(library, tmp_path / "lib64", 1)
    inode = lib.stat().st_ino
    discoverer = Discoverer(wanted, pids=[], search_paths=[str(tmp_path / "lib64" / "*.so")])
    assert inodes(discoverer.poll()) == [inode]
    assert discoverer.poll() == [] and discoverer.take_released() == []
    with open(lib, "rb"):       # keep the inode from being reused
        lib.unlink()
        assert discoverer.poll() == []
        assert inodes(discoverer.take_released()) == [inode]


@NEEDS_GCC
def test_over_the_cap_files_wait_and_are_counted_then_probed_as_room_frees(
        tmp_path, library):
    proc = FakeProc(tmp_path / "proc")
    libs = copies(library, tmp_path / "libs", 3)
    for pid, lib in zip((100, 101, 102), libs):
        proc.start(pid, lib)
    discoverer = Discoverer(wanted, proc_root=proc.root, search_paths=[], max_targets=2)
    first = discoverer.poll()
    assert len(first) == 2
    assert (discoverer.counters["over_cap"], discoverer.counters["waiting"]) == (1, 1)
    assert discoverer.poll() == []
    assert discoverer.counters["over_cap"] == 1             # counted once, not per poll
    waiting, = {lib.stat().st_ino for lib in libs} - set(inodes(first))
    leaving = next(pid for pid, lib in zip((100, 101, 102), libs)
                   if lib.stat().st_ino == first[0].inode)
    proc.exit(leaving)
    assert inodes(discoverer.poll()) == [waiting]
    assert inodes(discoverer.take_released()) == [first[0].inode]
    assert discoverer.counters["waiting"] == 0


@NEEDS_GCC
def test_churn_leaves_nothing_remembered_about_the_copies(tmp_path, library):
    """200 copies, each mapped by a process that exits: what discovery
    remembers of files and processes is back to where it was."""
    proc = FakeProc(tmp_path / "proc")
    discoverer = Discoverer(wanted, proc_root=proc.root, search_paths=[])
    discoverer.poll()
    before = discoverer.remembered()
    for i, lib in enumerate(copies(library, tmp_path / "libs", 200)):
        proc.start(1000 + i, lib)
        assert len(discoverer.poll()) == 1
        proc.exit(1000 + i)
        lib.unlink()
    discoverer.poll()
    assert len(discoverer.take_released()) == 200
    assert discoverer.remembered() == before
    assert discoverer.counters["targets"] == 200


# ----- caches of exited processes -------------------------------------------------

STUB_C = r"""
__attribute__((noinline)) void kernel_stub(void) { __asm__ volatile(""); }
"""


@NEEDS_GCC
def test_the_resolver_forgets_processes_that_have_exited(tmp_path):
    stub = compile_text(tmp_path / "libstub.so", STUB_C, "-shared", "-fPIC")
    proc = FakeProc(tmp_path / "proc")
    proc.start(100, stub)
    now = [0.0]
    resolver = AddressResolver(proc.root, clock=lambda: now[0])
    resolver.resolve(100, 0x7F0000000010)           # its maps are read, and kept
    assert resolver.forget_exited() == 0
    proc.exit(100)
    now[0] += 0.5
    assert resolver.forget_exited() == 0            # not yet due: at most every second
    now[0] += AddressResolver.FORGET_EXITED_EVERY_S
    assert resolver.forget_exited() == 1
    assert resolver.forget_exited() == 0


class _FramesTable:
    """load_frames / exe_paths as bcc gives them: a frame record for any pid."""

    def __init__(self, found: bool):
        self.found = found

    def Key(self, pid):
        return pid

    def __getitem__(self, key):
        if not self.found:
            raise KeyError(key)
        import ctypes
        return (ctypes.c_char * LOAD_FRAMES_LAYOUT.itemsize)()


@NEEDS_GCC
def test_build_ids_stay_indexed_after_their_file_goes_for_the_latest_files_only(tmp_path):
    libs = [compile_text(tmp_path / f"lib{i}.so", f"int f{i}(void) {{ return {i}; }}\n",
                         "-shared", "-fPIC", "-Wl,--build-id") for i in range(5)]
    tables = {"load_frames": _FramesTable(True), "exe_paths": _FramesTable(False)}
    known = [str(p) for p in libs]
    images = ProcessImages(tables, lambda: known, max_files=3)
    images.images(100)
    assert images.indexed_files() == 3
    for lib in libs:
        lib.unlink()
    known = []
    images.images(101)
    assert images.indexed_files() == 3


def test_the_images_of_exited_processes_go_their_build_ids_stay(tmp_path):
    lib = compile_text(tmp_path / "lib0.so", "int f0(void) { return 0; }\n", "-shared", "-fPIC",
                       "-Wl,--build-id")
    proc = FakeProc(tmp_path / "proc")
    proc.start(100, lib)
    proc.start(101, lib)
    tables = {"load_frames": _FramesTable(True), "exe_paths": _FramesTable(False)}
    images = ProcessImages(tables, lambda: [str(lib)])
    images.images(100)
    images.images(101)
    proc.exit(100)
    images.forget(proc.root)
    assert [key[0] for key in images._images] == [101]
    assert images.indexed_files() == 1


# ----- a recording's meta ----------------------------------------------------------

def probe_rows(libraries: int, per_library: int = 25) -> list[dict]:
    rows = []
    for i in range(libraries):
        path = f"/tmp/churn/libcopy-{i}.so"
        rows.append({"path": path, "inode": i, "symbol": "cudaLaunchKernel", "api": "launch",
                     "stream": "gpu", "point": "entry", "state": "attached", "reason": "",
                     "count": 1})
        rows += [{"path": path, "inode": i, "symbol": f"cudaSymbol{j}", "api": "x",
                  "stream": "gpu", "point": "entry", "state": "not_found",
                  "reason": "cudart library without this symbol", "count": 1}
                 for j in range(per_library - 1)]
    return rows


def read_meta(path: Path):
    with RecordingReader(path) as rec:
        return rec.meta, rec.warnings


def test_a_flight_meta_over_the_budget_is_trimmed_and_reads_back_whole(tmp_path):
    rows = [[1000 + i, 0x400000 + i, "k" * 200 + str(i)] for i in range(60000)]
    doc = {"apis": [], "probes": [CPU_PROBE_STATE] + probe_rows(2000),
           "op_names": rows, "daemon_pid": 42}
    assert len(json.dumps(doc)) > MAX_META_BYTES
    fitted = fit_meta(doc)
    assert len(json.dumps(fitted, sort_keys=True)) <= META_BUDGET_BYTES
    assert fitted["op_names"][-1] == rows[-1]               # the newest names stay
    assert fitted["omitted"]["op_names"] == len(rows) - len(fitted["op_names"]) > 0
    assert CPU_PROBE_STATE in fitted["probes"]
    folded = [r for r in fitted["probes"] if r.get("state") == "not_found"]
    assert len(folded) == 2000 and {r["count"] for r in folded} == {24}
    writer = RecordingWriter(tmp_path / "f.mmtr", SCHEMAS)
    writer.write_meta(fitted)
    writer.close({})
    meta, warnings = read_meta(tmp_path / "f.mmtr")
    assert warnings == [] and meta[0]["daemon_pid"] == 42
    small = {"probes": [CPU_PROBE_STATE], "op_names": rows[:10]}
    assert fit_meta(small) is small


def test_a_recordings_tables_stay_within_the_budget_in_chunks_the_reader_takes(tmp_path):
    path = tmp_path / "r.mmtr"
    writer = RecordingWriter(path, SCHEMAS)
    budget = MetaBudget(writer)
    for i in range(40):                             # 2000 copies probed, 50 at a time
        budget.table("probes", probe_rows(50))
        budget.symbols({str(k): f"aclnnOp{k}" for k in range(i * 10)})
    for i in range(40):                             # then a flood of kernel names
        budget.table("op_names", [[i, a, "n" * 300] for a in range(2000)])
    assert budget.omitted["probes"] > 0                 # states leave room for names
    assert budget.omitted["op_names"] > 0 and "symbol_names" not in budget.omitted
    writer.close({"meta_omitted": dict(budget.omitted)})
    meta, warnings = read_meta(path)
    assert warnings == []
    sizes = [len(json.dumps(doc, sort_keys=True)) for doc in meta]
    assert max(sizes) <= META_CHUNK_BYTES + 4096
    assert sum(sizes) <= MAX_META_BYTES
    assert [d for d in meta if "symbol_names" in d][-1]["symbol_names"]["389"] == "aclnnOp389"
    kept_names = sum(len(d["op_names"]) for d in meta if "op_names" in d)
    assert kept_names + budget.omitted["op_names"] == 40 * 2000


# ----- the probes themselves (real eBPF) -----------------------------------------

@pytest.mark.bpf
@NEEDS_GCC
def test_released_files_give_back_links_and_descriptors_and_many_links_close_fast(tmp_path):
    import library_churn
    from mmtrace.agent.kernel import probes
    from mmtrace.agent.kernel.probed_file import target_from_path
    from mmtrace.agent.kernel.retired_files import RETIRED_KEEP_S
    from mmtrace.agent.discovery.library_files import LibraryTarget
    built = library_churn.build(tmp_path / "bin")
    now = [0.0]
    loaded = probes.load(probes.ProbeOptions())
    device = loaded.device
    device.clock = lambda: now[0]
    try:
        # One file first: the programs are loaded at the first attach.
        warm = target_from_path(str(copies(built.library, tmp_path / "warm", 1)[0]))
        device.add(warm)
        device.release([warm])
        now[0] += RETIRED_KEEP_S
        device.release([])
        at_rest = library_churn.open_fds(os.getpid())
        libs = copies(built.library, tmp_path / "libs", 100)
        targets = [target_from_path(str(p)) for p in libs]
        for target in targets:
            device.add(target)
        held = device.footprint()
        assert (held["libraries"], held["links"], held["descriptors"]) == (100, 400, 500)
        assert library_churn.open_fds(os.getpid()) - at_rest == 500

        assert device.release(targets[:50] + [warm]) == 50
        held = device.footprint()
        assert (held["libraries"], held["links"], held["retired"]) == (50, 200, 50)
        # Released files stay readable a while, deleted or not: their last events' names.
        for lib in libs[:50]:
            lib.unlink()
        kept = device.decoding_files()
        assert len(kept) == 100
        assert sorted(os.stat(p).st_ino for p in kept[50:]) == \
            sorted(t.inode for t in targets[:50])
        now[0] += RETIRED_KEEP_S
        device.release([])
        assert library_churn.open_fds(os.getpid()) - at_rest == 250
        assert device.counters["released_libraries"] == 51

        missing = LibraryTarget(str(tmp_path / "gone.so"), 1, 12345, frozenset(), "maps:1")
        assert [s.state for s in device.add(missing)] == ["failed"]
        assert any(row["path"] == missing.path for row in device.states())
        device.release([missing])
        assert not any(row["path"] == missing.path for row in device.states())

        gone = LibraryTarget(str(libs[60]), targets[60].dev, targets[60].inode,
                             frozenset(), "maps:999999999")
        device.release([gone])
        device.add(gone)
        assert device.counters["exited_before_attach"] == 1

        # One after another, 200 links took 11 s here (a grace period each).
        began = time.monotonic()
        device.close()
        assert time.monotonic() - began < 5.0
        assert library_churn.open_fds(os.getpid()) - at_rest == 0
    finally:
        loaded.close()


def test_the_launch_probes_flag_turns_once_they_are_attached_or_detached():
    """`launches_attached` is read without the probes' lock (status): it
    says off only when the per-launch probes are detached, on only when
    they are attached, not while either is under way."""
    from mmtrace.agent.kernel.device_probes import DeviceProbes
    probes = DeviceProbes(bpf=None)
    seen = []
    probes.attacher.detach = lambda targets, reason: seen.append(("detach", probes.launches_attached))
    probes.attacher.attach = lambda targets: seen.append(("attach", probes.launches_attached))
    probes.detach_launches()
    assert not probes.launches_attached
    probes.attach_launches()
    assert probes.launches_attached
    assert seen == [("detach", True), ("attach", False)]
