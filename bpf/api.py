"""One probed API: the record bpf/cuda.py and bpf/ascend.py fill their
tables with, and the optional event fields it fills. bpf/device.py builds
the table from them (no module here imports device.py)."""

import re
from dataclasses import dataclass

# Optional jsonl fields an API fills; the rest are null for its events.
HANDLE, STREAM, GRID, BLOCK, SHARED_MEM, BYTES, DIRECTION = (
    "handle", "stream_handle", "grid", "block", "shared_mem_bytes", "bytes", "direction")
LAUNCH_FIELDS = frozenset({HANDLE, STREAM, GRID, BLOCK, SHARED_MEM})
MEMCPY_FIELDS = frozenset({STREAM, BYTES, DIRECTION})
ALLOC_FIELDS = frozenset({HANDLE, STREAM, BYTES})   # handle: the device pointer


# The launch decoders that read the caller's return address and the outer
# caller (bpf/cuda.c: launch_args.outer = 1). Only their call sites teach
# the kernel's table of known sites, and only their compact launches take
# the outer caller from a whole record of their site.
CALLER_DECODERS = frozenset({"launch_runtime", "launch_runtime_ex"})


@dataclass(frozen=True)
class Api:
    """One probed symbol (or, for `pattern`, a family of symbols)."""
    id: int
    symbol: str                 # exported name; for a pattern, a label
    stream: str                 # "gpu" | "npu"
    kind: str                   # a KINDS value, or "set_device"
    library: str                # family: "cudart", "cuda", "ascendcl", "opapi"
    entry_impl: str             # decoder in cuda.c / ascend.c: impl(ctx, api, slot)
    return_impl: str | None = None  # at the uretprobe, when the call is timed
    fields: frozenset = frozenset()
    per_launch: bool = False    # detached in the adaptive (cheap) mode
    sync_scope: str | None = None   # "stream" | "device" | "event"
    blocking: bool = False      # a submission that is complete when the call returns
    pattern: str | None = None  # regex of the symbols this one program serves
    exclude: str | None = None  # regex of pattern matches that are not probed

    @property
    def name(self) -> str:
        """The spec's `api`: the symbol without _ptsz / _ptds / _v2 suffixes."""
        return base_name(self.symbol)

    @property
    def entry_fn(self) -> str:
        return f"on_{self.symbol}"

    @property
    def return_fn(self) -> str | None:
        return f"ret_{self.symbol}" if self.return_impl else None

    @property
    def multi_entry_fn(self) -> str:
        return f"m_{self.entry_impl}"

    @property
    def multi_return_fn(self) -> str | None:
        return f"mr_{self.return_impl}" if self.return_impl else None

    @property
    def reads_callers(self) -> bool:
        return self.entry_impl in CALLER_DECODERS

    @property
    def session_fn(self) -> str:
        """A per-launch API's program where uprobe sessions let its entry
        choose whether its return runs (bpf/device.h launch_return_wanted)."""
        return f"ms_{self.entry_impl}"

    def matches(self, symbol: str) -> bool:
        if self.pattern is None:
            return symbol == self.symbol
        if not re.fullmatch(self.pattern, symbol):
            return False
        return not (self.exclude and re.fullmatch(self.exclude, symbol))


_SUFFIXES = re.compile(r"(_v2)?(_ptsz|_ptds)?$")


def base_name(symbol: str) -> str:
    return _SUFFIXES.sub("", symbol) or symbol
