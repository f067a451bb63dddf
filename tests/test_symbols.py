"""ELF symbols, demangling and address resolution against real files built
here with gcc/g++, NVIDIA's real libcudart and live child processes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from native import compile_text, finish
from mmtrace.agent.discovery.address_resolver import AddressResolver
from mmtrace.agent.discovery.demangle import demangle
from mmtrace.agent.discovery.elf_cache import ElfCache
from mmtrace.agent.discovery.elf_reader import ElfError, NotElfError
from mmtrace.agent.discovery.elf_symbols import ElfSymbols
from mmtrace.agent.discovery.proc_maps import parse_maps

NEEDS_GCC = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("g++")),
                               reason="needs gcc and g++ to build test binaries")
CUDART = (Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
          / "site-packages" / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12")
NEEDS_CUDART = pytest.mark.skipif(not CUDART.exists(),
                                  reason="needs the nvidia-cuda-runtime-cu12 wheel")

STUBS_C = r"""
#include <stdio.h>
__attribute__((noinline)) void vision_encoder_stub(void) { __asm__ volatile(""); }
void __vision_encoder_alias(void) __attribute__((alias("vision_encoder_stub")));
__attribute__((noinline)) void text_decoder_stub(int n) { __asm__ volatile("" :: "r"(n)); }
__attribute__((noinline, visibility("hidden"))) void hidden_helper(void) { __asm__ volatile(""); }
static __attribute__((noinline, used)) void local_helper(void) { __asm__ volatile(""); }
void print_lib_addresses(void) {
    printf("vision_encoder_stub|%p\n", (void *)vision_encoder_stub);
    printf("text_decoder_stub|%p\n", (void *)text_decoder_stub);
    printf("hidden_helper|%p\n", (void *)hidden_helper);
    printf("local_helper|%p\n", (void *)local_helper);
}
"""

ENCODERS_CPP = r"""
#include <cstdio>
namespace vision { namespace kernels {
template <typename T, int N> __attribute__((noinline)) void patch_embed(T *x) {
    __asm__ volatile("" :: "r"(x));
}
template void patch_embed<float, 16>(float *);
template void patch_embed<double, 8>(double *);
struct Attention { static void forward(const float *q, int heads); };
void Attention::forward(const float *q, int heads) { __asm__ volatile("" :: "r"(q), "r"(heads)); }
}}
extern "C" void print_cpp_addresses(void) {
    std::printf("void vision::kernels::patch_embed<float, 16>(float*)|%p\n",
                (void *)&vision::kernels::patch_embed<float, 16>);
    std::printf("void vision::kernels::patch_embed<double, 8>(double*)|%p\n",
                (void *)&vision::kernels::patch_embed<double, 8>);
    std::printf("vision::kernels::Attention::forward(float const*, int)|%p\n",
                (void *)&vision::kernels::Attention::forward);
}
"""

# An executable that carries its own cudaLaunchKernel, as one linked
# statically against cudart does; no -rdynamic, so only .symtab has it.
MAIN_C = r"""
#include <stdio.h>
void print_lib_addresses(void);
void print_cpp_addresses(void);
__attribute__((noinline)) int cudaLaunchKernel(const void *f, int grid) {
    __asm__ volatile("" :: "r"(f), "r"(grid)); return 0;
}
__attribute__((noinline)) void LONG_NAME(void) { __asm__ volatile(""); }
int main(void) {
    printf("cudaLaunchKernel|%p\n", (void *)cudaLaunchKernel);
    printf("LONG_NAME|%p\n", (void *)LONG_NAME);
    print_lib_addresses();
    print_cpp_addresses();
    printf("done|0\n");
    fflush(stdout);
    while (getchar() != EOF) {}
    return 0;
}
"""
LONG_NAME = "encoder_" + "x" * 5000


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if not (shutil.which("gcc") and shutil.which("g++")):
        pytest.skip("needs gcc and g++")
    d = tmp_path_factory.mktemp("symbols")
    stubs = compile_text(d / "libstubs.so", STUBS_C, "-shared", "-fPIC")
    encoders = compile_text(d / "libencoders.so", ENCODERS_CPP, "-shared", "-fPIC", suffix=".cpp")
    main = compile_text(d / "launcher", MAIN_C.replace("LONG_NAME", LONG_NAME),
                        f"-L{d}", "-lstubs", "-lencoders", "-lstdc++", f"-Wl,-rpath,{d}")
    return {"dir": d, "stubs": stubs, "encoders": encoders, "main": main}


class Child:
    """A running test binary that printed `label|address` lines."""

    def __init__(self, argv, env=None):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self.addresses = {}
        for line in self.proc.stdout:
            label, _, addr = line.rstrip("\n").rpartition("|")
            if label == "done":
                break
            self.addresses[label] = int(addr, 16)
        assert self.addresses, "the child printed no addresses"

    @property
    def pid(self):
        return self.proc.pid

    def stop(self):
        finish(self.proc)


@pytest.fixture
def child(built):
    c = Child([str(built["main"])])
    yield c
    c.stop()


def nm_defined(path, dynamic: bool) -> dict[str, tuple[int, int, str]]:
    """name -> (value, size, type letter) as binutils' nm reports them."""
    args = ["nm", "-S", "--defined-only"] + (["-D"] if dynamic else []) + [str(path)]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    result = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4:
            value, size, kind, name = parts
            result[name.split("@")[0]] = (int(value, 16), int(size, 16), kind)
    return result


