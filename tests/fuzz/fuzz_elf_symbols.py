"""Fuzz target: ELF files as discovery and name resolution read them (symbol
tables, local functions, section names, DT_NEEDED, the build id note, the
untraceable-runtime check). Whatever the bytes, only ElfError may come out."""

import os
import sys

import atheris
import numpy  # noqa: F401  (imported before instrumentation: not ours to fuzz)

with atheris.instrument_imports():
    from mmtrace.agent.discovery.elf_reader import ElfError
    from mmtrace.agent.discovery.elf_symbols import ElfSymbols
    from mmtrace.agent.discovery.library_files import untraceable_reason


def test_one_input(data: bytes):
    fd = os.memfd_create("elf")
    try:
        os.write(fd, data)
        try:
            elf = ElfSymbols.read(f"/proc/self/fd/{fd}")
        except ElfError:
            return
        functions = elf.defined_functions(local=True)
        assert elf.defined_functions_starting(("cu", "_")) == {
            n for n in functions if n.startswith(("cu", "_"))}
        for name in list(functions)[:4]:
            assert elf.defines(name)
        assert isinstance(elf.build_id, bytes) and all(isinstance(n, str) for n in elf.needed)
        untraceable_reason(elf)
        for vaddr in (0, 0x1000, len(data), (1 << 64) - 1):
            elf.function_at(vaddr)
            elf.segments.holds_vaddr(vaddr)
            offset = elf.segments.offset_of_vaddr(vaddr)
            if offset is not None:
                # Overlapping segments (corrupt headers) may map it elsewhere.
                elf.segments.vaddr_of_offset(offset)
    finally:
        os.close(fd)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
