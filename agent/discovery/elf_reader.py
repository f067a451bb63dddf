"""Read an ELF file's headers and tables: load segments, section headers,
.dynsym and .symtab, section names, DT_NEEDED and the GNU build id.

ELF tables are read with os.pread into numpy structured arrays, so a
library with 10^5 symbols parses in milliseconds; nothing is mmap'ed, so a
file truncated while it is read raises ElfError instead of killing the
agent with SIGBUS.
"""

import os
import stat
import struct
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from mmtrace.agent.discovery.load_segments import LoadSegments
from mmtrace.agent.discovery.symbol_tables import SymbolTable, symbol_name, symbol_names

ELF_MAGIC = b"\x7fELF"
PT_LOAD = 1
SHT_SYMTAB = 2
SHT_STRTAB = 3
SHT_DYNAMIC = 6
SHT_NOTE = 7
SHT_DYNSYM = 11
DT_NEEDED = 1
NT_GNU_BUILD_ID = 3

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
class ElfFile:
    """What one read of an ELF file found."""
    path: str
    key: FileKey
    elf_type: int
    segments: np.ndarray                 # the PT_LOAD program headers
    dynsym: SymbolTable | None
    symtab: SymbolTable | None
    section_names: frozenset            # ".text", ".nvFatBinSegment", ...
    needed: tuple                       # DT_NEEDED: "libcudart.so.13", ...
    build_id: bytes                     # NT_GNU_BUILD_ID's bytes; b"" if none


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

    def section(self, sec, what: str) -> bytes:
        """The bytes of section header `sec`."""
        return self.read(int(sec["offset"]), int(sec["size"]), what)


def read_elf_file(path: str | os.PathLike) -> ElfFile:
    """Read `path`'s tables. Raises NotElfError, ElfError, OSError."""
    path = os.fspath(path)
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ElfError(f"{path}: expected a regular file")
        try:
            return _parse(_Reader(path, f.fileno(), st.st_size), FileKey.of(st))
        except (ValueError, IndexError, OverflowError, struct.error) as exc:
            # Headers whose numbers contradict each other: corrupt, not a bug here.
            raise ElfError(f"{path}: malformed ELF headers ({exc})") from None


def load_segments_of(fd: int, path: str) -> LoadSegments:
    """The PT_LOAD segments of the open file `fd` (`path` names it in
    errors): the offsets a uprobe on that very file is attached at come
    from here. Raises NotElfError, ElfError, OSError."""
    reader = _Reader(path, fd, os.fstat(fd).st_size)
    try:
        layout, header = _header(reader)
        return LoadSegments(_load_segments(reader, layout, header[4], header[9], header[8]))
    except (ValueError, IndexError, OverflowError, struct.error) as exc:
        raise ElfError(f"{path}: malformed ELF headers ({exc})") from None


def _header(reader: _Reader) -> tuple["_Layout", tuple]:
    """The file's layout and its ELF header's fields after e_ident."""
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
    return layout, layout.header.unpack(reader.read(16, layout.header.size, "ELF header"))


def _parse(reader: _Reader, key: FileKey) -> ElfFile:
    path = reader.path
    layout, header = _header(reader)
    (e_type, _machine, _version, _entry, phoff, shoff, _flags, _ehsize, phentsize,
     phnum, shentsize, shnum, shstrndx) = header
    segments = _load_segments(reader, layout, phoff, phnum, phentsize)
    sections = _sections(reader, layout, shoff, shnum, shentsize)
    return ElfFile(path, key, e_type, segments,
                   _table(reader, layout, sections, SHT_DYNSYM, ".dynsym"),
                   _table(reader, layout, sections, SHT_SYMTAB, ".symtab"),
                   _section_names(reader, sections, shstrndx),
                   _needed(reader, layout, sections), _build_id(reader, sections))


def _load_segments(reader: _Reader, layout: _Layout, phoff: int, phnum: int,
                   phentsize: int) -> np.ndarray:
    if not phnum:
        return np.zeros(0, dtype=layout.segment)
    if phentsize != layout.segment.itemsize:
        raise ElfError(f"{reader.path}: program header entries of {phentsize} bytes, "
                       f"expected {layout.segment.itemsize}")
    phdrs = reader.array(phoff, phnum, layout.segment, "program headers")
    return phdrs[phdrs["type"] == PT_LOAD].copy()


def _sections(reader: _Reader, layout: _Layout, shoff: int, shnum: int,
              shentsize: int) -> np.ndarray:
    if shoff == 0:
        return np.zeros(0, dtype=layout.section)
    if shentsize != layout.section.itemsize:
        raise ElfError(f"{reader.path}: section header entries of {shentsize} bytes, "
                       f"expected {layout.section.itemsize}")
    if shnum == 0:  # more than 0xff00 sections: the count is in section 0
        first = reader.array(shoff, 1, layout.section, "section header 0")
        shnum = int(first["size"][0])
    return reader.array(shoff, shnum, layout.section, "section headers")


def _table(reader: _Reader, layout: _Layout, sections: np.ndarray, kind: int,
           what: str) -> SymbolTable | None:
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
    strings = reader.section(sections[link], f"string table of {what}")
    # A name offset past the string table would read garbage: drop it.
    symbols = symbols[symbols["name"] < len(strings)]
    return SymbolTable(symbols, strings)


def _section_names(reader: _Reader, sections: np.ndarray, shstrndx: int) -> frozenset:
    if not 0 < shstrndx < len(sections):
        return frozenset()
    strings = reader.section(sections[shstrndx], "section name table")
    return frozenset(symbol_names(strings, np.unique(sections["name"]
                                                     [sections["name"] < len(strings)])))


def _needed(reader: _Reader, layout: _Layout, sections: np.ndarray) -> tuple:
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
    strings = reader.section(sections[link], "string table of .dynamic")
    offsets = dynamic["value"][(dynamic["tag"] == DT_NEEDED)
                               & (dynamic["value"] < len(strings))]
    return tuple(symbol_name(strings, int(off)) for off in offsets)


def _build_id(reader: _Reader, sections: np.ndarray) -> bytes:
    """The GNU build id note's bytes, b"" when the file has none."""
    for sec in sections[sections["type"] == SHT_NOTE]:
        data = reader.section(sec, "note section")
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
