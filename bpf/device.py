"""GPU and NPU streams: decoder for bpf/device.h, and the API table that
bpf/cuda.py and bpf/ascend.py fill.

The table is the one source of the API ids. The C side gets them from
small generated functions that call the shape-specific decoders in cuda.c
and ascend.c, in two sets:
- one program per decoder (`m_<decoder>`), which reads the API id, call
  slot and aclnn symbol id from its BPF cookie: a library's symbols that
  share a decoder are attached as one uprobe_multi link (Linux 6.6+),
  attached and detached in one step;
- one program per symbol (`on_<symbol>`) with the ids as constants, for
  kernels without uprobe_multi.
A recording stores the table it was made with (ApiTable.to_json), so it
decodes without this module's version.
"""

from dataclasses import dataclass, field

import numpy as np

from mmtrace.bpf import ascend, cuda
# Api and the field names live in api.py (cuda.py and ascend.py fill their
# tables from there); named here too, as the device stream's.
from mmtrace.bpf.api import (BLOCK, BYTES, DIRECTION, GRID, HANDLE, LAUNCH_FIELDS,  # noqa: F401
                  MEMCPY_FIELDS, SHARED_MEM, STREAM, Api, base_name)

HEADER = "device.h"
RINGBUF = "dev_events"              # struct dev_event records (DEV_RECORD)
NAMES_RINGBUF = "dev_names"         # struct dev_named_event records (DEV_NAMED)
LAUNCHES_RINGBUF = "dev_launches"   # struct dev_launch records (DEV_LAUNCH)
LAYOUT_MAP = "layout_dev_event"
NAMED_LAYOUT_MAP = "layout_dev_named_event"
LAUNCH_LAYOUT_MAP = "layout_dev_launch"
# Why a process is in device.h's process_changes (bits of its value).
CHANGE_EXEC, CHANGE_FORK, CHANGE_MAPPED, CHANGE_EXIT, CHANGE_LEADER_EXIT = 1, 2, 4, 8, 16
NAME_LEN = 64

# A device event as the agent holds it and a recording stores it ("dev.event"):
# the kernel's record (DEV_RECORD) with its thread's comm, and the name and
# addresses only named events carry (DEV_NAMED). The layout recordings have
# always had; agent/kernel/device_ring.py widens the kernel's records into it.
DEV_EVENT = np.dtype([
    ("ts_ns", "<u8"),
    ("duration_ns", "<u8"),
    ("sched_delay_ns", "<u8"),
    ("op_id", "<u8"),
    ("handle", "<u8"),
    ("stream_handle", "<u8"),
    ("bytes", "<u8"),
    ("shared_mem_bytes", "<u8"),
    ("probe_ip", "<u8"),
    ("name_addr", "<u8"),
    ("alias", "<u8"),
    ("return_ip", "<u8"),
    ("outer_return_ip", "<u8"),
    # Scalar fields only: a recording stores each field's numpy type string.
    ("grid_x", "<u4"), ("grid_y", "<u4"), ("grid_z", "<u4"),
    ("block_x", "<u4"), ("block_y", "<u4"), ("block_z", "<u4"),
    ("pid", "<u4"),
    ("tid", "<u4"),
    ("device", "<i4"),
    ("ret", "<i4"),
    ("symbol_id", "<u4"),
    ("api", "<u2"),
    ("kind", "u1"),
    ("direction", "u1"),
    ("flags", "u1"),
    ("reserved", "V7"),
    ("comm", "S16"),
    ("name", f"S{NAME_LEN}"),
])

# Mirrors struct dev_event (bpf/device.h): the per-call record of the
# dev_events ring, DEV_EVENT's fields in its order without name_addr,
# alias, comm and name. Checked against the compiled layout at load time.
_NAMED_ONLY = ("name_addr", "alias", "comm", "name")
DEV_RECORD = np.dtype([(name, DEV_EVENT.fields[name][0]) for name in DEV_EVENT.names
                       if name not in _NAMED_ONLY])
# Mirrors struct dev_named_event: DEV_RECORD, then what only names carry
# (the dev_names ring: kernel handles' names, opTypes, threads' comms).
DEV_NAMED = np.dtype(DEV_RECORD.descr + [(name, DEV_EVENT.fields[name][0])
                                         for name in _NAMED_ONLY])

