"""Symbols of ELF files and of running processes.

Two jobs: say which functions a file defines (discovery attaches uprobes
where a wanted symbol is defined) and say which function an address of a
running process falls in (cudaLaunchKernel's first argument is the kernel's
host stub: its symbol is the kernel's name).

ELF tables are read with os.pread into numpy structured arrays, so a
library with 10^5 symbols parses in milliseconds; nothing is mmap'ed, so a
file truncated while it is read raises ElfError instead of killing the
agent with SIGBUS.
"""

import ctypes
import ctypes.util
import functools
import os
import re
import stat
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

ELF_MAGIC = b"\x7fELF"
PT_LOAD = 1
SHT_SYMTAB = 2
SHT_STRTAB = 3
SHT_DYNAMIC = 6
SHT_NOTE = 7
SHT_DYNSYM = 11
DT_NEEDED = 1
NT_GNU_BUILD_ID = 3
SHN_UNDEF = 0
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_GLOBAL = 1
STB_WEAK = 2
STB_GNU_UNIQUE = 10

# Tables larger than this are not symbol tables of any real library
# (libtorch_cuda.so's .dynstr is tens of MiB); refusing them bounds memory
# when a corrupt header claims terabytes.
MAX_TABLE_BYTES = 1 << 30


class ElfError(Exception):
    """The file is not a readable ELF file; the message names the file and
    what was expected."""


class NotElfError(ElfError):
    """The file does not start with the ELF magic."""


class FileKey(NamedTuple):
    """Identity of one version of a file: a replaced or rewritten file gets a
    new key, the same file seen through a symlink or hard link does not."""
    dev: int
    ino: int
    mtime_ns: int
    size: int

    @classmethod
    def of(cls, st: os.stat_result) -> "FileKey":
        return cls(st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True)
class _Layout:
    """Byte layouts of one ELF class and byte order."""
    header: struct.Struct
    section: np.dtype
    segment: np.dtype
    symbol: np.dtype


def _layout(elf_class: int, order: str) -> _Layout:
    def dt(fields):
        return np.dtype([(name, order + code) for name, code in fields])
    if elf_class == 2:
        word = "u8"
        header = struct.Struct(order + "HHIQQQIHHHHHH")
        segment = dt([("type", "u4"), ("flags", "u4"), ("offset", "u8"), ("vaddr", "u8"),
                      ("paddr", "u8"), ("filesz", "u8"), ("memsz", "u8"), ("align", "u8")])
        symbol = dt([("name", "u4"), ("info", "u1"), ("other", "u1"), ("shndx", "u2"),
                     ("value", "u8"), ("size", "u8")])
    else:
        word = "u4"
        header = struct.Struct(order + "HHIIIIIHHHHHH")
        segment = dt([("type", "u4"), ("offset", "u4"), ("vaddr", "u4"), ("paddr", "u4"),
                      ("filesz", "u4"), ("memsz", "u4"), ("flags", "u4"), ("align", "u4")])
        symbol = dt([("name", "u4"), ("value", "u4"), ("size", "u4"), ("info", "u1"),
                     ("other", "u1"), ("shndx", "u2")])
    section = dt([("name", "u4"), ("type", "u4"), ("flags", word), ("addr", word),
                  ("offset", word), ("size", word), ("link", "u4"), ("info", "u4"),
                  ("addralign", word), ("entsize", word)])
    return _Layout(header, section, segment, symbol)


class _Reader:
    """Bounded reads of one open file; every short read is an ElfError."""

    def __init__(self, path: str, fd: int, size: int):
        self.path, self.fd, self.size = path, fd, size

    def read(self, offset: int, length: int, what: str) -> bytes:
        if length > MAX_TABLE_BYTES:
            raise ElfError(f"{self.path}: {what} claims {length} bytes, more than the "
                           f"{MAX_TABLE_BYTES} a symbol table can plausibly have")
        if offset < 0 or offset + length > self.size:
            raise ElfError(f"{self.path}: {what} at offset {offset} (+{length} bytes) lies "
                           f"beyond the end of the file ({self.size} bytes): truncated?")
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise ElfError(f"{self.path}: expected {length} bytes of {what} at offset "
                           f"{offset}, read {len(data)}: the file changed while being read")
        return data

    def array(self, offset: int, count: int, dtype: np.dtype, what: str) -> np.ndarray:
        data = self.read(offset, count * dtype.itemsize, what)
        return np.frombuffer(data, dtype=dtype, count=count)


@dataclass
class _SymbolTable:
    symbols: np.ndarray          # structured: name, info, shndx, value, size
    strings: bytes


@dataclass
class _FunctionIndex:
    """Defined functions sorted by address. Lookups search the first entry of
    each address; its aliases (same address, same binding) follow it."""
    starts: np.ndarray           # uint64, one per address, sorted
    ends: np.ndarray             # uint64; a size-0 symbol matches only its own address
    cover: np.ndarray            # int64: the entry <= i reaching farthest (nested symbols)
    first: np.ndarray            # int64: where each address's aliases begin in the columns
    count: np.ndarray            # int64: how many aliases share its size class and binding
    table: np.ndarray            # uint8 column, every alias: 0 = .dynsym, 1 = .symtab
    name_offsets: np.ndarray     # uint32 column, every alias


