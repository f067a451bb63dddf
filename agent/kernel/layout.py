"""Check that a numpy event dtype matches the struct the kernel compiled."""

import ctypes

import numpy as np


class LayoutMismatch(RuntimeError):
    pass


def ctypes_fields(struct_type) -> list[tuple[str, int, int]]:
    """(name, offset, size) of every field of a ctypes Structure."""
    out = []
    for name, _ in struct_type._fields_:
        desc = getattr(struct_type, name)
        out.append((name, desc.offset, desc.size))
    return out


def check_layout(what: str, expected: np.dtype, compiled) -> None:
    """Raise LayoutMismatch naming the first difference, else return None."""
    got = {name: (offset, size) for name, offset, size in ctypes_fields(compiled)}
    # bcc pads structs with anonymous fields named __pad_N.
    got = {k: v for k, v in got.items() if not k.startswith("__pad")}
    for name in expected.names:
        field_type, offset = expected.fields[name][:2]
        if name not in got:
            raise LayoutMismatch(
                f"{what}: expected a field {name!r} at offset {offset}, "
                f"the compiled program has fields {sorted(got)}")
        got_offset, got_size = got[name]
        if (got_offset, got_size) != (offset, field_type.itemsize):
            raise LayoutMismatch(
                f"{what}.{name}: expected offset {offset} size {field_type.itemsize}, "
                f"the compiled program has offset {got_offset} size {got_size}")
    extra = sorted(set(got) - set(expected.names))
    if extra:
        raise LayoutMismatch(f"{what}: the compiled program has fields {extra} "
                             f"that the decoder does not know")
    if ctypes.sizeof(compiled) != expected.itemsize:
        raise LayoutMismatch(
            f"{what}: expected {expected.itemsize} bytes, "
            f"the compiled program has {ctypes.sizeof(compiled)}")