# Mirrors struct dev_launch: a kernel launch whose return was not probed, in
# one cache line. Its pid and comm are its thread's, its outer caller its
# call site's, its op_id the low half (agent/kernel/device_ring.py puts the
# rest back); kind launch, no flags.
DEV_LAUNCH = np.dtype([
    ("ts_ns", "<u8"),
    ("handle", "<u8"),
    ("stream_handle", "<u8"),
    ("return_ip", "<u8"),
    ("tid", "<u4"),
    ("op_id", "<u4"),
    ("sched_delay_ns", "<u4"),
    ("shared_mem_bytes", "<u4"),
    ("grid_x", "<u4"),
    ("grid_y", "<u2"), ("grid_z", "<u2"),
    ("block_x", "<u2"), ("block_y", "<u2"),
    ("block_z", "u1"),
    ("device", "i1"),
    ("api", "<u2"),
])

# enum dev_kind
KINDS = {1: "launch", 2: "graph_launch", 3: "memcpy", 4: "sync", 5: "model_exec",
         6: "event_record", 7: "function_name", 8: "thread",
         9: "alloc", 10: "free"}     # the last two: bpf/device_memory.c
KIND_IDS = {name: kid for kid, name in KINDS.items()}
# Kinds the interface exports as jsonl events; the others feed alignment and
# names ("thread": a comm on the names ring, consumed as the ring is read).
EXPORTED_KINDS = ("launch", "graph_launch", "memcpy", "sync", "model_exec")
SUBMISSION_KINDS = ("launch", "graph_launch", "memcpy", "model_exec")
# A device event as recorded: the kernel's record, and when the first sync that
# covered it returned (agent/ingest/align.py fills it in; NOT_RETIRED until then).
NOT_RETIRED = -1
ALIGNED_EVENT = np.dtype(DEV_EVENT.descr + [("retired_ns", "<i8")])

# enum dev_flag
FLAG_RETURNED = 1
FLAG_NAME_TRUNCATED = 2
FLAG_READ_FAILED = 4
FLAG_NAME_FROM_USERSPACE = 8    # set by the agent: name read through /proc/PID/mem
FLAG_STREAM_FROM_RECORD = 16    # set by the agent: an event sync's stream_handle came from its record

# The BPF cookie of a probe: API id | call slot << 16 | aclnn symbol id << 32.
COOKIE_SLOT_SHIFT = 16
COOKIE_SYMBOL_SHIFT = 32


def cookie(api_id: int, slot: int = 0, symbol_id: int = 0) -> int:
    return api_id | slot << COOKIE_SLOT_SHIFT | symbol_id << COOKIE_SYMBOL_SHIFT

NO_DIRECTION = 0xFF
NO_DEVICE = -1

