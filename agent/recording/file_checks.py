"""What a recording's header, meta and footer must hold before anything
reads them: types and ranges of every field a reader uses. Each check
raises ValueError naming the field, what was expected and what arrived."""

import math

import numpy as np

from mmtrace.bpf import device as device_stream
from mmtrace.bpf import sched as sched_stream

MAX_SCHEMAS = 64
MAX_FIELDS = 256
MAX_RECORD_BYTES = 1 << 16
MAX_TABLE_ROWS = 1 << 20
RECORD_KINDS = "biufSV"     # never object or datetime fields: the bytes are read raw

# Per known schema, the fields its readers take (name -> numpy type string).
READER_FIELDS = {
    "cpu.runq": {name: sched_stream.RUNQ_EVENT.fields[name][0].str
                 for name in sched_stream.RUNQ_EVENT.names
                 if name not in ("prev_tid", "blocked_ns")},   # later than format 1.0
    "model.entropy": {"ts_ns": "<u8", "value": "<f8", "head": "<u4", "layer": "<u4",
                      "modality": "<u4"},
    "request.latency": {"ts_ns": "<u8", "value_s": "<f8", "series": "<u4"},
}
# Read as whole records (byte copies), so the layout must be exactly this one.
EXACT_LAYOUTS = {"dev.event": device_stream.DEV_EVENT}

# key: (type, low, high); `float` excludes its low end, `at_least` includes it.
P99_RANGES = {
    "window_s": (float, 0.0, 3600.0), "baseline_windows": (int, 1, 100_000),
    "min_baseline_windows": (int, 1, 100_000), "factor": (float, 0.0, 1e6),
    "floor_s": ("at_least", 0.0, 3600.0), "consecutive": (int, 1, 100_000),
    "min_samples": (int, 0, 1 << 40), "clear_factor": (float, 0.0, 1e6),
    "clear_windows": (int, 1, 100_000)}
