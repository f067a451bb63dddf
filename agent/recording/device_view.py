"""GPU/NPU events of a recording as the interface describes them: stream,
kind, api, op_name, direction, and the alignment (retired_ns, a sync's
op_id), computed per column for the exporters and the report."""

import functools
from dataclasses import dataclass, field

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.agent.ingest.align import FLAG_STREAM_FROM_RECORD, ApiRoles, align
from mmtrace.agent.ingest.record_arrays import take

ELLIPSIS = "\u2026"


@dataclass
class DeviceContext:
    """What a recording says about its device events besides the events."""
    infos: dict                                     # api id -> device_stream.ApiInfo
    op_names: dict = field(default_factory=dict)    # (pid, address) -> name
    symbol_names: dict = field(default_factory=dict)  # cookie -> aclnn symbol

    @classmethod
    def from_meta(cls, meta: list[dict]) -> "DeviceContext":
        infos = None
        op_names, symbol_names = {}, {}
        for doc in meta:
            if infos is None and isinstance(doc.get("apis"), list):
                try:
                    infos = {int(d["id"]): device_stream.ApiInfo.from_json(d)
                             for d in doc["apis"]}
                except (KeyError, TypeError, ValueError):
                    infos = None
            for row in doc.get("op_names", ()) or ():
                if isinstance(row, list) and len(row) == 3:
                    op_names[(int(row[0]), int(row[1]))] = str(row[2])
            for key, name in (doc.get("symbol_names") or {}).items():
                symbol_names[int(key)] = str(name)
        return cls(infos or device_stream.default_infos(), op_names, symbol_names)


@dataclass
class DeviceRows:
    """The exported events (launch, graph_launch, memcpy, sync, model_exec),
    aligned, sorted by time, with per-event decoded columns."""
    events: np.ndarray          # align.ALIGNED_EVENT
    stream: np.ndarray          # object: "gpu" | "npu"
    kind: np.ndarray            # object
    api: np.ndarray             # object
    op_name: np.ndarray         # object: str or None
    direction: np.ndarray       # object: str or None
    fields: np.ndarray          # object: per row, the frozenset of optional fields it fills
    error: np.ndarray = None    # object: a failed call's code as text, else None

    def __post_init__(self):
        if self.error is None:
            self.error = np.full(len(self.events), None, object)

    def __len__(self):
        return len(self.events)

    def batches(self, size: int):
        """The rows `size` at a time (an encoder's memory follows its batch)."""
        for lo in range(0, len(self), size):
            hi = lo + size
            yield DeviceRows(self.events[lo:hi], self.stream[lo:hi], self.kind[lo:hi],
                             self.api[lo:hi], self.op_name[lo:hi], self.direction[lo:hi],
                             self.fields[lo:hi], self.error[lo:hi])

    def where(self, mask: np.ndarray) -> "DeviceRows":
        """The rows where `mask` holds."""
        at = np.flatnonzero(mask)
        return DeviceRows(self.events[at], self.stream[at], self.kind[at], self.api[at],
                          self.op_name[at], self.direction[at],
                          self.fields[at], self.error[at])

    def api_groups(self) -> "ApiGroups":
        """The rows by API id (ApiGroups): what follows from the id, read once per id."""
        return ApiGroups(self)

    @property
    def failed(self) -> np.ndarray:
        """Rows whose call returned an error code."""
        return self.error != None  # noqa: E711  (elementwise on an object array)

    @functools.cached_property
    def failure_keys(self) -> np.ndarray:
        """An int64 per row; among the failed rows, rows of one key show one
        (api, error) and one API id: (API id, return code), where an id
        names all its rows alike; else told apart by name too (an aclnn
        launch is named by its op). Two ids of one name (cudaLaunchKernel
        and its _ptsz) keep two keys: a count by key adds them up by name
        (detectors/call_failures.py, the report's failed calls), looking
        names up once per key, not once per row. Made once per rows, for
        every reader (read-only)."""
        ev = self.events
        keys = device_stream.api_code_keys(ev["api"], ev["ret"])
        failed = np.flatnonzero(self.failed)
        ids, group = np.unique(ev["api"][failed], return_inverse=True)
        taken = 0
        for j in range(len(ids)):
            at = failed[group.reshape(-1) == j]
            names = self.api[at]
            if (names == names[0]).all():
                continue
            # Negative keys: apart from every (id, code) key, which is not.
            # Names by a dict (hashed in C): a sort of strings is dearer.
            index: dict = {}
            by_name = np.fromiter(map(lambda name: index.setdefault(name, len(index)), names),
                                  np.int64, len(names))
            _, by_code = np.unique(ev["ret"][at], return_inverse=True)
            _, pair = np.unique(by_code.reshape(-1) * len(at) + by_name,
                                return_inverse=True)
            keys[at] = -(taken + 1 + pair.reshape(-1))
            taken += int(pair.max()) + 1
        keys.flags.writeable = False
        return keys


