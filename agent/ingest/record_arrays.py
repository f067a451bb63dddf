"""Copying structured records fast.

numpy copies records that hold byte-string or void fields field by field,
about twenty times slower than copying their bytes; these helpers select,
join and store whole records through byte views instead."""

import numpy as np


def rows_of(records: np.ndarray) -> np.ndarray:
    """The records as a (n, itemsize) uint8 view (a copy if not contiguous)."""
    return np.ascontiguousarray(records).view(np.uint8).reshape(
        len(records), records.dtype.itemsize)


def take(records: np.ndarray, which) -> np.ndarray:
    """records[which] (indices, mask or slice), copied as bytes."""
    return np.ascontiguousarray(rows_of(records)[which]).view(records.dtype).reshape(-1)


def concat(parts: list[np.ndarray]) -> np.ndarray:
    dtype = parts[0].dtype
    return np.concatenate([rows_of(p) for p in parts]).view(dtype).reshape(-1)


def stamped_from(records: np.ndarray, ts_ns: int) -> np.ndarray:
    """The records whose ts_ns is ts_ns or later (as signed nanoseconds), in
    their order: `records` itself where every one is (a block inside a
    window is not copied), else a copy of those, as bytes. ts_ns must be a
    native 8-byte integer field, as every schema's is."""
    stamps = records["ts_ns"]
    if stamps.dtype.kind not in "iu" or stamps.dtype.itemsize != 8 or not stamps.dtype.isnative:
        raise TypeError(f"expected ts_ns as native 8-byte integers, got {stamps.dtype}")
    keep = stamps.view(np.int64) >= ts_ns
    return records if keep.all() else take(records, keep)