def _alias_preference(name: str) -> tuple[int, int]:
    """printf over _IO_printf, free over __libc_free; C++ names stay whole."""
    underscores = 0 if name.startswith("_Z") else len(name) - len(name.lstrip("_"))
    return underscores, len(name)


def _symbol_name(strings: bytes, offset: int) -> str:
    end = strings.find(b"\0", offset)
    raw = strings[offset:] if end < 0 else strings[offset:end]
    name = raw.decode("utf-8", "backslashreplace")
    # Linked outputs keep "name@@VERSION" in .symtab for .symver definitions.
    at = name.find("@")
    return name if at <= 0 else name[:at]


def _symbol_names(strings: bytes, offsets: np.ndarray) -> list[str]:
    """_symbol_name for many offsets at once. Symbol names are ASCII in
    practice: then one decode and one split serve them all, in C."""
    # Splitting a table costs time in its size, one find per name in the
    # number of names: a few names of a big .strtab are looked up one by one.
    if len(offsets) * 64 < len(strings) // 16 or not strings.isascii():
        return [_symbol_name(strings, int(off)) for off in offsets]
    pieces = strings.decode("ascii").split("\0")
    nuls = np.flatnonzero(np.frombuffer(strings, dtype=np.uint8) == 0)
    starts = np.concatenate(([0], nuls + 1)).astype(np.int64)
    offsets = np.asarray(offsets, dtype=np.int64)
    which = np.searchsorted(starts, offsets, side="right") - 1
    names = [pieces[i] for i in which.tolist()]
    # A name may be the tail of a longer string (linkers share suffixes).
    for j in np.flatnonzero(starts[which] != offsets).tolist():
        names[j] = pieces[which[j]][offsets[j] - starts[which[j]]:]
    if b"@" in strings:
        names = [n if n.find("@") <= 0 else n[:n.find("@")] for n in names]
    return names


def _function_mask(symbols: np.ndarray) -> np.ndarray:
    kind = symbols["info"] & 0xF
    return (((kind == STT_FUNC) | (kind == STT_GNU_IFUNC))
            & (symbols["shndx"] != SHN_UNDEF) & (symbols["name"] != 0))


def _starting_with(strings: bytes, offsets: np.ndarray, prefixes: tuple[bytes, ...]) -> np.ndarray:
    """Mask of the names at `offsets` in `strings` that start with one of
    `prefixes`, looked at in place (nothing decoded)."""
    table = np.frombuffer(strings, dtype=np.uint8)
    keep = np.zeros(len(offsets), dtype=bool)
    for prefix in prefixes:
        head = np.frombuffer(prefix, dtype=np.uint8)
        fits = offsets + len(head) <= len(table)
        at = offsets[fits]
        match = np.ones(len(at), dtype=bool)
        for i, byte in enumerate(head):
            match &= table[at + i] == byte
        keep[np.flatnonzero(fits)[match]] = True
    return keep


def _exported_mask(symbols: np.ndarray) -> np.ndarray:
    bind = symbols["info"] >> 4
    return (bind == STB_GLOBAL) | (bind == STB_WEAK) | (bind == STB_GNU_UNIQUE)