# ----- which functions a file defines --------------------------------------

@NEEDS_CUDART
def test_dynamic_functions_of_the_real_cudart_match_nm():
    expected = {name for name, (_, _, kind) in nm_defined(CUDART, dynamic=True).items()
                if kind in "TWi"}
    got = ElfSymbols.read(CUDART).defined_dynamic_functions()
    assert got == expected
    assert {"cudaLaunchKernel", "cudaLaunchKernel_ptsz", "cudaLaunchKernelExC",
            "cudaGraphLaunch", "cudaMemcpyAsync", "cudaStreamSynchronize"} <= got
    assert not any("@" in name for name in got)


@NEEDS_GCC
def test_defined_functions_exclude_undefined_hidden_and_local(built):
    elf = ElfSymbols.read(built["stubs"])
    dynamic = elf.defined_dynamic_functions()
    assert {"vision_encoder_stub", "text_decoder_stub", "print_lib_addresses"} <= dynamic
    assert "printf" not in dynamic              # imported, not defined
    assert "hidden_helper" not in dynamic and "local_helper" not in dynamic
    assert "hidden_helper" not in elf.defined_functions()


@NEEDS_GCC
def test_static_runtime_in_an_executable_is_found_in_symtab_only(built):
    elf = ElfSymbols.read(built["main"])
    assert "cudaLaunchKernel" not in elf.defined_dynamic_functions()
    assert "cudaLaunchKernel" in elf.defined_functions()
    assert "main" in elf.defined_functions()


@NEEDS_GCC
@pytest.mark.parametrize("prefixes", [("cu", "ac", "__"), ("vision", "te"), ("zz",), ("m",)])
def test_functions_by_prefix_are_exactly_the_defined_functions_that_start_so(built, prefixes):
    files = [built["stubs"], built["main"], Path(sys.executable)]
    if CUDART.exists():
        files.append(CUDART)
    for path in files:
        elf = ElfSymbols.read(path)
        want = {n for n in elf.defined_functions(local=True) if n.startswith(prefixes)}
        assert ElfSymbols.read(path).defined_functions_starting(prefixes) == want, path
    if CUDART.exists():
        assert "cudaLaunchKernel" in ElfSymbols.read(CUDART).defined_functions_starting(("cu",))


