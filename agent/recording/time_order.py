"""Merge the per-schema event pieces of a recording into one stream in time
order, in bounded memory.

Within a schema, pieces come about in time order: a ring buffer hands out
records in the order they were committed, and a record can be late by the
time its producer spent between stamping and committing it (a sync that
blocked for a while). Each schema keeps the records it has read in a sorted
buffer; what lies below every schema's horizon (the smallest stamp of its
newest piece, less `lag_ns`) can no longer be overtaken and is handed out.
When the buffers hold more than `max_bytes`, the oldest go out anyway; a
record later than that comes out late, after newer ones."""

import numpy as np

from mmtrace.agent.ingest.record_arrays import concat, take

_DONE = None


class _Lane:
    def __init__(self, pieces, dtype):
        self.pieces = iter(pieces)
        self.empty = np.empty(0, dtype)
        self.parts: list[np.ndarray] = []     # sorted when joined
        self.horizon = -1           # below this, nothing more can arrive
        self.done = False

    def pull(self, lag_ns: int):
        piece = next(self.pieces, _DONE)
        if piece is _DONE:
            self.done = True
            return
        if not len(piece):
            return
        ts = piece["ts_ns"]
        self.horizon = int(ts.min()) - lag_ns
        last = self.parts[-1]["ts_ns"][-1] if self.parts and len(self.parts[-1]) else None
        if np.all(ts[1:] >= ts[:-1]) and (last is None or ts[0] >= last):
            self.parts.append(piece)        # already in order: no sort
            return
        self.parts.append(piece)
        merged = concat(self.parts)
        self.parts = [take(merged, np.argsort(merged["ts_ns"], kind="stable"))]

    @property
    def buffer(self) -> np.ndarray:
        if len(self.parts) != 1:
            self.parts = [concat(self.parts)] if self.parts else [self.empty]
        return self.parts[0]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def releasable(self, limit: int | None) -> int:
        """Bytes stamped at or before `limit` (each part is sorted)."""
        if limit is None:
            return self.nbytes
        if limit < 0:
            return 0
        return sum(int(np.searchsorted(p["ts_ns"], np.uint64(limit), side="right"))
                   * p.dtype.itemsize for p in self.parts)

    def release(self, limit: int | None) -> np.ndarray:
        """Hand out the records stamped at or before `limit` (None: all)."""
        if limit is not None and limit < 0 or not self.parts:
            return self.empty
        buffer = self.buffer
        k = len(buffer) if limit is None else int(
            np.searchsorted(buffer["ts_ns"], np.uint64(limit), side="right"))
        self.parts = [buffer[k:]] if k < len(buffer) else []
        return buffer[:k]


def ordered_steps(sources: dict, dtypes: dict, lag_ns: int = 1_000_000_000,
                  max_bytes: int = 48 << 20, step_bytes: int = 4 << 20):
    """Yield {schema: records sorted by ts_ns}, step after step in time order,
    each of about `step_bytes` or more (the last ones may be smaller).
    `sources` maps each schema to an iterable of record pieces."""
    lanes = {name: _Lane(pieces, dtypes[name]) for name, pieces in sources.items()}
    while lanes:
        open_lanes = [lane for lane in lanes.values() if not lane.done]
        if open_lanes:
            min(open_lanes, key=lambda lane: lane.horizon).pull(lag_ns)
        open_lanes = [lane for lane in lanes.values() if not lane.done]
        limit = min((lane.horizon for lane in open_lanes), default=None)
        held = sum(lane.nbytes for lane in lanes.values())
        if open_lanes and held < max_bytes and sum(
                lane.releasable(limit) for lane in lanes.values()) < step_bytes:
            continue        # a bigger step costs less per event downstream
        if open_lanes and held > max_bytes:
            # Too much held back: let the oldest go, at least one lane's worth.
            limit = max(limit, min(int(lane.buffer["ts_ns"][-1])
                                   for lane in lanes.values() if len(lane.buffer)))
        step = {name: lane.release(limit) for name, lane in lanes.items()}
        step = {name: records for name, records in step.items() if len(records)}
        if step:
            yield step
        if not open_lanes:
            return
