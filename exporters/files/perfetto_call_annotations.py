"""The debug annotations of each GPU/NPU call in a Perfetto trace: the
fields the UI lists under a selected slice. What the Chrome export's args
hold (api, op id, stream, sched delay, bytes and direction, when retired),
and more (a launch's grid, block and shared memory; the return code and
device where measured; the outcome in words). Built for a whole batch with numpy (call_rows), and
one call at a time for the reference path and rare rows (call_bytes): the
two give the same bytes."""

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf.device import NOT_RETIRED

from mmtrace.exporters.files.perfetto_anomalies import (DA_INT, DA_NAME, TE_DEBUG_ANNOTATIONS,
                                                        annotation)
from mmtrace.exporters.files.protowire import field_str, varint
from mmtrace.exporters.files.rowtext import Rows, varint_lengths
from mmtrace.exporters.files.rowtext import codes as rowtext_codes

_OUTER = varint(TE_DEBUG_ANNOTATIONS << 3 | 2)
TEXT, INT, FEW = "text", "int", "few"       # call_fields' kinds of field


def _present(rows, by_api) -> dict:
    """Which rows carry each conditional annotation."""
    ev = rows.events
    return {"launch": by_api.of_kinds("launch"),
            "copy": rows.direction != None,  # noqa: E711  (elementwise on an object array)
            "op_id": ev["op_id"] != 0,
            "retired": ev["retired_ns"] != NOT_RETIRED,
            "returned": (ev["flags"] & device_stream.FLAG_RETURNED) != 0,
            "device": ev["device"] >= 0}


def outcome_texts(rows) -> tuple[list[str], np.ndarray]:
    """Each call's outcome in words: "ok", its error ("failed:
    cudaErrorInsufficientDriver (35)"), or "return not probed" (a launch
    its probe did not sample); as (distinct texts, each row's index)."""
    texts = ["ok", "return not probed"]
    found = np.where(device_stream.returned(rows.events), 0, 1)
    failed = rows.failed
    if failed.any():
        codes, errors = rowtext_codes(rows.error[failed])
        found[failed] = codes + len(texts)
        texts += [f"failed: {e}" for e in errors]
    return texts, found


def _directions(rows, by_api) -> tuple[list[str], np.ndarray]:
    """(distinct directions, each row's index): a copy's direction in words
    follows from its API id and direction code."""
    keys = by_api.inverse << 8 | rows.events["direction"].astype(np.int64)
    _, first, found = np.unique(keys, return_index=True, return_inverse=True)
    index, texts = rowtext_codes([d or "" for d in rows.direction[first]])
    return [str(t) for t in texts], index[found.reshape(-1)]


def _by_value(values) -> tuple[list[str], np.ndarray]:
    """(distinct texts, each row's index into them) of a list of texts."""
    codes, keys = rowtext_codes(values)
    return [str(k) for k in keys], codes


def _dims(ev, which: str) -> tuple[list[str], np.ndarray]:
    x, y, z = (ev[f"{which}_{axis}"].astype(np.uint64) for axis in "xyz")
    if len(x) and max(int(x.max()), int(y.max()), int(z.max())) >= 1 << 21:
        triples = np.stack([x, y, z], axis=1)
        keys, codes = np.unique(triples, axis=0, return_inverse=True)
        return [f"{a}x{b}x{c}" for a, b, c in keys.tolist()], codes.reshape(-1)
    # Each triple as one integer, in the same order (a row-wise unique
    # sorts rows as bytes, several times slower).
    packed, codes = np.unique(x << np.uint64(42) | y << np.uint64(21) | z, return_inverse=True)
    packed = packed.tolist()
    mask = (1 << 21) - 1
    return ([f"{k >> 42}x{k >> 21 & mask}x{k & mask}" for k in packed], codes.reshape(-1))


def call_fields(rows):
    """(name, values, present or None: every row, kind), in their order;
    kind is TEXT (values: (distinct texts, each row's index)), INT, or FEW:
    an integer of few values in a batch, each value encoded once (call_rows)."""
    by_api = rows.api_groups()
    ev, p = rows.events, _present(rows, by_api)
    handles, streams = np.unique(ev["stream_handle"], return_inverse=True)
    return [("api", _by_value(rows.api), None, TEXT),
            ("stream", ([hex(h) for h in handles.tolist()], streams.reshape(-1)), None, TEXT),
            ("sched_delay_ns", ev["sched_delay_ns"], None, INT),
            ("op_id", ev["op_id"], p["op_id"], INT),
            ("grid", _dims(ev, "grid"), p["launch"], TEXT),
            ("block", _dims(ev, "block"), p["launch"], TEXT),
            ("shared_mem_bytes", ev["shared_mem_bytes"], p["launch"], FEW),
            ("bytes", ev["bytes"], p["copy"], INT),
            ("direction", _directions(rows, by_api), p["copy"], TEXT),
            ("retired_ns", ev["retired_ns"], p["retired"], INT),
            ("return_code", ev["ret"], p["returned"], FEW),
            ("outcome", outcome_texts(rows), None, TEXT),
            ("device", ev["device"], p["device"], FEW)]