class ElfSymbols:
    """The symbol tables and load segments of one ELF file version."""

    def __init__(self, path: str, key: FileKey, elf_type: int, segments: np.ndarray,
                 dynsym: _SymbolTable | None, symtab: _SymbolTable | None,
                 section_names: frozenset = frozenset(), needed: tuple = (),
                 build_id: bytes = b""):
        self.path = path
        self.key = key
        self.elf_type = elf_type
        self.section_names = section_names     # ".text", ".nvFatBinSegment", ...
        self.needed = needed                   # DT_NEEDED: "libcudart.so.13", ...
        self.build_id = build_id               # NT_GNU_BUILD_ID's bytes; b"" if none
        self._segments = np.sort(segments, order="offset")
        self._tables = (dynsym, symtab)
        self._dynamic_functions: frozenset[str] | None = None
        self._functions: frozenset[str] | None = None
        self._local_functions: frozenset[str] | None = None
        self._index: _FunctionIndex | None = None
        self._names: dict[int, str] = {}         # index entry -> chosen alias

    # ----- construction -------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ElfSymbols":
        """Parsed symbols of `path`, cached per file version (dev, inode,
        mtime, size): a replaced file is parsed again, a link is not."""
        return _cache.get(os.fspath(path))

    @classmethod
    def read(cls, path: str | os.PathLike) -> "ElfSymbols":
        """Parse `path` without the cache. Raises NotElfError, ElfError, OSError."""
        path = os.fspath(path)
        with open(path, "rb", buffering=0) as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ElfError(f"{path}: expected a regular file")
            try:
                return cls._parse(_Reader(path, f.fileno(), st.st_size), FileKey.of(st))
            except (ValueError, IndexError, OverflowError, struct.error) as exc:
                # Headers whose numbers contradict each other: corrupt, not a bug here.
                raise ElfError(f"{path}: malformed ELF headers ({exc})") from None

    @classmethod
    def _parse(cls, reader: _Reader, key: FileKey) -> "ElfSymbols":
        path = reader.path
        if reader.size < 16:
            raise NotElfError(f"{path}: expected an ELF file, it has only {reader.size} bytes")
        ident = reader.read(0, 16, "ELF identification")
        if ident[:4] != ELF_MAGIC:
            raise NotElfError(f"{path}: expected an ELF file (starting {ELF_MAGIC!r}), "
                              f"it starts with {ident[:4]!r}")
        if ident[4] not in (1, 2) or ident[5] not in (1, 2):
            raise ElfError(f"{path}: unknown ELF class {ident[4]} or byte order {ident[5]}")
        layout = _layout(ident[4], "<" if ident[5] == 1 else ">")
        (e_type, _machine, _version, _entry, phoff, shoff, _flags, _ehsize, phentsize,
         phnum, shentsize, shnum, shstrndx) = layout.header.unpack(
            reader.read(16, layout.header.size, "ELF header"))

        segments = np.zeros(0, dtype=layout.segment)
        if phnum:
            if phentsize != layout.segment.itemsize:
                raise ElfError(f"{path}: program header entries of {phentsize} bytes, "
                               f"expected {layout.segment.itemsize}")
            phdrs = reader.array(phoff, phnum, layout.segment, "program headers")
            segments = phdrs[phdrs["type"] == PT_LOAD].copy()

        sections = cls._sections(reader, layout, shoff, shnum, shentsize)
        dynsym = cls._table(reader, layout, sections, SHT_DYNSYM, ".dynsym")
        symtab = cls._table(reader, layout, sections, SHT_SYMTAB, ".symtab")
        return cls(path, key, e_type, segments, dynsym, symtab,
                   cls._section_names(reader, sections, shstrndx),
                   cls._needed(reader, layout, sections), cls._build_id(reader, sections))

    @staticmethod
    def _section_names(reader, sections, shstrndx) -> frozenset:
        if not 0 < shstrndx < len(sections):
            return frozenset()
        names = sections[shstrndx]
        strings = reader.read(int(names["offset"]), int(names["size"]),
                              "section name table")
        return frozenset(_symbol_names(strings, np.unique(sections["name"]
                                                          [sections["name"] < len(strings)])))

    @staticmethod
    def _needed(reader, layout, sections) -> tuple:
        """The DT_NEEDED entries of .dynamic, in order."""
        found = np.flatnonzero(sections["type"] == SHT_DYNAMIC)
        if not len(found):
            return ()
        sec = sections[found[0]]
        link = int(sec["link"])
        if link >= len(sections) or sections[link]["type"] != SHT_STRTAB:
            return ()
        word = layout.section["addr"]
        entry = np.dtype([("tag", word), ("value", word)])
        count = int(sec["size"]) // entry.itemsize
        dynamic = reader.array(int(sec["offset"]), count, entry, ".dynamic")
        strings = reader.read(int(sections[link]["offset"]), int(sections[link]["size"]),
                              "string table of .dynamic")
        offsets = dynamic["value"][(dynamic["tag"] == DT_NEEDED)
                                   & (dynamic["value"] < len(strings))]
        return tuple(_symbol_name(strings, int(off)) for off in offsets)

    @staticmethod
    def _build_id(reader, sections) -> bytes:
        """The GNU build id note's bytes, b"" when the file has none."""
        for sec in sections[sections["type"] == SHT_NOTE]:
            data = reader.read(int(sec["offset"]), int(sec["size"]), "note section")
            at = 0
            while at + 12 <= len(data):
                namesz, descsz, kind = struct.unpack_from("<III", data, at)
                name_end = at + 12 + (namesz + 3 & ~3)
                desc_end = name_end + (descsz + 3 & ~3)
                if desc_end > len(data):
                    break
                if kind == NT_GNU_BUILD_ID and data[at + 12:at + 12 + namesz] == b"GNU\0":
                    return data[name_end:name_end + descsz]
                at = desc_end
        return b""

    @property
    def has_symbol_table(self) -> bool:
        """A .symtab: functions the dynamic linker does not export are named."""
        return self._tables[1] is not None

    @staticmethod
    def _sections(reader, layout, shoff, shnum, shentsize) -> np.ndarray:
        if shoff == 0:
            return np.zeros(0, dtype=layout.section)
        if shentsize != layout.section.itemsize:
            raise ElfError(f"{reader.path}: section header entries of {shentsize} bytes, "
                           f"expected {layout.section.itemsize}")
        if shnum == 0:  # more than 0xff00 sections: the count is in section 0
            first = reader.array(shoff, 1, layout.section, "section header 0")
            shnum = int(first["size"][0])
        return reader.array(shoff, shnum, layout.section, "section headers")

    @staticmethod
    def _table(reader, layout, sections, kind, what) -> _SymbolTable | None:
        found = np.flatnonzero(sections["type"] == kind)
        if not len(found):
            return None
        sec = sections[found[0]]
        entsize = int(sec["entsize"]) or layout.symbol.itemsize
        if entsize != layout.symbol.itemsize:
            raise ElfError(f"{reader.path}: {what} entries of {entsize} bytes, "
                           f"expected {layout.symbol.itemsize}")
        link = int(sec["link"])
        if link >= len(sections) or sections[link]["type"] != SHT_STRTAB:
            raise ElfError(f"{reader.path}: {what} links to section {link}, "
                           f"expected a string table")
        count = int(sec["size"]) // entsize
        symbols = reader.array(int(sec["offset"]), count, layout.symbol, what)
        strings = reader.read(int(sections[link]["offset"]), int(sections[link]["size"]),
                              f"string table of {what}")
        # A name offset past the string table would read garbage: drop it.
        symbols = symbols[symbols["name"] < len(strings)]
        return _SymbolTable(symbols, strings)

    # ----- which functions the file defines ------------------------------

    def defined_dynamic_functions(self) -> set[str]:
        """Names of FUNC/IFUNC symbols defined in .dynsym (what the dynamic
        linker exports), without version suffixes."""
        if self._dynamic_functions is None:
            self._dynamic_functions = self._defined(self._tables[0], exported_only=False)
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
                exported = dynsym.symbols["value"][_function_mask(dynsym.symbols)]
            # In a shared library .symtab repeats every export (libtorch_cpu.so:
            # 530k symbols, 72 MiB of names); only functions at addresses that
            # .dynsym lacks can add a name, so only those are decoded.
            self._functions = self._dynamic_functions | self._defined(
                symtab, exported_only=True, skip_values=exported)
        if not local:
            return set(self._functions)
        if self._local_functions is None:
            self._local_functions = self._defined(self._tables[1], local_only=True)
        return set(self._functions | self._local_functions)

    def defined_functions_starting(self, prefixes: tuple[str, ...]) -> set[str]:
        """defined_functions(local=True) limited to names that start with one
        of `prefixes`. Only those names are decoded: discovery looks at every
        file processes map, and building every name of a big library
        (libtorch_cpu.so: 530k symbols, 72 MiB of names) was most of the
        agent's peak memory."""
        encoded = tuple(p.encode() for p in prefixes)
        found: set[str] = set()
        dynsym, symtab = self._tables
        for table in self._tables:
            if table is None:
                continue
            mask = _function_mask(table.symbols)
            if table is symtab and dynsym is not None:
                # As defined_functions: .symtab's exports at addresses .dynsym
                # exports too are taken to repeat them.
                exported = dynsym.symbols["value"][_function_mask(dynsym.symbols)]
                mask &= ~(_exported_mask(table.symbols)
                          & np.isin(table.symbols["value"], exported))
            offsets = np.unique(table.symbols["name"][mask]).astype(np.int64)
            found.update(_symbol_names(table.strings,
                                       offsets[_starting_with(table.strings, offsets, encoded)]))
        return found

    def defines(self, name: str) -> bool:
        """Whether a function of this name is defined, at any binding."""
        self.defined_functions()
        if self._local_functions is None:
            self._local_functions = self._defined(self._tables[1], local_only=True)
        return name in self._functions or name in self._local_functions

    @staticmethod
    def _defined(table: _SymbolTable | None, exported_only: bool = False,
                 skip_values: np.ndarray | None = None,
                 local_only: bool = False) -> frozenset[str]:
        if table is None:
            return frozenset()
        mask = _function_mask(table.symbols)
        if exported_only:
            mask &= _exported_mask(table.symbols)
        if local_only:
            mask &= ~_exported_mask(table.symbols)
        chosen = table.symbols[mask]
        if skip_values is not None and len(skip_values) and len(chosen):
            chosen = chosen[~np.isin(chosen["value"], skip_values)]
        return frozenset(_symbol_names(table.strings, np.unique(chosen["name"])))

    # ----- which function an address is in -------------------------------

    def function_at(self, vaddr: int) -> str | None:
        """The function (raw symbol name, not demangled) whose [value, value +
        size) holds the ELF virtual address `vaddr`, else None."""
        if not 0 <= vaddr < 1 << 64:
            return None
        return self.functions_at(np.array([vaddr], dtype=np.uint64))[0]

    def functions_at(self, vaddrs: np.ndarray) -> list[str | None]:
        """function_at for a batch of virtual addresses."""
        index = self._function_index()
        vaddrs = np.asarray(vaddrs, dtype=np.uint64)
        if not len(index.starts) or not len(vaddrs):
            return [None] * len(vaddrs)
        i = np.searchsorted(index.starts, vaddrs, side="right").astype(np.int64) - 1
        valid = i >= 0
        safe = np.where(valid, i, 0)
        hit = valid & (vaddrs < index.ends[safe])
        # Not inside the nearest symbol: maybe inside an earlier, larger one
        # (a size-0 assembler label inside a function).
        covering = index.cover[safe]
        use_cover = valid & ~hit & (vaddrs < index.ends[covering])
        chosen = np.where(use_cover, covering, safe)
        found = hit | use_cover
        return [self._entry_name(index, int(j)) if ok else None
                for j, ok in zip(chosen, found)]

    def _entry_name(self, index: _FunctionIndex, j: int) -> str:
        name = self._names.get(j)
        if name is None:
            first = int(index.first[j])
            aliases = [_symbol_name(self._tables[int(index.table[k])].strings,
                                    int(index.name_offsets[k]))
                       for k in range(first, first + int(index.count[j]))]
            name = min(aliases, key=_alias_preference)
            self._names[j] = name
        return name

    def _function_index(self) -> _FunctionIndex:
        if self._index is None:
            self._index = self._build_index()
        return self._index

    def _build_index(self) -> _FunctionIndex:
        parts = []
        for table_id, table in enumerate(self._tables):
            if table is None:
                continue
            syms = table.symbols[_function_mask(table.symbols)]
            syms = syms[syms["value"] != 0]
            bind = syms["info"] >> 4
            # When several names share an address prefer a sized, global one.
            rank = np.where(bind == STB_GLOBAL, 0, np.where(bind == STB_WEAK, 1, 2))
            parts.append((syms["value"].astype(np.uint64), syms["size"].astype(np.uint64),
                          rank, np.full(len(syms), table_id, dtype=np.uint8),
                          syms["name"].astype(np.uint32)))
        if not parts:
            none = np.zeros(0, dtype=np.int64)
            return _FunctionIndex(none.astype(np.uint64), none.astype(np.uint64), none, none,
                                  none, none.astype(np.uint8), none.astype(np.uint32))
        starts, sizes, rank, table, names = (np.concatenate(col) for col in zip(*parts))
        unsized = sizes == 0
        order = np.lexsort((table, rank, unsized, starts))
        starts, sizes, rank, unsized, table, names = (
            a[order] for a in (starts, sizes, rank, unsized, table, names))
        new_address = np.ones(len(starts), dtype=bool)
        new_address[1:] = starts[1:] != starts[:-1]
        # Aliases: a run of entries with the address, size class and rank of
        # the first one (.dynsym and .symtab repeat each other: both count).
        new_class = new_address.copy()
        new_class[1:] |= (unsized[1:] != unsized[:-1]) | (rank[1:] != rank[:-1])
        class_starts = np.flatnonzero(new_class)
        class_sizes = np.diff(np.append(class_starts, len(starts)))
        first = np.flatnonzero(new_address)
        count = class_sizes[np.searchsorted(class_starts, first)]
        starts, sizes = starts[first], sizes[first]
        ends = starts + np.maximum(sizes, 1)
        running = np.maximum.accumulate(ends)
        cover = np.maximum.accumulate(np.where(ends >= running, np.arange(len(ends)), 0))
        return _FunctionIndex(starts, ends, cover.astype(np.int64), first.astype(np.int64),
                              count.astype(np.int64), table, names)

    # ----- runtime addresses to ELF virtual addresses ---------------------

    def vaddr_of_offset(self, file_offset: int) -> int | None:
        """The virtual address of a file offset, through the PT_LOAD segment
        whose file bytes contain it; None when no segment does."""
        if not 0 <= file_offset < 1 << 64:
            return None
        vaddrs, ok = self.vaddrs_of_offsets(np.array([file_offset], dtype=np.uint64))
        return int(vaddrs[0]) if ok[0] else None

    def vaddrs_of_offsets(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batch vaddr_of_offset: (vaddrs, valid mask)."""
        offsets = np.asarray(offsets, dtype=np.uint64)
        seg = self._segments
        if not len(seg):
            return np.zeros(len(offsets), np.uint64), np.zeros(len(offsets), bool)
        seg_off = seg["offset"].astype(np.uint64)
        i = np.searchsorted(seg_off, offsets, side="right").astype(np.int64) - 1
        safe = np.where(i >= 0, i, 0)
        ok = (i >= 0) & (offsets < seg_off[safe] + seg["filesz"].astype(np.uint64)[safe])
        vaddrs = offsets - seg_off[safe] + seg["vaddr"].astype(np.uint64)[safe]
        return np.where(ok, vaddrs, 0).astype(np.uint64), ok

    def offset_of_vaddr(self, vaddr: int) -> int | None:
        """The file offset of a virtual address, through the PT_LOAD segment
        whose file bytes hold it; None when none does."""
        for seg in self._segments:
            if int(seg["vaddr"]) <= vaddr < int(seg["vaddr"]) + int(seg["filesz"]):
                offset = vaddr - int(seg["vaddr"]) + int(seg["offset"])
                # A corrupt header can place a segment's bytes past 2^64.
                return offset if offset < 1 << 64 else None
        return None

    def holds_vaddr(self, vaddr: int) -> bool:
        """Whether a PT_LOAD segment's memory holds ELF virtual address `vaddr`."""
        seg = self._segments
        return bool(((seg["vaddr"] <= vaddr) & (vaddr < seg["vaddr"] + seg["memsz"])).any())

    def runtime_to_vaddr(self, addr: int, map_start: int, map_offset: int) -> int | None:
        """ELF virtual address of runtime address `addr` inside a mapping of
        this file that starts at `map_start` with file offset `map_offset`."""
        return self.vaddr_of_offset(addr - map_start + map_offset)

    def load_bias(self, map_start: int, map_offset: int,
                  page_size: int = os.sysconf("SC_PAGE_SIZE")) -> int | None:
        """runtime address - ELF virtual address for the segment a mapping
        (start, file offset) holds; None when no PT_LOAD segment matches."""
        for seg in self._segments:
            low = int(seg["offset"]) & ~(page_size - 1)
            if low <= map_offset < int(seg["offset"]) + int(seg["filesz"]):
                return map_start - (int(seg["vaddr"]) + map_offset - int(seg["offset"]))
        return None


class _ElfCache:
    """ElfSymbols per file version, least recently used dropped first."""

    def __init__(self, max_files: int = 128):
        self.max_files = max_files
        self._files: OrderedDict[FileKey, ElfSymbols] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: str) -> ElfSymbols:
        key = FileKey.of(os.stat(path))
        with self._lock:
            hit = self._files.get(key)
            if hit is not None:
                self._files.move_to_end(key)
                return hit
        elf = ElfSymbols.read(path)
        with self._lock:
            self._files[elf.key] = elf
            while len(self._files) > self.max_files:
                self._files.popitem(last=False)
        return elf

    def clear(self):
        with self._lock:
            self._files.clear()

    def forget(self, dev: int, ino: int):
        """Drop every version of one file (it is gone: released, deleted)."""
        with self._lock:
            for key in [k for k in self._files if (k.dev, k.ino) == (dev, ino)]:
                del self._files[key]


