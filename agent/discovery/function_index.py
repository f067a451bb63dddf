"""Which function an ELF virtual address is in: the defined functions of a
file's symbol tables sorted by address, searched in one vectorised pass per
batch of addresses."""

from dataclasses import dataclass

import numpy as np

from mmtrace.agent.discovery.symbol_tables import (STB_GLOBAL, STB_WEAK, SymbolTable,
                                                   alias_preference, function_mask,
                                                   symbol_name)


@dataclass
class FunctionIndex:
    """Defined functions sorted by address. Lookups search the first entry of
    each address; its aliases (same address, same binding) follow it."""
    starts: np.ndarray           # uint64, one per address, sorted
    ends: np.ndarray             # uint64; a size-0 symbol matches only its own address
    cover: np.ndarray            # int64: the entry <= i reaching farthest (nested symbols)
    first: np.ndarray            # int64: where each address's aliases begin in the columns
    count: np.ndarray            # int64: how many aliases share its size class and binding
    table: np.ndarray            # uint8 column, every alias: 0 = .dynsym, 1 = .symtab
    name_offsets: np.ndarray     # uint32 column, every alias

    def find(self, vaddrs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(entry, found mask) per virtual address: the function whose
        [value, value + size) holds it."""
        i = np.searchsorted(self.starts, vaddrs, side="right").astype(np.int64) - 1
        valid = i >= 0
        safe = np.where(valid, i, 0)
        hit = valid & (vaddrs < self.ends[safe])
        # Not inside the nearest symbol: maybe inside an earlier, larger one
        # (a size-0 assembler label inside a function).
        covering = self.cover[safe]
        use_cover = valid & ~hit & (vaddrs < self.ends[covering])
        return np.where(use_cover, covering, safe), hit | use_cover

    def entry_name(self, tables: tuple[SymbolTable | None, ...], j: int) -> str:
        """The preferred name among entry j's aliases."""
        first = int(self.first[j])
        aliases = [symbol_name(tables[int(self.table[k])].strings, int(self.name_offsets[k]))
                   for k in range(first, first + int(self.count[j]))]
        return min(aliases, key=alias_preference)


def build_function_index(tables: tuple[SymbolTable | None, ...]) -> FunctionIndex:
    parts = []
    for table_id, table in enumerate(tables):
        if table is None:
            continue
        syms = table.symbols[function_mask(table.symbols)]
        syms = syms[syms["value"] != 0]
        bind = syms["info"] >> 4
        # When several names share an address prefer a sized, global one.
        rank = np.where(bind == STB_GLOBAL, 0, np.where(bind == STB_WEAK, 1, 2))
        parts.append((syms["value"].astype(np.uint64), syms["size"].astype(np.uint64),
                      rank, np.full(len(syms), table_id, dtype=np.uint8),
                      syms["name"].astype(np.uint32)))
    if not parts:
        none = np.zeros(0, dtype=np.int64)
        return FunctionIndex(none.astype(np.uint64), none.astype(np.uint64), none, none,
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
    return FunctionIndex(starts, ends, cover.astype(np.int64), first.astype(np.int64),
                         count.astype(np.int64), table, names)