@NEEDS_GCC
def test_local_functions_build_id_and_needed_libraries(built):
    """What nvcc's static runtime looks like once linked (its API local),
    and what names a file besides its symbols, checked against binutils."""
    stubs = ElfSymbols.read(built["stubs"])
    assert "local_helper" not in stubs.defined_functions()
    assert {"local_helper", "hidden_helper"} <= stubs.defined_functions(local=True)
    assert stubs.defines("local_helper") and stubs.defines("vision_encoder_stub")
    assert not stubs.defines("printf")
    main = ElfSymbols.read(built["main"])
    notes = subprocess.run(["readelf", "-n", str(built["main"])], check=True,
                           capture_output=True, text=True).stdout
    build_ids = [line.split()[-1] for line in notes.splitlines() if "Build ID" in line]
    assert [main.build_id.hex()] == build_ids
    dynamic = subprocess.run(["readelf", "-d", str(built["main"])], check=True,
                             capture_output=True, text=True).stdout
    assert list(main.needed) == [line.split("[")[1].rstrip("]") for line in
                                 dynamic.splitlines() if "(NEEDED)" in line]
    assert {"libstubs.so", "libencoders.so"} <= set(main.needed)
    assert {".text", ".symtab", ".dynamic"} <= main.section_names and main.has_symbol_table


@NEEDS_GCC
def test_version_suffixes_are_stripped(tmp_path):
    script = tmp_path / "vers.map"
    script.write_text("LIBDEMO_1 { global: demo_launch; local: *; };\n")
    lib = compile_text(tmp_path / "libvers.so", "void demo_launch(void) {}\n", "-shared",
                       "-fPIC", f"-Wl,--version-script={script}")
    assert "demo_launch@@LIBDEMO_1" in subprocess.run(
        ["nm", "-D", str(lib)], capture_output=True, text=True).stdout
    assert ElfSymbols.read(lib).defined_dynamic_functions() == {"demo_launch"}


# ----- which function an address is in -------------------------------------

@NEEDS_GCC
def test_function_at_agrees_with_nm_sizes(built):
    elf = ElfSymbols.read(built["stubs"])
    table = nm_defined(built["stubs"], dynamic=False)
    for name in ("vision_encoder_stub", "text_decoder_stub", "hidden_helper", "local_helper"):
        value, size, _ = table[name]
        assert size > 0
        assert elf.function_at(value) == name
        assert elf.function_at(value + size - 1) == name
        assert elf.function_at(value + size) != name
    # Of two names for one address the one without leading underscores wins.
    assert table["__vision_encoder_alias"][0] == table["vision_encoder_stub"][0]
    batch = elf.functions_at(np.array([table["vision_encoder_stub"][0], 0, 1 << 63],
                                      dtype=np.uint64))
    assert batch == ["vision_encoder_stub", None, None]


@NEEDS_CUDART
def test_runtime_address_to_vaddr_through_segments():
    elf = ElfSymbols.read(CUDART)
    value = nm_defined(CUDART, dynamic=True)["cudaLaunchKernel"][0]
    base = 0x7F00_0000_0000
    assert elf.segments.load_bias(base, 0) == base
    vaddr = elf.segments.runtime_to_vaddr(base + value + 4, base, 0)
    assert vaddr == value + 4
    assert elf.function_at(vaddr) == "cudaLaunchKernel"
    # The writable segment sits at vaddr 0x2b0000 but file offset 0xb0000: the
    # bias comes from the segment, not from the mapping's start alone.
    assert elf.segments.vaddr_of_offset(0xB0010) == 0x2B0010
    assert elf.segments.vaddr_of_offset(10 ** 9) is None


# ----- damaged files -----------------------------------------------------------

@NEEDS_CUDART
def test_truncated_and_non_elf_files_raise_errors_that_name_the_file(tmp_path):
    truncated = tmp_path / "libcudart.so.12"
    truncated.write_bytes(CUDART.read_bytes()[:4096])
    with pytest.raises(ElfError, match=r"libcudart\.so\.12.*truncated"):
        ElfSymbols.read(truncated)
    text = tmp_path / "notes.txt"
    text.write_text("not a library at all\n")
    with pytest.raises(NotElfError, match=r"notes\.txt: expected an ELF file"):
        ElfSymbols.read(text)
    empty = tmp_path / "empty.so"
    empty.write_bytes(b"")
    with pytest.raises(NotElfError):
        ElfSymbols.read(empty)