_cache = _ElfCache()


def forget_file(dev: int, ino: int) -> None:
    """ElfSymbols.open forgets the file (dev, ino): its parsed tables go."""
    _cache.forget(dev, ino)


# ----- C++ names ---------------------------------------------------------

# Longer mangled names are returned as they are: no real symbol needs more,
# and the demangler's recursion is then bounded whatever a file contains.
MAX_DEMANGLE_INPUT = 16384


@functools.cache
def _cxa_demangle():
    """(__cxa_demangle, free) from libstdc++ and libc, or None without them."""
    try:
        libstdcxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    fn = getattr(libstdcxx, "__cxa_demangle")
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_int)]
    free = libc.free
    free.argtypes = [ctypes.c_void_p]
    free.restype = None
    return fn, free


# The cache keeps names up to this long only: 65 536 cached names of up to
# MAX_DEMANGLE_INPUT characters could have held a gigabyte for a file full
# of long distinct names; real kernel names are a few hundred characters.
MAX_CACHED_NAME = 1024


def demangle(name: str) -> str:
    """The demangled form of an Itanium C++ ABI name; `name` unchanged when
    it is not one, cannot be demangled, or no libstdc++ is loadable."""
    if isinstance(name, str) and len(name) <= MAX_CACHED_NAME:
        return _demangle_cached(name)
    return _demangle(name)


