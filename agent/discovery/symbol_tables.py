"""The symbol tables of an ELF file (.dynsym, .symtab) as numpy arrays, and
their names decoded from the string tables: only the names asked for, since
a big library's tables hold hundreds of thousands of them."""

from dataclasses import dataclass

import numpy as np

SHN_UNDEF = 0
STT_FUNC = 2
STT_GNU_IFUNC = 10
STB_GLOBAL = 1
STB_WEAK = 2
STB_GNU_UNIQUE = 10


@dataclass
class SymbolTable:
    symbols: np.ndarray          # structured: name, info, shndx, value, size
    strings: bytes


def alias_preference(name: str) -> tuple[int, int]:
    """printf over _IO_printf, free over __libc_free; C++ names stay whole."""
    underscores = 0 if name.startswith("_Z") else len(name) - len(name.lstrip("_"))
    return underscores, len(name)


def symbol_name(strings: bytes, offset: int) -> str:
    end = strings.find(b"\0", offset)
    raw = strings[offset:] if end < 0 else strings[offset:end]
    name = raw.decode("utf-8", "backslashreplace")
    # Linked outputs keep "name@@VERSION" in .symtab for .symver definitions.
    at = name.find("@")
    return name if at <= 0 else name[:at]


def symbol_names(strings: bytes, offsets: np.ndarray) -> list[str]:
    """symbol_name for many offsets at once. Symbol names are ASCII in
    practice: then one decode and one split serve them all, in C."""
    # Splitting a table costs time in its size, one find per name in the
    # number of names: a few names of a big .strtab are looked up one by one.
    if len(offsets) * 64 < len(strings) // 16 or not strings.isascii():
        return [symbol_name(strings, int(off)) for off in offsets]
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


def function_mask(symbols: np.ndarray) -> np.ndarray:
    kind = symbols["info"] & 0xF
    return (((kind == STT_FUNC) | (kind == STT_GNU_IFUNC))
            & (symbols["shndx"] != SHN_UNDEF) & (symbols["name"] != 0))


def starting_with(strings: bytes, offsets: np.ndarray, prefixes: tuple[bytes, ...]) -> np.ndarray:
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


def exported_mask(symbols: np.ndarray) -> np.ndarray:
    bind = symbols["info"] >> 4
    return (bind == STB_GLOBAL) | (bind == STB_WEAK) | (bind == STB_GNU_UNIQUE)


def defined_names(table: SymbolTable | None, exported_only: bool = False,
                  skip_values: np.ndarray | None = None,
                  local_only: bool = False) -> frozenset[str]:
    """Names of the functions `table` defines: exported ones only, local ones
    only, or all; none at an address in `skip_values`."""
    if table is None:
        return frozenset()
    mask = function_mask(table.symbols)
    if exported_only:
        mask &= exported_mask(table.symbols)
    if local_only:
        mask &= ~exported_mask(table.symbols)
    chosen = table.symbols[mask]
    if skip_values is not None and len(skip_values) and len(chosen):
        chosen = chosen[~np.isin(chosen["value"], skip_values)]
    return frozenset(symbol_names(table.strings, np.unique(chosen["name"])))


def defined_names_starting(tables: tuple[SymbolTable | None, SymbolTable | None],
                           prefixes: tuple[str, ...]) -> set[str]:
    """The functions of (.dynsym, .symtab), at any binding, whose names start
    with one of `prefixes`; only those names are decoded."""
    encoded = tuple(p.encode() for p in prefixes)
    found: set[str] = set()
    dynsym, symtab = tables
    for table in tables:
        if table is None:
            continue
        mask = function_mask(table.symbols)
        if table is symtab and dynsym is not None:
            # As defined_functions: .symtab's exports at addresses .dynsym
            # exports too are taken to repeat them.
            exported = dynsym.symbols["value"][function_mask(dynsym.symbols)]
            mask &= ~(exported_mask(table.symbols)
                      & np.isin(table.symbols["value"], exported))
        offsets = np.unique(table.symbols["name"][mask]).astype(np.int64)
        found.update(symbol_names(table.strings,
                                  offsets[starting_with(table.strings, offsets, encoded)]))
    return found