@dataclass
class ApiTable:
    apis: list[Api]
    by_id: dict[int, Api] = field(init=False)
    slots: dict[int, int] = field(init=False)   # api id -> call slot (timed calls)

    def __post_init__(self):
        self.by_id = {}
        for api in self.apis:
            if api.id in self.by_id:
                raise ValueError(f"API id {api.id}: both {self.by_id[api.id].symbol} "
                                 f"and {api.symbol}")
            if not 0 < api.id < 1 << 16:
                raise ValueError(f"API id of {api.symbol} must fit u16 and not be 0, "
                                 f"got {api.id}")
            self.by_id[api.id] = api
        # Timed calls, and per-launch calls whose return a session may probe.
        timed = [api for api in self.apis if api.return_impl or api.per_launch]
        # One slot per timed symbol: nested timed calls on one thread never collide
        # (cudaLaunchKernel -> cuLaunchKernel).
        self.slots = {api.id: slot for slot, api in enumerate(timed)}
        if len(self.slots) > 255:
            raise ValueError(f"{len(self.slots)} timed APIs; the call key holds 255")

    @property
    def call_slots(self) -> int:
        return max(1, len(self.slots))

    def generated_programs(self, multi: bool = True, sessions: bool = False) -> str:
        """`multi`: a program per decoder taking its ids from the cookie;
        else a program per API (entry, and return) with the ids as constants.
        `sessions` (multi only): the per-launch decoders as uprobe-session
        programs, run at entry and, where the entry asks, at return.
        Compiling only the set in use saves half the compile time. A
        decoder's result matters to a session only: the others return 0,
        which a perf-event uprobe needs to skip building a sample."""
        lines = ["/* Generated from the API tables in bpf/cuda.py and bpf/ascend.py. */"]
        ids = (f"u64 c = bpf_get_attach_cookie(ctx); u16 api = (u16)c;"
               f" u32 slot = (u32)(c >> {COOKIE_SLOT_SHIFT}) & 0xff;")
        if multi:
            decoders = {}
            for api in self.apis:
                if sessions and api.per_launch:
                    decoders[api.session_fn] = (
                        f"{ids} if (session_return(ctx, slot)) {{ timed_return(ctx, api, slot);"
                        f" return 0; }} return {api.entry_impl}(ctx, api, slot);")
                    continue
                decoders[api.multi_entry_fn] = f"{ids} {api.entry_impl}(ctx, api, slot); return 0;"
                if api.return_impl:
                    decoders[api.multi_return_fn] = (f"{ids} {api.return_impl}(ctx, api, slot);"
                                                     f" return 0;")
            for fn, body in decoders.items():
                lines.append(f"int {fn}(struct pt_regs *ctx) {{ {body} }}")
            return "\n".join(lines) + "\n"
        for api in self.apis:
            slot = self.slots.get(api.id, 0)
            lines.append(f"int {api.entry_fn}(struct pt_regs *ctx) "
                         f"{{ {api.entry_impl}(ctx, {api.id}, {slot}); return 0; }}")
            if api.return_impl:
                lines.append(f"int {api.return_fn}(struct pt_regs *ctx) "
                             f"{{ {api.return_impl}(ctx, {api.id}, {slot}); return 0; }}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> list[dict]:
        """What a recording keeps: enough to decode its events later."""
        return [{"id": a.id, "symbol": a.symbol, "api": a.name, "stream": a.stream,
                 "kind": a.kind, "library": a.library, "fields": sorted(a.fields),
                 "per_launch": a.per_launch, "sync_scope": a.sync_scope,
                 "blocking": a.blocking} for a in self.apis]


@dataclass(frozen=True)
class ApiInfo:
    """An API as a recording describes it (see ApiTable.to_json)."""
    id: int
    symbol: str
    api: str
    stream: str
    kind: str
    library: str
    fields: frozenset
    sync_scope: str | None
    blocking: bool
    per_launch: bool

    @classmethod
    def from_json(cls, doc: dict) -> "ApiInfo":
        return cls(int(doc["id"]), str(doc["symbol"]), str(doc["api"]), str(doc["stream"]),
                   str(doc["kind"]), str(doc.get("library", "")),
                   frozenset(doc.get("fields", ())), doc.get("sync_scope"),
                   bool(doc.get("blocking", False)), bool(doc.get("per_launch", False)))


def default_table() -> ApiTable:
    return ApiTable(list(cuda.APIS) + list(ascend.APIS))


def default_infos() -> dict[int, ApiInfo]:
    return {d["id"]: ApiInfo.from_json(d) for d in default_table().to_json()}


def id_table(ids) -> np.ndarray:
    """A lookup over small ids (kinds, API ids) with one False slot past
    the highest: in_table(values, table) is np.isin(values, ids), without
    its set-up and sort (a few times cheaper on a batch)."""
    ids = np.asarray(list(ids), np.int64)
    table = np.zeros(int(ids.max(initial=-1)) + 2, bool)
    table[ids] = True
    return table


def in_table(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Which of `values` are among the ids of `table` (id_table)."""
    return table[np.minimum(values, len(table) - 1)]


def api_code_keys(api: np.ndarray, ret: np.ndarray) -> np.ndarray:
    """One int64 a call for its (API id, return code), from those two
    columns: the id above the code's 32 bits, so that np.unique of one
    column groups both (a unique over (api, code) rows views them as
    records and sorts those, several times slower)."""
    return (api.astype(np.int64) << 32) | (ret.astype(np.int64) & 0xFFFFFFFF)


def failed(events: np.ndarray) -> np.ndarray:
    """Calls whose return was probed and gave an error code: they did no
    work (no bytes moved, no kernel queued), and every output counts them
    apart, per API and code."""
    return ((events["flags"] & FLAG_RETURNED) != 0) & (events["ret"] != 0)


def returned(events: np.ndarray) -> np.ndarray:
    """Calls whose return was probed (their duration and code are known)."""
    return (events["flags"] & FLAG_RETURNED) != 0


def error_text(info: "ApiInfo | None", ret: int) -> str:
    """A failed call's code for a person: "cudaErrorInsufficientDriver (35)"."""
    from mmtrace.bpf.return_codes import code_name
    return code_name(info.library if info is not None else "", ret)


def direction_names(stream: str) -> dict[int, str]:
    return cuda.DIRECTIONS if stream == "gpu" else ascend.DIRECTIONS