@functools.lru_cache(maxsize=16384)
def _demangle_cached(name: str) -> str:
    return _demangle(name)


def _demangle(name: str) -> str:
    if not isinstance(name, str) or not name.startswith("_Z") or "\0" in name \
            or len(name) > MAX_DEMANGLE_INPUT:
        return name
    api = _cxa_demangle()
    if api is None:
        return name
    fn, free = api
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        return name
    status = ctypes.c_int(0)
    ptr = fn(raw, None, None, ctypes.byref(status))
    if not ptr:
        return name
    try:
        if status.value != 0:
            return name
        return ctypes.string_at(ptr).decode("utf-8", "backslashreplace")
    finally:
        free(ptr)


# ----- /proc/PID/maps ------------------------------------------------------

_MAPS_LINE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) ([0-9a-f]+:[0-9a-f]+) (\d+)[ \t]*([^\n]*)$",
    re.MULTILINE)
DELETED_SUFFIX = " (deleted)"


@dataclass
class ProcessMaps:
    """The mappings of one process, sorted by start address."""
    starts: np.ndarray           # uint64
    ends: np.ndarray             # uint64
    offsets: np.ndarray          # uint64: file offset of each start
    inodes: np.ndarray           # uint64: 0 for anonymous mappings
    devs: list[str]              # "major:minor" as the kernel prints it (hex)
    perms: list[str]
    paths: list[str]             # "" for anonymous, "[heap]", "/x (deleted)", ...
    malformed_lines: int = 0
    read_at: float = 0.0
    elfs: dict = field(default_factory=dict)       # mapping index -> ElfSymbols | reason
    outcomes: dict = field(default_factory=dict)   # address -> (name | None, counter name)

    def find(self, addr: int) -> int:
        """Index of the mapping holding `addr`, or -1."""
        return int(self.find_many(np.array([addr], dtype=np.uint64))[0])

    def find_many(self, addrs: np.ndarray) -> np.ndarray:
        addrs = np.asarray(addrs, dtype=np.uint64)
        if not len(self.starts):
            return np.full(len(addrs), -1, dtype=np.int64)
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        safe = np.where(i >= 0, i, 0)
        return np.where((i >= 0) & (addrs < self.ends[safe]), i, -1)

    def file_backed(self, i: int) -> bool:
        return self.paths[i].startswith("/") and int(self.inodes[i]) != 0


