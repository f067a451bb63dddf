"""One file as discovery sees it: whether it defines a wanted symbol (parsed
once per file version, remembered for the most recently seen files), the
target it makes, and why a file that runs CUDA code cannot be probed."""

import os
import stat
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from mmtrace.agent.discovery.elf_reader import ElfError, FileKey, NotElfError
from mmtrace.agent.discovery.elf_symbols import ElfSymbols
from mmtrace.agent.discovery.recent import Recent

# Which symbols to probe. A `prefixes` attribute (a tuple of str), where
# given, says every wanted name starts with one of them: only such names of
# a file are decoded.
Wanted = Callable[[str], bool]

MAX_REMEMBERED_FILES = 8192     # files whose identity and parse result are kept
MAX_UNTRACEABLE = 256           # untraceable files named (all are counted)

_GONE = (FileNotFoundError, ProcessLookupError)


@dataclass(frozen=True)
class LibraryTarget:
    """One file to attach uprobes to."""
    path: str                   # host path bcc can open (/proc/PID/root/... for containers)
    dev: int
    inode: int
    symbols: frozenset[str]     # the wanted symbols this file defines
    origin: str                 # "maps:<pid>", "site-packages", "system" or "--lib"


class LibraryFiles:
    """The wanted symbols of each file looked at, per file version, for the
    MAX_REMEMBERED_FILES seen last. Counts into `counters`: examined (files
    parsed), not_elf, elf_unreadable, untraceable; `untraceable` names the
    first MAX_UNTRACEABLE such files (shown path -> why)."""

    def __init__(self, wanted: Wanted, counters: Counter):
        self.wanted = wanted
        self.counters = counters
        self.untraceable: dict[str, str] = {}
        self._wanted_by_file: Recent = Recent(MAX_REMEMBERED_FILES)

    def __len__(self) -> int:
        return len(self._wanted_by_file)

    def look_at(self, found: dict, host_path: str, origin: str,
                plain_path: str | None = None) -> tuple[str | None, tuple[int, int] | None]:
        """Add `host_path` to `found` when it defines a wanted symbol. First:
        None when the file is settled (looked at, or already found), the
        reason when it cannot be reached now and is worth another look later.
        Second: the (dev, inode) of the file when it is a target (None when it
        is not, or cannot be looked at now)."""
        try:
            st = os.stat(host_path)
        except FileNotFoundError:
            return "missing_file", None
        except OSError:
            return "unreadable_file", None
        if not stat.S_ISREG(st.st_mode):
            return None, None
        ident = (st.st_dev, st.st_ino)
        if ident in found:
            return None, ident
        symbols = self._wanted_symbols(host_path, st, plain_path or host_path)
        if isinstance(symbols, str):
            return symbols, None
        if not symbols:
            return None, None
        found[ident] = LibraryTarget(_usable_path(host_path, plain_path, st),
                                     st.st_dev, st.st_ino, symbols, origin)
        return None, ident

    def defines_nothing(self, path: str) -> bool:
        """`path` was parsed and defines no wanted symbol."""
        try:
            return self._wanted_by_file.get(FileKey.of(os.stat(path))) == frozenset()
        except OSError:
            return False

    def forget(self, idents: set) -> None:
        """Drop what is remembered of these (dev, inode): found again, they
        are parsed afresh."""
        for key in [k for k in self._wanted_by_file if (k.dev, k.ino) in idents]:
            del self._wanted_by_file[key]

    def _wanted_symbols(self, path: str, st: os.stat_result,
                        shown_as: str) -> frozenset[str] | str:
        """The wanted symbols `path` defines, at any binding (a static
        runtime's are local), parsed once per file version; a reason string
        when the file cannot be read now."""
        key = FileKey.of(st)
        cached = self._wanted_by_file.get(key)
        if cached is not None:
            return cached
        try:
            elf = ElfSymbols.read(path)
        except NotElfError:
            self.counters["not_elf"] += 1
            result = frozenset()
        except ElfError:
            self.counters["elf_unreadable"] += 1
            result = frozenset()
        except _GONE:
            return "vanished"
        except OSError:
            return "unreadable_file"
        else:
            self.counters["examined"] += 1
            key = elf.key
            result = self._wanted_of(elf)
            self._note_untraceable(elf, result, shown_as)
        self._wanted_by_file[key] = result
        return result

    def _wanted_of(self, elf: ElfSymbols) -> frozenset[str]:
        prefixes = getattr(self.wanted, "prefixes", None)
        names = (elf.defined_functions_starting(prefixes) if prefixes
                 else elf.defined_functions(local=True))
        return frozenset(name for name in names if self.wanted(name))

    def _note_untraceable(self, elf: ElfSymbols, wanted: frozenset, shown_as: str) -> None:
        why = untraceable_reason(elf) if not wanted else None
        if why and shown_as not in self.untraceable:
            if len(self.untraceable) < MAX_UNTRACEABLE:
                self.untraceable[shown_as] = why
            self.counters["untraceable"] += 1


def _usable_path(host_path: str, plain_path: str | None, st: os.stat_result) -> str:
    """The plain path, symlinks resolved, when it names the same file on
    the host (no container in between), else the /proc/PID/root path."""
    if plain_path:
        try:
            plain = os.stat(plain_path)
        except OSError:
            return host_path
        if (plain.st_dev, plain.st_ino) == (st.st_dev, st.st_ino):
            return os.path.realpath(plain_path)
    return host_path


def untraceable_reason(elf: ElfSymbols) -> str | None:
    """Why a file that defines no probed symbol still runs CUDA code that
    cannot be traced, else None: a CUDA runtime linked statically (nvcc's
    default) into a file stripped of its symbol table. The runtime's
    functions then have no names to attach to. Its signs: kernels embedded
    (.nvFatBinSegment) and neither libcudart nor libcuda linked."""
    if elf.has_symbol_table or ".nvFatBinSegment" not in elf.section_names:
        return None
    if any(lib.startswith(("libcudart.so", "libcuda.so")) for lib in elf.needed):
        return None
    return ("carries a static CUDA runtime (embedded kernels in .nvFatBinSegment, no "
            "libcudart linked) and has no symbol table (stripped): its CUDA calls cannot "
            "be probed; build it with -cudart shared, or keep its symbols (no strip, no -s)")


def check_extra_path(path: str | os.PathLike) -> str:
    """A --lib path made absolute; ValueError naming the path and the problem."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ValueError(f"--lib {path}: no such file; expected an ELF shared library "
                         "or executable") from None
    except OSError as exc:
        raise ValueError(f"--lib {path}: cannot stat it ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"--lib {path}: not a regular file; expected an ELF shared library "
                         "or executable")
    try:
        ElfSymbols.read(path)
    except NotElfError as exc:
        raise ValueError(f"--lib {path}: not an ELF file ({exc})") from None
    except ElfError as exc:
        raise ValueError(f"--lib {path}: unreadable ELF file ({exc})") from None
    except OSError as exc:
        raise ValueError(f"--lib {path}: cannot read it ({exc.strerror})") from None
    return path
