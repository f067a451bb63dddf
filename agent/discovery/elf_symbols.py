"""The functions an ELF file defines, and the function an address is in.

Two jobs: say which functions a file defines (discovery attaches uprobes
where a wanted symbol is defined) and say which function an address of a
running process falls in (cudaLaunchKernel's first argument is the kernel's
host stub: its symbol is the kernel's name). The tables come from
elf_reader; their names are decoded only when asked for.
"""

import os

import numpy as np

from mmtrace.agent.discovery.elf_reader import ElfFile, read_elf_file
from mmtrace.agent.discovery.function_index import FunctionIndex, build_function_index
from mmtrace.agent.discovery.load_segments import LoadSegments
from mmtrace.agent.discovery.symbol_tables import (defined_names, defined_names_starting,
                                                   function_mask)


class ElfSymbols:
    """The symbol tables and load segments of one ELF file version."""

    def __init__(self, parsed: ElfFile):
        self.path = parsed.path
        self.key = parsed.key
        self.elf_type = parsed.elf_type
        self.section_names = parsed.section_names     # ".text", ".nvFatBinSegment", ...
        self.needed = parsed.needed                   # DT_NEEDED: "libcudart.so.13", ...
        self.build_id = parsed.build_id               # NT_GNU_BUILD_ID's bytes; b"" if none
        self.segments = LoadSegments(parsed.segments)
        self._tables = (parsed.dynsym, parsed.symtab)
        self._dynamic_functions: frozenset[str] | None = None
        self._functions: frozenset[str] | None = None
        self._local_functions: frozenset[str] | None = None
        self._index: FunctionIndex | None = None
        self._names: dict[int, str] = {}         # index entry -> chosen alias

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ElfSymbols":
        """Parse `path` (ElfCache.open keeps what it parsed). Raises
        NotElfError, ElfError, OSError."""
        return cls(read_elf_file(path))

    @property
    def has_symbol_table(self) -> bool:
        """A .symtab: functions the dynamic linker does not export are named."""
        return self._tables[1] is not None

    # ----- which functions the file defines ------------------------------

    def defined_dynamic_functions(self) -> set[str]:
        """Names of FUNC/IFUNC symbols defined in .dynsym (what the dynamic
        linker exports), without version suffixes."""
        if self._dynamic_functions is None:
            self._dynamic_functions = defined_names(self._tables[0], exported_only=False)
        return set(self._dynamic_functions)

    def defined_functions(self, local: bool = False) -> set[str]:
        """.dynsym's defined functions plus the global and weak functions of
        .symtab: a runtime linked statically into an executable is only there.
        `local`: the local functions of .symtab too (a static runtime's API
        functions are local once linked: cudaLaunchKernel in nvcc's output)."""
        if self._functions is None:
            self.defined_dynamic_functions()
            dynsym, symtab = self._tables
            exported = np.zeros(0, dtype=np.uint64)
            if dynsym is not None:
                exported = dynsym.symbols["value"][function_mask(dynsym.symbols)]
            # In a shared library .symtab repeats every export (libtorch_cpu.so:
            # 530k symbols, 72 MiB of names); only functions at addresses that
            # .dynsym lacks can add a name, so only those are decoded.
            self._functions = self._dynamic_functions | defined_names(
                symtab, exported_only=True, skip_values=exported)
        if not local:
            return set(self._functions)
        return set(self._functions | self._local())

    def defined_functions_starting(self, prefixes: tuple[str, ...]) -> set[str]:
        """defined_functions(local=True) limited to names that start with one
        of `prefixes`. Only those names are decoded: discovery looks at every
        file processes map, and building every name of a big library
        (libtorch_cpu.so: 530k symbols, 72 MiB of names) was most of the
        agent's peak memory."""
        return defined_names_starting(self._tables, prefixes)

    def defines(self, name: str) -> bool:
        """Whether a function of this name is defined, at any binding."""
        self.defined_functions()
        return name in self._functions or name in self._local()

    def _local(self) -> frozenset[str]:
        if self._local_functions is None:
            self._local_functions = defined_names(self._tables[1], local_only=True)
        return self._local_functions

    # ----- which function an address is in -------------------------------

    def function_at(self, vaddr: int) -> str | None:
        """The function (raw symbol name, not demangled) whose [value, value +
        size) holds the ELF virtual address `vaddr`, else None."""
        if not 0 <= vaddr < 1 << 64:
            return None
        return self.functions_at(np.array([vaddr], dtype=np.uint64))[0]

    def functions_at(self, vaddrs: np.ndarray) -> list[str | None]:
        """function_at for a batch of virtual addresses."""
        if self._index is None:
            self._index = build_function_index(self._tables)
        index = self._index
        vaddrs = np.asarray(vaddrs, dtype=np.uint64)
        if not len(index.starts) or not len(vaddrs):
            return [None] * len(vaddrs)
        chosen, found = index.find(vaddrs)
        return [self._entry_name(int(j)) if ok else None for j, ok in zip(chosen, found)]

    def _entry_name(self, j: int) -> str:
        name = self._names.get(j)
        if name is None:
            name = self._names[j] = self._index.entry_name(self._tables, j)
        return name