def parse_maps(data: bytes) -> ProcessMaps:
    """Parse the text of /proc/PID/maps; lines that do not parse are counted."""
    rows = _MAPS_LINE.findall(data)
    lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
    rows.sort(key=lambda r: int(r[0], 16))
    return ProcessMaps(
        starts=np.array([int(r[0], 16) for r in rows], dtype=np.uint64),
        ends=np.array([int(r[1], 16) for r in rows], dtype=np.uint64),
        offsets=np.array([int(r[3], 16) for r in rows], dtype=np.uint64),
        inodes=np.array([int(r[5]) for r in rows], dtype=np.uint64),
        devs=[r[4].decode() for r in rows],
        perms=[r[2].decode("ascii", "replace") for r in rows],
        paths=[os.fsdecode(r[6]) for r in rows],
        malformed_lines=lines - len(rows))


def read_maps(proc_root: Path, pid: int) -> ProcessMaps:
    """Read and parse /proc/PID/maps. Raises OSError (FileNotFoundError or
    ProcessLookupError when the process is gone)."""
    with open(proc_root / str(pid) / "maps", "rb") as f:
        return parse_maps(f.read())


def mapped_file_candidates(proc_root: Path, pid: int, maps: ProcessMaps, i: int) -> list[str]:
    """Where to open the file behind mapping `i`, best first: map_files gives
    the very inode that is mapped (even deleted or replaced since), the
    process's root gives its view of the path (containers)."""
    start, end = int(maps.starts[i]), int(maps.ends[i])
    candidates = [str(proc_root / str(pid) / "map_files" / f"{start:x}-{end:x}")]
    path = maps.paths[i]
    if not path.endswith(DELETED_SUFFIX):
        candidates.append(in_process_root(proc_root, pid, path))
    return candidates


