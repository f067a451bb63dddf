"""ELF load segments: where a symbol's address lies in its file, the
offset a uprobe is attached at."""

import os
import struct

_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")
_ELF64_PHDR = struct.Struct("<IIQQQQQQ")
PT_LOAD = 1


def load_segments(fd: int) -> list[tuple[int, int, int]]:
    """(vaddr, offset, filesz) of each PT_LOAD segment of a 64-bit
    little-endian ELF file (x86-64, aarch64)."""
    head = os.pread(fd, _ELF64_HEADER.size, 0)
    if len(head) < _ELF64_HEADER.size or head[:4] != b"\x7fELF":
        raise ValueError("expected an ELF file")
    if head[4] != 2 or head[5] != 1:
        raise ValueError(f"expected a 64-bit little-endian ELF file, class {head[4]} "
                         f"byte order {head[5]}")
    fields = _ELF64_HEADER.unpack(head)
    phoff, phentsize, phnum = fields[5], fields[9], fields[10]
    if phentsize != _ELF64_PHDR.size:
        raise ValueError(f"expected program headers of {_ELF64_PHDR.size} bytes, "
                         f"got {phentsize}")
    table = os.pread(fd, phentsize * phnum, phoff)
    if len(table) != phentsize * phnum:
        raise ValueError("program headers cut short: the file changed or is truncated")
    out = []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = _ELF64_PHDR.unpack_from(
            table, i * phentsize)
        if p_type == PT_LOAD:
            out.append((p_vaddr, p_offset, p_filesz))
    return out


def file_offset(segments, vaddr: int) -> int | None:
    """The file offset of `vaddr`; None outside every loaded segment."""
    for seg_vaddr, seg_offset, filesz in segments:
        if seg_vaddr <= vaddr < seg_vaddr + filesz:
            return vaddr - seg_vaddr + seg_offset
    return None