@NEEDS_GCC
def test_garbage_symbol_names_are_readable_strings(tmp_path):
    lib = compile_text(tmp_path / "libgarbage.so",
                       "void zzgarbagezz_marker(void) {}\nvoid plain_one(void) {}\n",
                       "-shared", "-fPIC")
    data = lib.read_bytes()
    assert data.count(b"zzgarbagezz") >= 1
    lib.write_bytes(data.replace(b"zzgarbagezz", b"\xff\xfe\x80garbag\xc3("))
    elf = ElfSymbols.read(lib)
    names = elf.defined_dynamic_functions()
    assert "plain_one" in names
    garbled = [n for n in names if n.endswith("_marker")]
    assert len(garbled) == 1 and isinstance(garbled[0], str) and "\\xff" in garbled[0]
    assert demangle(garbled[0]) == garbled[0]


@NEEDS_GCC
@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1,
                max_size=8))
def test_corrupted_elf_files_raise_elf_error_or_parse(built, tmp_path_factory, flips):
    data = bytearray(built["stubs"].read_bytes())
    # Damage the headers and tables: offsets into the first bytes and the
    # section header table at the end, where the numbers that steer parsing live.
    for where, value in flips:
        at = where % 64 if where & 1 else len(data) - 1 - where % 1024
        data[at] = value
    path = tmp_path_factory.mktemp("fuzz") / "libcorrupt.so"
    path.write_bytes(bytes(data))
    try:
        elf = ElfSymbols.read(path)
    except ElfError:
        return
    everything = elf.defined_functions(local=True)
    assert elf.defined_functions_starting(("vi", "_", "m")) == {
        n for n in everything if n.startswith(("vi", "_", "m"))}
    elf.functions_at(np.arange(0, 0x3000, 7, dtype=np.uint64))
    elf.segments.vaddrs_of_offsets(np.arange(0, 0x3000, 7, dtype=np.uint64))


@NEEDS_GCC
def test_open_caches_per_inode_and_sees_replacement(tmp_path, built):
    lib = tmp_path / "libstubs.so"
    shutil.copy(built["stubs"], lib)
    (tmp_path / "link.so").symlink_to(lib)
    os.link(lib, tmp_path / "hard.so")
    cache = ElfCache()
    first = cache.open(lib)
    assert cache.open(tmp_path / "link.so") is first
    assert cache.open(tmp_path / "hard.so") is first
    replacement = tmp_path / "new.so"
    shutil.copy(built["encoders"], replacement)
    os.replace(replacement, lib)
    again = cache.open(lib)
    assert again is not first
    assert "print_cpp_addresses" in again.defined_dynamic_functions()


# ----- C++ names -----------------------------------------------------------------

def test_demangle_known_names():
    assert demangle("_ZN6vision7kernels11patch_embedIfLi16EEEvPT_") == \
        "void vision::kernels::patch_embed<float, 16>(float*)"
    assert demangle("_ZN6vision7kernels9Attention7forwardEPKfi") == \
        "vision::kernels::Attention::forward(float const*, int)"
    assert demangle("_Z3foov.cold") == "foo() [clone .cold]"
    for plain in ("cudaLaunchKernel", "aclnnAdd", "", "_Z", "_Zgarbage((", "_Z" + "N" * 40000):
        assert demangle(plain) == plain


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300).map(lambda s: "_Z" + s) | st.text(max_size=300))
def test_demangle_never_fails(name):
    out = demangle(name)
    assert isinstance(out, str)
    if not name.startswith("_Z"):
        assert out == name


# ----- live processes ---------------------------------------------------------------

@NEEDS_GCC
def test_resolves_functions_of_a_running_process(child):
    resolver = AddressResolver()
    # The launcher labels each address with the function's own name.
    expected = {label: label for label in child.addresses}
    expected[LONG_NAME] = LONG_NAME[:4095] + "\u2026"
    for label, addr in child.addresses.items():
        assert resolver.resolve(child.pid, addr) == expected[label], label[:80]
        assert resolver.resolve(child.pid, addr + 1) == expected[label], label[:80]
    assert resolver.counters["name_truncated"] == 2
    assert resolver.counters["resolved"] == 2 * len(child.addresses)