ENTROPY_RANGES = {"tau": ("at_least", 0.0, 1.0), "consecutive": (int, 1, 100_000),
                  "delta_sigma": ("at_least", 0.0, 1e6)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _want(ok: bool, where: str, expected: str, value):
    if not ok:
        shown = repr(value)
        raise ValueError(f"{where}: expected {expected}, got "
                         f"{shown if len(shown) <= 60 else shown[:57] + '...'}")


def _count(value, where: str):
    _want(_is_int(value) and value >= 0, where, "a non-negative integer", value)


def _ranged(value, kind, low, high, where):
    if kind is int:
        _want(_is_int(value) and low <= value <= high, where,
              f"an integer in {low}..{high}", value)
    elif kind == "at_least":
        _want(_is_number(value) and low <= value <= high, where,
              f"a finite number in {low}..{high}", value)
    else:
        _want(_is_number(value) and low < value <= high, where,
              f"a finite number above {low} and at most {high}", value)


def schema_dtype(name, descr) -> np.dtype:
    """The record layout of one header schema, checked for what readers need."""
    where = f"header schema {name!r}"
    _want(isinstance(name, str) and 0 < len(name) <= 64, "header schema name",
          "a short string", name)
    _want(isinstance(descr, list) and 0 < len(descr) <= MAX_FIELDS, where,
          f"a list of 1..{MAX_FIELDS} [field, type] pairs", descr)
    pairs = []
    for item in descr:
        _want(isinstance(item, list) and len(item) == 2
              and all(isinstance(x, str) and 0 < len(x) <= 64 for x in item),
              where, "[field, type] pairs of short strings", item)
        pairs.append((item[0], item[1]))
    try:
        dtype = np.dtype(pairs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: an invalid record layout ({exc})") from None
    for field in dtype.names:
        ftype = dtype.fields[field][0]
        _want(ftype.kind in RECORD_KINDS and ftype.shape == () and ftype.itemsize > 0,
              f"{where} field {field!r}", "a plain number, byte string or padding", ftype.str)
    _want(0 < dtype.itemsize <= MAX_RECORD_BYTES, where,
          f"records of 1..{MAX_RECORD_BYTES} bytes", dtype.itemsize)
    _want("ts_ns" in dtype.names and dtype.fields["ts_ns"][0].kind in "iu"
          and dtype.fields["ts_ns"][0].itemsize == 8, where,
          "an 8-byte integer field 'ts_ns'", dtype.names)
    if name in EXACT_LAYOUTS:
        _want(dtype == EXACT_LAYOUTS[name], where,
              f"the {EXACT_LAYOUTS[name].itemsize}-byte device event layout", descr)
    for field, ftype in READER_FIELDS.get(name, {}).items():
        got = dtype.fields[field][0].str if field in dtype.names else None
        _want(got == ftype, f"{where} field {field!r}", ftype, got)
    return dtype


def check_header(header) -> dict[str, np.dtype]:
    """The schemas of a header document, by name."""
    _want(isinstance(header, dict), "header", "a JSON object", type(header).__name__)
    schemas = header.get("schemas")
    _want(isinstance(schemas, dict) and len(schemas) <= MAX_SCHEMAS, "header 'schemas'",
          f"an object of at most {MAX_SCHEMAS} record layouts", schemas)
    return {name: schema_dtype(name, descr) for name, descr in schemas.items()}


def _string_table(value, where):
    _want(isinstance(value, list) and len(value) <= MAX_TABLE_ROWS
          and all(isinstance(x, str) for x in value), where, "a list of strings", value)


def _settings(value, ranges, where):
    _want(isinstance(value, dict), where, "an object", value)
    for key, item in value.items():
        if key in ranges:
            _ranged(item, *ranges[key], f"{where}.{key}")


def check_meta(doc):
    """One meta chunk: the tables and settings readers take from it."""
    _want(isinstance(doc, dict), "meta", "a JSON object", type(doc).__name__)
    if "apis" in doc:
        apis = doc["apis"]
        _want(isinstance(apis, list) and len(apis) <= 1 << 16, "meta 'apis'", "a list", apis)
        for api in apis:
            _want(isinstance(api, dict) and _is_int(api.get("id")) and 0 <= api["id"] < 1 << 16
                  and all(isinstance(api.get(k), str) for k in ("symbol", "api", "stream", "kind"))
                  and isinstance(api.get("fields", []), list)
                  and all(isinstance(f, str) for f in api.get("fields", []))
                  and isinstance(api.get("sync_scope"), (str, type(None)))
                  and isinstance(api.get("library", ""), str),
                  "meta 'apis' entry", "an API description (id, symbol, api, stream, kind)",
                  api)
    if "op_names" in doc:
        rows = doc["op_names"]
        _want(isinstance(rows, list) and len(rows) <= MAX_TABLE_ROWS, "meta 'op_names'",
              "a list of [pid, address, name]", rows)
        for row in rows:
            _want(isinstance(row, list) and len(row) == 3 and _is_int(row[0])
                  and 0 <= row[0] < 1 << 32 and _is_int(row[1]) and 0 <= row[1] < 1 << 64
                  and isinstance(row[2], str), "meta 'op_names' row",
                  "[pid, address, name]", row)
    if "symbol_names" in doc:
        table = doc["symbol_names"]
        _want(isinstance(table, dict) and len(table) <= MAX_TABLE_ROWS, "meta 'symbol_names'",
              "an object of id -> name", table)
        for key, name in table.items():
            _want(key.isascii() and key.isdigit() and len(key) <= 20 and int(key) < 1 << 64
                  and isinstance(name, str), "meta 'symbol_names' entry",
                  "a decimal id and a name", [key, name])
    for key in ("request_series", "entropy_layers", "modalities"):
        if key in doc:
            _string_table(doc[key], f"meta {key!r}")
    if "probes" in doc:
        states = doc["probes"]
        _want(isinstance(states, list) and len(states) <= MAX_TABLE_ROWS
              and all(isinstance(s, dict) for s in states), "meta 'probes'",
              "a list of probe states (objects)", states)
    if "config" in doc:
        conf = doc["config"]
        _want(isinstance(conf, dict), "meta 'config'", "an object", conf)
        if "p99" in conf:
            _settings(conf["p99"], P99_RANGES, "meta config.p99")
        if "entropy" in conf:
            _settings(conf["entropy"], ENTROPY_RANGES, "meta config.entropy")


def check_footer(doc):
    """The END chunk: what `report` takes from it."""
    _want(isinstance(doc, dict), "footer", "a JSON object", type(doc).__name__)
    if "duration_s" in doc:
        _want(_is_number(doc["duration_s"]) and doc["duration_s"] >= 0, "footer 'duration_s'",
              "a finite non-negative number", doc["duration_s"])
    if "lost_events" in doc:
        lost = doc["lost_events"]
        if isinstance(lost, dict):
            for key, n in lost.items():
                _count(n, f"footer lost_events.{key}")
        else:
            _count(lost, "footer 'lost_events'")
    for key in ("counters", "device_probe_summary", "name_resolution", "anomaly"):
        if key in doc:
            _want(isinstance(doc[key], dict), f"footer {key!r}", "an object", doc[key])
    for key, n in doc.get("counters", {}).items():
        _want(_is_int(n), f"footer counters.{key}", "an integer", n)
    if "runq_hist_log2_us" in doc:
        hist = doc["runq_hist_log2_us"]
        _want(isinstance(hist, list) and len(hist) <= 64, "footer 'runq_hist_log2_us'",
              "a list of at most 64 counts", hist)
        for n in hist:
            _count(n, "footer runq_hist_log2_us entry")


def lost_total(footer: dict | None) -> int:
    """The footer's lost events (a count, or counts by reason), summed."""
    lost = (footer or {}).get("lost_events", 0)
    return sum(lost.values()) if isinstance(lost, dict) else int(lost)