def in_process_root(proc_root: Path, pid: int, path: str) -> str:
    """`path` as the process sees it, opened from the host: /proc/PID/root/path."""
    return str(proc_root / str(pid) / "root") + "/" + path.lstrip("/")


# ----- addresses of running processes ----------------------------------------

_GONE = (FileNotFoundError, ProcessLookupError)


class AddressResolver:
    """Turn (pid, runtime address) into the demangled name of the function
    holding it. Never raises for a vanished process, an unreadable /proc
    entry or a truncated or replaced file: each failure is counted in
    `counters` by reason and the answer is None.

    Counters: resolved, no_symbol (inside a mapped ELF, between functions),
    no_mapping, not_file_backed (heap, stack, JIT code), process_gone,
    maps_unreadable, maps_malformed_lines, file_missing, file_unreadable,
    file_deleted (deleted and map_files unavailable), not_elf,
    elf_unreadable (truncated or corrupt), name_truncated; with `images`,
    resolved_after_exit and unresolved_after_exit.

    `images(pid)` -> [(load bias, ElfSymbols)], where given, names the
    addresses of a process that has exited from its files on disk
    (agent/discovery/process_images.py)."""

    def __init__(self, proc_root: Path = Path("/proc"), *, max_processes: int = 4096,
                 refresh_interval_s: float = 0.05, max_name_len: int = 4096,
                 clock=time.monotonic, images=None):
        self.images = images
        self.proc_root = Path(proc_root)
        self.max_processes = max_processes
        # A miss re-reads the maps (a library dlopen'ed since), at most this
        # often per process: JIT code never resolves and must not cost a read
        # per event.
        self.refresh_interval_s = refresh_interval_s
        self.max_name_len = max_name_len
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self._maps: OrderedDict[int, ProcessMaps] = OrderedDict()
        self._lock = threading.Lock()
        self._next_forget = 0.0

    def forget(self, pid: int) -> None:
        """Drop what is cached for `pid` (the process exited; its pid may be reused)."""
        with self._lock:
            self._maps.pop(pid, None)

    # How often forget_exited looks: it costs a stat per cached process.
    FORGET_EXITED_EVERY_S = 1.0

    def forget_exited(self) -> int:
        """Drop the maps of the processes that have exited, at most every
        FORGET_EXITED_EVERY_S (a call in between does nothing); returns how
        many. A short-lived process's maps would otherwise stay until
        max_processes newer ones pushed them out."""
        now = self.clock()
        if now < self._next_forget:
            return 0
        self._next_forget = now + self.FORGET_EXITED_EVERY_S
        with self._lock:
            pids = list(self._maps)
        gone = [pid for pid in pids if not (self.proc_root / str(pid)).exists()]
        with self._lock:
            for pid in gone:
                self._maps.pop(pid, None)
        forget = getattr(self.images, "forget", None)
        if forget is not None:
            forget(self.proc_root)
        return len(gone)

    def resolve(self, pid: int, addr: int) -> str | None:
        if addr < 0 or addr >= 1 << 64:
            self.counters["no_mapping"] += 1
            return None
        return self.resolve_many(pid, np.array([addr], dtype=np.uint64))[0]

    def resolve_many(self, pid: int, addrs: np.ndarray, namer=None) -> list[str | None]:
        """Resolve a batch of addresses of one process: a dict lookup for the
        addresses seen before (a model launches the same kernels over and
        over), one vectorised pass for the rest. `namer(raw symbol, ElfSymbols)`
        -> name or None replaces demangling (its answers are not cached)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        out: list[str | None] = [None] * len(addrs)
        if not len(addrs):
            return out
        maps = self._process_maps(pid, refresh=False)
        if maps is None:
            return self._after_exit(pid, addrs, out, namer)
        pending = np.arange(len(addrs)) if namer else np.array(
            self._from_cache(maps, addrs, out), dtype=np.int64)
        if not len(pending):
            return out
        where = maps.find_many(addrs[pending])
        if (where < 0).any() and self.clock() - maps.read_at >= self.refresh_interval_s:
            fresh = self._process_maps(pid, refresh=True)
            if fresh is None:
                return out
            maps, where = fresh, fresh.find_many(addrs[pending])
        self.counters["no_mapping"] += int((where < 0).sum())
        for i in np.unique(where[where >= 0]).tolist():
            rows = pending[where == i]
            for row, name, reason in zip(rows.tolist(), *self._in_mapping(
                    pid, maps, i, addrs[rows], namer)):
                out[row] = name
                self.counters[reason] += 1
                if namer is None:
                    self._remember(maps, int(addrs[row]), name, reason)
        return out

    def _after_exit(self, pid: int, addrs: np.ndarray, out: list, namer=None) -> list:
        """Names from the files the process had loaded, where the kernel
        told where (images); the process itself is gone."""
        if self.images is None:
            return out
        found = self.images.images(pid)
        for row, addr in enumerate(addrs.tolist()):
            for bias, elf in found:
                vaddr = (addr - bias) % (1 << 64)
                raw = elf.function_at(vaddr) if elf.holds_vaddr(vaddr) else None
                if raw is not None:
                    out[row] = namer(raw, elf) if namer else self._present(raw)
                    break
            self.counters["resolved_after_exit" if out[row] else "unresolved_after_exit"] += 1
        return out

    # Outcomes are cached per maps version; a process that resolves this many
    # distinct addresses (JIT code) starts its cache over.
    MAX_CACHED_ADDRESSES = 1 << 16

    def _from_cache(self, maps: ProcessMaps, addrs: np.ndarray, out: list) -> list[int]:
        """Fill `out` from the cache; return the rows still to resolve."""
        pending = []
        cache = maps.outcomes
        for row, addr in enumerate(addrs.tolist()):
            hit = cache.get(addr)
            if hit is None:
                pending.append(row)
            else:
                out[row] = hit[0]
                self.counters[hit[1]] += 1
        return pending

    def _remember(self, maps: ProcessMaps, addr: int, name: str | None, reason: str) -> None:
        if len(maps.outcomes) >= self.MAX_CACHED_ADDRESSES:
            maps.outcomes.clear()
        maps.outcomes[addr] = (name, reason)

    def _in_mapping(self, pid: int, maps: ProcessMaps, i: int, addrs: np.ndarray,
                    namer=None):
        """(names, reasons) for addresses inside mapping i."""
        elf = self._mapping_elf(pid, maps, i)
        if not isinstance(elf, ElfSymbols):
            return [None] * len(addrs), [elf] * len(addrs)
        offsets = addrs - maps.starts[i] + maps.offsets[i]
        vaddrs, ok = elf.vaddrs_of_offsets(offsets)
        names, reasons = [], []
        for valid, raw in zip(ok.tolist(), elf.functions_at(vaddrs)):
            found = valid and raw is not None
            names.append(None if not found else namer(raw, elf) if namer
                         else self._present(raw))
            reasons.append("resolved" if found else "no_symbol")
        return names, reasons

    def _present(self, raw: str) -> str:
        name = demangle(raw)
        if len(name) > self.max_name_len:
            self.counters["name_truncated"] += 1
            name = name[:self.max_name_len - 1] + "\u2026"
        return name

    def _process_maps(self, pid: int, refresh: bool) -> ProcessMaps | None:
        with self._lock:
            cached = self._maps.get(pid)
            if cached is not None and not refresh:
                self._maps.move_to_end(pid)
                return cached
        try:
            maps = read_maps(self.proc_root, pid)
        except _GONE:
            self.counters["process_gone"] += 1
            self.forget(pid)
            return None
        except OSError:
            self.counters["maps_unreadable"] += 1
            return None
        maps.read_at = self.clock()
        self.counters["maps_malformed_lines"] += maps.malformed_lines
        with self._lock:
            self._maps[pid] = maps
            self._maps.move_to_end(pid)
            while len(self._maps) > self.max_processes:
                self._maps.popitem(last=False)
        return maps

    def _mapping_elf(self, pid: int, maps: ProcessMaps, i: int):
        """ElfSymbols of mapping i, or the counter name saying why not."""
        cached = maps.elfs.get(i)
        if cached is not None:
            return cached
        result = self._open_mapping(pid, maps, i)
        maps.elfs[i] = result
        return result

    def _open_mapping(self, pid: int, maps: ProcessMaps, i: int):
        if not maps.file_backed(i):
            return "not_file_backed"
        reason = "file_deleted" if maps.paths[i].endswith(DELETED_SUFFIX) else "file_missing"
        for candidate in mapped_file_candidates(self.proc_root, pid, maps, i):
            try:
                return ElfSymbols.open(candidate)
            except NotElfError:
                return "not_elf"
            except ElfError:
                return "elf_unreadable"
            except FileNotFoundError:
                continue
            except OSError:
                reason = "file_unreadable"
        return reason