class ApiGroups:
    """Decoded rows by API id: each id's first row, stream and kind, and
    each row's group. A row's stream, kind and fields follow from its id
    (and a failed call's error from its id and code): read once per id,
    not once per row."""

    def __init__(self, rows: DeviceRows):
        _, first, inverse = np.unique(rows.events["api"], return_index=True,
                                      return_inverse=True)
        self.first, self.inverse = first, inverse.reshape(-1)
        self.stream = rows.stream[first].tolist()
        self.kind = rows.kind[first].tolist()
        self.fields = [rows.fields[i] for i in first.tolist()]

    def of_kinds(self, *kinds: str) -> np.ndarray:
        """Which rows are of one of `kinds`."""
        return np.array([k in kinds for k in self.kind], bool)[self.inverse]

    def filling(self, name: str) -> np.ndarray:
        """Which rows fill the optional field `name`."""
        return np.array([name in f for f in self.fields], bool)[self.inverse]


def _name_text(raw: bytes, truncated: bool) -> str | None:
    if not raw:
        return None
    text = raw.decode("utf-8", "backslashreplace")
    return text + ELLIPSIS if truncated else text


def decode(events: np.ndarray, ctx: DeviceContext) -> DeviceRows:
    """Every device event at once: aligned, sorted, decoded."""
    from mmtrace.agent.discovery.demangle import demangle
    aligned = align(events, ApiRoles.from_infos(ctx.infos))
    aligned = take(aligned, np.argsort(aligned["ts_ns"], kind="stable"))
    return decode_aligned(aligned, ctx,
                          function_names(aligned, ctx.infos, demangle, ctx.op_names))


def decode_aligned(aligned: np.ndarray, ctx: DeviceContext, kernel_names: dict) -> DeviceRows:
    """Aligned events in time order; `kernel_names` maps (pid, handle) to a
    kernel name (see function_names). The rows' events are `aligned` itself
    where every event is exported."""
    infos = ctx.infos
    api_ids = aligned["api"].astype(np.int64)
    exported = np.array([infos[i].kind in device_stream.EXPORTED_KINDS if i in infos else False
                         for i in range(int(api_ids.max(initial=0)) + 1)], bool)
    keep = exported[api_ids]
    rows = aligned if keep.all() else take(aligned, keep)   # most often every row: no copy
    n = len(rows)
    stream = np.empty(n, object)
    kind = np.empty(n, object)
    api = np.empty(n, object)
    op_name = np.full(n, None, object)
    direction = np.full(n, None, object)
    error = np.full(n, None, object)
    failed = device_stream.failed(rows)
    distinct = np.unique(rows["api"]).tolist()
    # Each row's set is its API's: one object array of them, indexed by id.
    sets = np.empty(max(distinct, default=0) + 1, object)
    for a in distinct:
        sets[a] = infos[a].fields
    fields = sets[rows["api"]]
    for api_id in distinct:
        info = infos[api_id]
        at = np.flatnonzero(rows["api"] == api_id)
        stream[at] = info.stream
        kind[at] = info.kind
        api[at] = info.api
        bad = at[failed[at]]
        if len(bad):            # a storm of failures has few distinct codes
            codes, which = np.unique(rows["ret"][bad], return_inverse=True)
            texts = np.empty(len(codes), object)
            texts[:] = [device_stream.error_text(info, code) for code in codes.tolist()]
            error[bad] = texts[which]
        if device_stream.DIRECTION in info.fields:
            direction[at] = _direction_names(info.stream)[rows["direction"][at]]
        if info.kind != "launch":
            continue
        pids = rows["pid"][at].tolist()
        if info.library == "cudart":
            op_name[at] = _runtime_launch_names(rows, at, ctx.op_names, kernel_names)
        elif info.library == "cuda":
            op_name[at] = [kernel_names.get(k)
                           for k in zip(pids, rows["handle"][at].tolist())]
        elif info.symbol == "aclnn":
            ops = [ctx.symbol_names.get(cookie) if cookie else ctx.op_names.get((pid, ip))
                   for cookie, pid, ip in zip(rows["symbol_id"][at].tolist(), pids,
                                              rows["probe_ip"][at].tolist())]
            op_name[at] = ops
            api[at] = [name or info.api for name in ops]
        else:   # aclop: the opType string
            op_name[at] = [_name_text(name, bool(flag & device_stream.FLAG_NAME_TRUNCATED))
                           for name, flag in zip(rows["name"][at].tolist(),
                                                 rows["flags"][at].tolist())]
    return DeviceRows(rows, stream, kind, api, op_name, direction, fields, error)


