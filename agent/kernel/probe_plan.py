"""The probes a file can take: every table symbol it defines, at the file
offset its uprobe goes on, with the cookie its events carry."""

import re

from mmtrace.bpf import device as device_stream

from mmtrace.agent.discovery.elf_reader import load_segments_of
from mmtrace.agent.kernel.probed_file import (ENTRY, FAILED, LAUNCHES_OFF, NOT_FOUND, RETURN,
                                              Probe, ProbedFile)
from mmtrace.agent.kernel.probed_symbols import ProbedSymbols

# aclnn names given an id (a recording's symbol table: at most ~4 MiB of
# JSON); later or longer ones are named by address in userspace instead.
MAX_SYMBOL_IDS = 1 << 14
MAX_SYMBOL_NAME = 256


class SymbolsUnreadable(Exception):
    """The file's symbols or program headers could not be read."""


class SymbolIds:
    """Pattern APIs (aclnn): one id per symbol name, across libraries, kept
    for as long as the probes run (events recorded name it)."""

    def __init__(self):
        self._ids: dict[str, int] = {}

    def id_of(self, symbol: str) -> int:
        """The id of an aclnn name; 0, named by address instead, past
        MAX_SYMBOL_IDS names or MAX_SYMBOL_NAME characters."""
        known = self._ids.get(symbol)
        if known is None and len(self._ids) < MAX_SYMBOL_IDS \
                and len(symbol) <= MAX_SYMBOL_NAME:
            known = self._ids[symbol] = len(self._ids) + 1
        return known or 0

    def names(self) -> dict[int, str]:
        """Symbol id (in an event's symbol_id) -> aclnn symbol."""
        return {symbol_id: name for name, symbol_id in self._ids.items()}


class ProbePlanner:
    """Plans the probes of files for one API table."""

    def __init__(self, table: device_stream.ApiTable, symbols: ProbedSymbols,
                 symbol_ids: SymbolIds):
        self.table, self.symbols, self.symbol_ids = table, symbols, symbol_ids
        pattern = "|".join([re.escape(s) for s in symbols.named]
                           + [api.pattern for api in symbols.patterns])
        self._search = f"^({pattern})(@.*)?$".encode()

    def plan(self, library: ProbedFile, offered: frozenset, launches: bool) -> list[Probe]:
        """The probes `library` can take: every table symbol it defines
        (only those `offered`, when given), and a NOT_FOUND row for each
        symbol of a family it has that it lacks. Per-launch probes carry
        LAUNCHES_OFF while `launches` is off. SymbolsUnreadable says why
        there are none."""
        vaddrs, segments = self._addresses(library, offered)
        probes = []
        seen_at: dict[tuple[int, str], str] = {}
        for symbol in sorted(vaddrs):
            api = self.symbols.api_of(symbol)
            symbol_id = self.symbol_ids.id_of(symbol) if api.pattern is not None else 0
            cookie = device_stream.cookie(api.id, self.table.slots.get(api.id, 0), symbol_id)
            offset = segments.offset_of_vaddr(vaddrs[symbol])
            for point in (ENTRY, RETURN) if api.return_impl else (ENTRY,):
                probe = Probe(library, api, symbol, vaddrs[symbol], offset, point, cookie)
                twin = seen_at.setdefault((probe.vaddr, point), symbol)
                if twin != symbol:
                    # Aliases share code: one probe, or every call counts twice.
                    probe.state, probe.reason = FAILED, f"same address as {twin}, probed as that"
                elif offset is None:
                    probe.state, probe.reason = FAILED, "address outside every loaded segment"
                elif api.per_launch and not launches:
                    probe.reason = LAUNCHES_OFF
                probes.append(probe)
        families = {self.symbols.api_of(s).library for s in vaddrs}
        for symbol, api in self.symbols.named.items():
            if api.library in families and symbol not in vaddrs:
                probes.append(Probe(library, api, symbol, 0, None, ENTRY, 0, state=NOT_FOUND,
                                    reason=f"{api.library} library without this symbol"))
        return probes

    def _addresses(self, library: ProbedFile, offered: frozenset):
        """Symbol -> address of the table symbols the file defines, and its
        load segments."""
        from bcc import BPF
        try:
            found = BPF.get_user_functions_and_addresses(library.attach_path, self._search)
            segments = load_segments_of(library.fd, library.attach_path.decode())
        except Exception as exc:  # bcc raises bare Exception; ours raise ValueError/OSError
            raise SymbolsUnreadable(f"its symbols cannot be read: {exc}") from None
        vaddrs: dict[str, int] = {}
        for raw, vaddr in found:
            symbol = raw.decode(errors="replace").split("@", 1)[0]
            if offered and symbol not in offered:
                continue
            if self.symbols.api_of(symbol) is not None and vaddr:
                vaddrs.setdefault(symbol, vaddr)
        return vaddrs, segments