@NEEDS_GCC
def test_resolve_many_matches_single_lookups_and_counts_misses(child):
    resolver = AddressResolver()
    labels = list(child.addresses)
    addrs = np.array([child.addresses[k] for k in labels] + [0x10], dtype=np.uint64)
    names = resolver.resolve_many(child.pid, addrs)
    assert names[:-1] == [AddressResolver().resolve(child.pid, int(a)) for a in addrs[:-1]]
    assert names[-1] is None
    assert resolver.counters["no_mapping"] == 1
    assert resolver.resolve_many(child.pid, np.zeros(0, dtype=np.uint64)) == []


@NEEDS_GCC
def test_heap_addresses_are_not_file_backed(child):
    resolver = AddressResolver()
    maps = (Path("/proc") / str(child.pid) / "maps").read_text().splitlines()
    heap = [line for line in maps if line.endswith("[heap]") or line.endswith("[stack]")]
    start = int(heap[0].split("-")[0], 16)
    assert resolver.resolve(child.pid, start + 8) is None
    assert resolver.counters["not_file_backed"] == 1


@NEEDS_GCC
def test_replaced_library_still_resolves_through_map_files(tmp_path, built):
    lib_dir = tmp_path / "libs"
    lib_dir.mkdir()
    for name in ("stubs", "encoders"):
        shutil.copy(built[name], lib_dir / f"lib{name}.so")
    shutil.copy(built["main"], tmp_path / "launcher")
    # LD_LIBRARY_PATH is searched before the launcher's DT_RUNPATH.
    env = dict(os.environ, LD_LIBRARY_PATH=str(lib_dir))
    c = Child([str(tmp_path / "launcher")], env=env)
    try:
        victim = lib_dir / "libstubs.so"
        assert str(victim) in (Path("/proc") / str(c.pid) / "maps").read_text()
        (lib_dir / "replacement").write_bytes(b"garbage, not ELF")
        os.replace(lib_dir / "replacement", victim)
        resolver = AddressResolver()
        assert resolver.resolve(c.pid, c.addresses["vision_encoder_stub"]) == \
            "vision_encoder_stub"
    finally:
        c.stop()


def test_vanished_process_is_counted_not_raised():
    gone = subprocess.Popen(["true"])
    gone.wait()
    resolver = AddressResolver()
    assert resolver.resolve(gone.pid, 0x400000) is None
    assert resolver.resolve_many(gone.pid, np.array([1, 2], dtype=np.uint64)) == [None, None]
    assert resolver.counters["process_gone"] == 2
    assert resolver.resolve(gone.pid, -1) is None


# ----- fake /proc trees ------------------------------------------------------------------

def fake_process(proc_root: Path, pid: int, maps_lines: list[str]) -> Path:
    d = proc_root / str(pid)
    d.mkdir(parents=True)
    (d / "root").symlink_to("/")
    (d / "maps").write_text("".join(line + "\n" for line in maps_lines))
    return d


@NEEDS_GCC
def test_gone_process_resolves_from_the_files_its_load_frames_name(built, tmp_path):
    """A frame the kernel kept (address, and build id + file offset) gives
    its file's load bias; the process's other addresses in that file are
    then named from the file on disk, the process long gone."""
    from mmtrace.agent.discovery.process_images import LOAD_FRAMES_LAYOUT, frame_biases
    elf = ElfSymbols.read(built["main"])
    launch, _, _ = nm_defined(built["main"], dynamic=False)["cudaLaunchKernel"]
    main, _, _ = nm_defined(built["main"], dynamic=False)["main"]
    bias = 0x5555_0000_0000
    frames = np.zeros(1, LOAD_FRAMES_LAYOUT)[0]
    frames["ips"][:2] = [bias + launch, 0x7F00_0000_1234]     # the second: a file unknown
    frames["ids"]["status"][:2] = [1, 1]
    frames["ids"]["build_id"][0] = elf.build_id.ljust(20, b"\0")
    frames["ids"]["build_id"][1] = b"\x42" * 20
    frames["ids"]["offset"][0] = elf.segments.offset_of_vaddr(launch)
    frames["ips_bytes"], frames["ids_bytes"] = 16, 64
    found = frame_biases(frames, {elf.build_id: elf}.get)
    assert [(b, e.path) for b, e in found] == [(bias, elf.path)]

    class Images:
        def images(self, pid):
            return found
    resolver = AddressResolver(tmp_path, images=Images())    # no /proc: every pid is gone
    names = resolver.resolve_many(4242, np.array([bias + main + 1, bias + launch, 0x10],
                                                 np.uint64))
    assert names == ["main", "cudaLaunchKernel", None]
    assert resolver.counters["resolved_after_exit"] == 2
    assert resolver.counters["unresolved_after_exit"] == 1