@functools.cache
def _direction_names(stream: str) -> np.ndarray:
    """Each direction code's name (None where it has none), by code (a byte):
    a copy's direction looked up by numpy, not a Python step per row."""
    names = np.full(256, None, object)
    for code, name in device_stream.direction_names(stream).items():
        names[code] = name
    return names


def _runtime_launch_names(rows: np.ndarray, at: np.ndarray, op_names: dict,
                          kernel_names: dict) -> list:
    """The kernel of each runtime launch `at` (rows): its handle (a host
    function, or a cudaKernel_t __cudaGetKernel made), else its caller when
    that is the kernel's host stub (agent/ingest/device_names.py). Each
    distinct (pid, handle, callers) is looked up once: a loop launches a few
    kernels from a few places many times."""
    columns = [rows["pid"][at].tolist(), rows["handle"][at].tolist()]
    callers = "return_ip" in (rows.dtype.names or ())
    if callers:
        columns += [rows["return_ip"][at].tolist(), rows["outer_return_ip"][at].tolist()]
    keys = list(zip(*columns))
    named = {}
    for key in dict.fromkeys(keys):
        pid, handle = key[0], key[1]
        name = op_names.get((pid, handle)) or kernel_names.get((pid, handle))
        if name is None and callers:
            name = op_names.get((pid, key[2])) or op_names.get((pid, key[3]))
        named[key] = name
    return list(map(named.__getitem__, keys))


def function_names(events: np.ndarray, infos: dict, demangle, op_names: dict,
                   known: dict | None = None) -> dict:
    """(pid, handle) -> kernel name, from the returns of the calls that make
    kernel handles (later definitions of a handle win: events are in time
    order): cuModuleGetFunction, cuLibraryGetKernel and cuFuncGetName name
    theirs; cuKernelGetFunction's CUfunction and __cudaGetKernel's
    cudaKernel_t take the name of what they stand for (a CUkernel, a host
    function named in op_names). `known`: names from earlier events (a
    recording read piece by piece), for handles made before this piece."""
    ids = [i for i, info in infos.items() if info.kind == "function_name"]
    rows = events[np.isin(events["api"], ids) & (events["ret"] == 0) & (events["handle"] != 0)]
    aliases = (rows["alias"].tolist() if "alias" in (rows.dtype.names or ())
               else [0] * len(rows))
    known = known or {}
    out = {}
    for pid, handle, raw, flag, alias in zip(rows["pid"].tolist(), rows["handle"].tolist(),
                                             rows["name"].tolist(), rows["flags"].tolist(),
                                             aliases):
        if alias:
            out[(pid, handle)] = (out.get((pid, alias)) or known.get((pid, alias))
                                  or op_names.get((pid, alias)))
            continue
        truncated = bool(flag & device_stream.FLAG_NAME_TRUNCATED)
        text = _name_text(raw, truncated)
        if text is not None and not truncated:
            text = demangle(text)
        out[(pid, handle)] = text
    return out


def stream_from_record(events: np.ndarray) -> np.ndarray:
    return (events["flags"] & FLAG_STREAM_FROM_RECORD) != 0


def describe(rows: np.ndarray, infos: dict, op_names: dict) -> list[dict]:
    """Names of a few aligned rows, one dict each (stream, kind, api,
    op_name, direction), for consumers that take events one at a time (the
    OTLP spans); `op_names` maps (pid, address) to a kernel name."""
    out = []
    for api_id, pid, handle, ip, cookie, direction in zip(
            rows["api"].tolist(), rows["pid"].tolist(), rows["handle"].tolist(),
            rows["probe_ip"].tolist(), rows["symbol_id"].tolist(), rows["direction"].tolist()):
        info = infos.get(api_id)
        if info is None:
            out.append({})
            continue
        names = {"stream": info.stream, "kind": info.kind, "api": info.api}
        if info.kind == "launch":
            names["op_name"] = op_names.get((pid, ip if info.symbol == "aclnn" else handle))
        if device_stream.DIRECTION in info.fields:
            names["direction"] = device_stream.direction_names(info.stream).get(direction)
        out.append(names)
    return out
