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

from .records import take

_DONE = None


class _Lane:
    def __init__(self, pieces, dtype):
        self.pieces = iter(pieces)
        self.buffer = np.empty(0, dtype)
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
        merged = np.concatenate([self.buffer, piece]) if len(self.buffer) else piece
        order = np.argsort(merged["ts_ns"], kind="stable")
        self.buffer = take(merged, order)

    def release(self, limit: int | None) -> np.ndarray:
        """Hand out the records stamped at or before `limit` (None: all)."""
        if limit is None:
            out, self.buffer = self.buffer, self.buffer[:0]
            return out
        if limit < 0:
            return self.buffer[:0]
        k = int(np.searchsorted(self.buffer["ts_ns"], np.uint64(limit), side="right"))
        out, self.buffer = self.buffer[:k], self.buffer[k:]
        return out


def ordered_steps(sources: dict, dtypes: dict, lag_ns: int = 250_000_000,
                  max_bytes: int = 48 << 20):
    """Yield {schema: records sorted by ts_ns}, step after step in time order.
    `sources` maps each schema to an iterable of record pieces."""
    lanes = {name: _Lane(pieces, dtypes[name]) for name, pieces in sources.items()}
    while lanes:
        open_lanes = [lane for lane in lanes.values() if not lane.done]
        if open_lanes:
            min(open_lanes, key=lambda lane: lane.horizon).pull(lag_ns)
        open_lanes = [lane for lane in lanes.values() if not lane.done]
        limit = min((lane.horizon for lane in open_lanes), default=None)
        held = sum(lane.buffer.nbytes for lane in lanes.values())
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