@NEEDS_CUDART
def test_fake_proc_failures_are_counted(tmp_path):
    proc = tmp_path / "proc"
    truncated = tmp_path / "libtrunc.so"
    truncated.write_bytes(CUDART.read_bytes()[:3000])
    text = tmp_path / "data.bin"
    text.write_text("hello")
    value = nm_defined(CUDART, dynamic=True)["cudaMemcpyAsync"][0]
    fake_process(proc, 10, [
        f"7f0000000000-7f0000100000 r-xp 00000000 08:01 {CUDART.stat().st_ino} {CUDART}",
        f"7f1000000000-7f1000001000 r-xp 00000000 08:01 77 /nonexistent/libgone.so",
        f"7f2000000000-7f2000001000 r-xp 00000000 08:01 {truncated.stat().st_ino} {truncated}",
        f"7f3000000000-7f3000001000 r--p 00000000 08:01 {text.stat().st_ino} {text}",
        "this line is garbage",
    ])
    (proc / "11").mkdir()
    (proc / "11" / "maps").mkdir()            # unreadable: a directory, even for root
    resolver = AddressResolver(proc_root=proc)
    assert resolver.resolve(10, 0x7F0000000000 + value) == "cudaMemcpyAsync"
    assert resolver.resolve(10, 0x7F1000000010) is None
    assert resolver.resolve(10, 0x7F2000000010) is None
    assert resolver.resolve(10, 0x7F3000000010) is None
    assert resolver.resolve(11, 0x7F3000000010) is None
    assert resolver.resolve(12, 0x7F3000000010) is None
    c = resolver.counters
    assert (c["resolved"], c["file_missing"], c["elf_unreadable"], c["not_elf"],
            c["maps_unreadable"], c["process_gone"], c["maps_malformed_lines"]) == \
        (1, 1, 1, 1, 1, 1, 1)


def test_maps_refresh_on_miss_is_rate_limited(tmp_path):
    proc = tmp_path / "proc"
    d = fake_process(proc, 20, [])
    now = [100.0]
    resolver = AddressResolver(proc_root=proc, refresh_interval_s=1.0, clock=lambda: now[0])
    assert resolver.resolve(20, 0x1000) is None
    (d / "maps").write_text(f"0000-2000 r-xp 00000000 00:00 0 \n")
    assert resolver.resolve(20, 0x1000) is None          # within the interval: no re-read
    assert resolver.counters["no_mapping"] == 2
    now[0] += 2
    assert resolver.resolve(20, 0x1000) is None          # re-read: now anonymous code
    assert resolver.counters["not_file_backed"] == 1


def test_parse_maps_keeps_spaces_and_deleted_marks():
    data = (b"55d0c0a00000-55d0c0a01000 r-xp 00001000 fd:01 123   /opt/my libs/lib x.so\n"
            b"7f0000000000-7f0000001000 r-xp 00000000 fd:01 456 /usr/lib/old.so (deleted)\n"
            b"7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                  [stack]\n"
            b"7fff00000000-7fff00001000 rw-p 00000000 00:00 0\n"
            b"nonsense\n")
    maps = parse_maps(data)
    assert maps.paths == ["/opt/my libs/lib x.so", "/usr/lib/old.so (deleted)", "[stack]", ""]
    assert maps.offsets.tolist() == [0x1000, 0, 0, 0]
    assert maps.devs[0] == "fd:01" and maps.inodes.tolist() == [123, 456, 0, 0]
    assert maps.malformed_lines == 1
    assert maps.find(0x55D0C0A00FFF) == 0 and maps.find(0x55D0C0A01000) == -1
    assert [maps.file_backed(i) for i in range(4)] == [True, True, False, False]