def fields_at(fields: list, at: np.ndarray) -> list:
    """call_fields of the calls `at` (indices) alone: built from them, the
    rows of a subset cost no copy of the whole batch's rows."""
    out = []
    for name, values, present, kind in fields:
        values = (values[0], values[1][at]) if kind == TEXT else values[at]
        out.append((name, values, None if present is None else present[at], kind))
    return out


def _int64(values) -> np.ndarray:
    """int64 varints' values: a negative one as its 64-bit two's complement."""
    return np.asarray(values).astype(np.int64).view(np.uint64)


def call_rows(fields: list, n: int) -> Rows:
    """Every call's annotations (call_fields of n calls), a row each, built
    with numpy. Neighbouring fields of few values (TEXT, and FEW integers
    of at most MAX_FEW values in the batch) go as one column of the rows,
    each combination of theirs that occurs encoded once: a third fewer
    columns than one a field."""
    out = Rows(n)
    run: list = []                  # (codes, entries) of neighbouring few-valued fields
    for name, values, present, kind in fields:
        if kind != INT:
            keys, codes = values if kind == TEXT else _few(values)
            if len(keys) <= MAX_FEW or kind == TEXT:
                entries = [annotation(name, k) for k in keys] + [b""]
                if present is not None:
                    codes = np.where(present, codes, len(entries) - 1)
                run.append((codes, entries))
                continue
        for table in _combined(run):
            out.table(*table)
        run = []
        v = _int64(values)
        inner = field_str(DA_NAME, name) + varint(DA_INT << 3)
        one = (Rows(n).const(_OUTER).varint(len(inner) + varint_lengths(v))
               .const(inner).varint(v))
        if present is None:
            out.rows(one)
        else:
            out.where(present, one)
    for table in _combined(run):
        out.table(*table)
    return out


MAX_INDEX = 1 << 12     # codes a lookup table may span (past it, a sort)
MAX_FEW = 64            # a FEW field of more values in a batch goes as integers
# Combinations a table may hold: each is encoded in Python, so many distinct
# ones (a crafted recording) go as several tables, as dear as a column each.
MAX_COMBINATIONS = 256


def _few(values: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(distinct integers, each row's index into them); without a sort
    where they span less than MAX_INDEX."""
    v = np.asarray(values).astype(np.int64)
    if not len(v):
        return [], np.zeros(0, np.int64)
    low = int(v.min())
    used, index = _used(v - low, int(v.max()) - low + 1)
    return (used + low).tolist(), index


def _used(code: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the codes in 0..size that occur, ascending; each row's index into them)."""
    if size > MAX_INDEX:
        used, index = np.unique(code, return_inverse=True)
        return used, index.reshape(-1)
    used = np.flatnonzero(np.bincount(code, minlength=size))
    lookup = np.zeros(size, np.int64)
    lookup[used] = np.arange(len(used))
    return used, lookup[code]


def _combined(run: list) -> list[tuple[np.ndarray, list[bytes]]]:
    """Neighbouring fields' (codes, entries) as few tables, in order: each
    row's code, and the entry of each combination that occurs (its fields'
    entries joined); a new table where one would pass MAX_COMBINATIONS."""
    tables = []
    for codes, more in run:
        codes = np.asarray(codes, np.int64)
        if not tables:
            tables.append((codes, more))
            continue
        code, entries = tables[-1]
        used, joined = _used(code * len(more) + codes, len(entries) * len(more))
        if len(used) > MAX_COMBINATIONS:
            tables.append((codes, more))
            continue
        tables[-1] = (joined, [entries[u // len(more)] + more[u % len(more)]
                               for u in used.tolist()])
    return tables


def call_bytes(fields: list, i: int) -> bytes:
    """Call i's annotations on their own, from a batch's call_fields."""
    out = b""
    for name, values, present, kind in fields:
        if present is not None and not present[i]:
            continue
        if kind == TEXT:
            keys, codes = values
            out += annotation(name, keys[codes[i]])
        else:
            out += annotation(name, int(_int64(values[i:i + 1])[0].astype(np.int64)))
    return out
