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
        codes, errors = rowtext_codes(list(rows.error[failed]))
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
    """(name, values, present or None: every row, is_text), in their order;
    a text field's values are (distinct texts, each row's index)."""
    by_api = rows.api_groups()
    ev, p = rows.events, _present(rows, by_api)
    handles, streams = np.unique(ev["stream_handle"], return_inverse=True)
    return [("api", _by_value(list(rows.api)), None, True),
            ("stream", ([hex(h) for h in handles.tolist()], streams.reshape(-1)), None, True),
            ("sched_delay_ns", ev["sched_delay_ns"], None, False),
            ("op_id", ev["op_id"], p["op_id"], False),
            ("grid", _dims(ev, "grid"), p["launch"], True),
            ("block", _dims(ev, "block"), p["launch"], True),
            ("shared_mem_bytes", ev["shared_mem_bytes"], p["launch"], False),
            ("bytes", ev["bytes"], p["copy"], False),
            ("direction", _directions(rows, by_api), p["copy"], True),
            ("retired_ns", ev["retired_ns"], p["retired"], False),
            ("return_code", ev["ret"], p["returned"], False),
            ("outcome", outcome_texts(rows), None, True),
            ("device", ev["device"], p["device"], False)]


def fields_at(fields: list, at: np.ndarray) -> list:
    """call_fields of the calls `at` (indices) alone: built from them, the
    rows of a subset cost no copy of the whole batch's rows."""
    out = []
    for name, values, present, is_text in fields:
        values = (values[0], values[1][at]) if is_text else values[at]
        out.append((name, values, None if present is None else present[at], is_text))
    return out


def _int64(values) -> np.ndarray:
    """int64 varints' values: a negative one as its 64-bit two's complement."""
    return np.asarray(values).astype(np.int64).view(np.uint64)


def call_rows(fields: list, n: int) -> Rows:
    """Every call's annotations (call_fields of n calls), a row each, built
    with numpy."""
    out = Rows(n)
    for name, values, present, is_text in fields:
        if is_text:
            keys, codes = values
            entries = [annotation(name, k) for k in keys] + [b""]
            if present is not None:
                codes = np.where(present, codes, len(entries) - 1)
            out.table(codes, entries)
            continue
        v = _int64(values)
        inner = field_str(DA_NAME, name) + varint(DA_INT << 3)
        one = (Rows(n).const(_OUTER).varint(len(inner) + varint_lengths(v))
               .const(inner).varint(v))
        if present is None:
            out.rows(one)
        else:
            out.where(present, one)
    return out


def call_bytes(fields: list, i: int) -> bytes:
    """Call i's annotations on their own, from a batch's call_fields."""
    out = b""
    for name, values, present, is_text in fields:
        if present is not None and not present[i]:
            continue
        if is_text:
            keys, codes = values
            out += annotation(name, keys[codes[i]])
        else:
            out += annotation(name, int(_int64(values[i:i + 1])[0].astype(np.int64)))
    return out
