"""Parsed ELF files kept per file version, for whoever names the addresses
of many events against the same few libraries. One ElfCache is made by the
owner of a tracing session and handed to what reads files through it (the
address resolver, the process images) and to what knows when a file is no
longer needed (the device probes, which forget released files)."""

import os
import threading
from collections import OrderedDict

from mmtrace.agent.discovery.elf_reader import FileKey
from mmtrace.agent.discovery.elf_symbols import ElfSymbols


class ElfCache:
    """ElfSymbols per file version, least recently used dropped first."""

    def __init__(self, max_files: int = 128):
        self.max_files = max_files
        self._files: OrderedDict[FileKey, ElfSymbols] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, path: str | os.PathLike) -> ElfSymbols:
        """Parsed symbols of `path`, kept per file version (dev, inode,
        mtime, size): a replaced file is parsed again, a link is not.
        Raises NotElfError, ElfError, OSError."""
        path = os.fspath(path)
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
