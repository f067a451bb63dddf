"""Merge the per-schema event pieces of a recording into one stream in time
order, in bounded memory.

Within a schema, pieces come about in time order: a ring buffer hands out
records in the order they were committed, and a record can be late by the
time its producer spent between stamping and committing it (a sync that
blocked for a while). Each schema keeps the records it has read as sorted
runs (see _Lane); what lies below every schema's horizon (the smallest
stamp of its newest piece, less `lag_ns`) can no longer be overtaken and
is handed out. When the lanes hold more than `max_bytes`, the oldest go
out anyway, a step at a time; a record later than that comes out late,
after newer ones. The bound is what keeps report and export within their
memory whatever the rate: at 700 k events/s (a pipe ping-pong) 16 MiB is
about half a second of the run-queue stream."""

import bisect

import numpy as np

from mmtrace.agent.ingest.record_arrays import concat, take

_DONE = None
MAX_RUNS = 32       # sorted runs a lane holds before it merges two


class _Run:
    """Pieces whose stamps rise from one to the next: one sorted sequence,
    kept as the pieces it came in (joined only when handed out)."""

    def __init__(self, piece: np.ndarray):
        self.pieces = [piece]
        self.lasts = [int(piece["ts_ns"][-1])]     # each piece's newest stamp
        self.ends = [len(piece)]    # records up to each piece's end, since the first
        self.start = 0              # of those, handed out (pieces[0] begins there)

    @property
    def last(self) -> int:
        return self.lasts[-1]

    @property
    def count(self) -> int:
        return self.ends[-1] - self.start if self.ends else 0

    def append(self, piece: np.ndarray):
        self.pieces.append(piece)
        self.lasts.append(int(piece["ts_ns"][-1]))
        self.ends.append((self.ends[-1] if self.ends else self.start) + len(piece))

    def _before(self, whole: int) -> int:
        """Records in pieces[:whole]."""
        return (self.ends[whole - 1] if whole else self.start) - self.start

    def count_until(self, limit: int) -> int:
        """How many records are stamped at or before `limit`."""
        whole = bisect.bisect_right(self.lasts, limit)
        n = self._before(whole)
        if whole < len(self.pieces):
            n += int(np.searchsorted(self.pieces[whole]["ts_ns"], np.uint64(limit),
                                     side="right"))
        return n

    def cut(self, limit: int | None) -> list[np.ndarray]:
        """Take out the pieces (and the part of a piece) stamped at or
        before `limit` (None: all); what is left stays."""
        if limit is None:
            out = self.pieces
            self.pieces, self.lasts, self.ends, self.start = [], [], [], 0
            return out
        whole = bisect.bisect_right(self.lasts, limit)
        out = self.pieces[:whole]
        self.start += self._before(whole)
        del self.pieces[:whole], self.lasts[:whole], self.ends[:whole]
        if self.pieces:
            first = self.pieces[0]
            k = int(np.searchsorted(first["ts_ns"], np.uint64(limit), side="right"))
            if k:
                out.append(first[:k])
                self.pieces[0] = first[k:]
                self.start += k
        return out


def _merged(older: _Run, newer: _Run) -> _Run:
    """One run of two (the older's records first among equal stamps)."""
    joined = concat(older.pieces + newer.pieces)
    return _Run(take(joined, np.argsort(joined["ts_ns"], kind="stable")))


class _Lane:
    """The records of one schema read so far and not yet handed out, as
    sorted runs: a piece is sorted on its own (its records are out of order
    by a few µs where CPUs share a ring) and joins the run it continues, or
    begins one. Handing out merges the runs' heads only (a stable sort of
    sorted runs is a merge: O(n log k)); nothing held is sorted twice."""

    def __init__(self, pieces, dtype):
        self.pieces = iter(pieces)
        self.empty = np.empty(0, dtype)
        self.runs: list[_Run] = []
        self.nbytes = 0
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
        if not np.all(ts[1:] >= ts[:-1]):
            piece = take(piece, np.argsort(ts, kind="stable"))
            ts = piece["ts_ns"]
        first = int(ts[0])
        self.horizon = first - lag_ns
        self.nbytes += piece.nbytes
        # The run with the newest end this piece continues keeps runs few.
        fits = [run for run in self.runs if run.last <= first]
        if fits:
            max(fits, key=lambda run: run.last).append(piece)
            return
        self.runs.append(_Run(piece))
        # Runs stay few whatever the input (a crafted file of tiny pieces out
        # of order): past MAX_RUNS the two smallest are merged, as Huffman
        # pairs them, so that a record is merged O(log n) times at most.
        # Real recordings hold a dozen runs at most and never get here.
        if len(self.runs) > MAX_RUNS:
            a, b = sorted(range(len(self.runs)), key=lambda i: self.runs[i].count)[:2]
            older, newer = min(a, b), max(a, b)
            self.runs[older] = _merged(self.runs[older], self.runs[newer])
            del self.runs[newer]

    @property
    def newest(self) -> int | None:
        """The newest stamp held; None when nothing is."""
        return max((run.last for run in self.runs), default=None)

    @property
    def oldest(self) -> int | None:
        """The oldest stamp held; None when nothing is."""
        return min((int(run.pieces[0]["ts_ns"][0]) for run in self.runs), default=None)

    def releasable(self, limit: int | None) -> int:
        """Bytes stamped at or before `limit`."""
        if limit is None:
            return self.nbytes
        if limit < 0:
            return 0
        return sum(run.count_until(limit) for run in self.runs) * self.empty.dtype.itemsize

    def release(self, limit: int | None) -> np.ndarray:
        """Hand out the records stamped at or before `limit` (None: all), in order."""
        if limit is not None and limit < 0 or not self.runs:
            return self.empty
        heads = [parts for parts in (run.cut(limit) for run in self.runs) if parts]
        self.runs = [run for run in self.runs if run.pieces]
        if not heads:
            return self.empty
        flat = [p for parts in heads for p in parts if len(p)]
        out = concat(flat) if len(flat) > 1 else flat[0]
        if len(heads) > 1:
            out = take(out, np.argsort(out["ts_ns"], kind="stable"))
        self.nbytes -= out.nbytes
        return out


def ordered_steps(sources: dict, dtypes: dict, lag_ns: int = 1_000_000_000,
                  max_bytes: int = 16 << 20, step_bytes: int = 2 << 20):
    """Yield {schema: records sorted by ts_ns}, step after step in time order,
    each of about `step_bytes` (the last ones may be smaller; none much
    bigger: a step is copied on its way out, and downstream works on it
    whole). `sources` maps each schema to an iterable of record pieces."""
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
            # Too much held back: let the oldest go, a step's worth.
            limit = _oldest(lanes.values(), max(limit, -1), held - max_bytes + step_bytes)
        yield from _steps_until(lanes, limit, step_bytes)
        if not open_lanes:
            return


def _steps_until(lanes: dict, limit: int | None, step_bytes: int):
    """What the lanes hold at or before `limit` (None: all), in steps of
    about `step_bytes`."""
    while True:
        ready = sum(lane.releasable(limit) for lane in lanes.values())
        if not ready:
            return
        cut = limit
        if ready > 2 * step_bytes:
            cut = _oldest(lanes.values(), -1, step_bytes)
            cut = cut if limit is None else min(cut, limit)
        step = {name: lane.release(cut) for name, lane in lanes.items()}
        yield {name: records for name, records in step.items() if len(records)}
        if cut == limit:
            return


def _oldest(lanes, limit: int, want: int) -> int:
    """The lowest stamp from `limit` up at or before which the lanes hold
    `want` bytes or more (the newest stamp of the lane whose newest is the
    oldest, when they hold less): a bisection on the stamps, from the oldest
    stamp held (nothing is held below it) and in steps that double, so that
    a step's worth near the oldest takes a few tries, not one per bit of
    the stamps' span."""
    lanes = [lane for lane in lanes if lane.runs]
    lo, hi = limit, min(lane.newest for lane in lanes)
    if want > 0:
        lo = max(lo, min(lane.oldest for lane in lanes))
    reach = 1
    while lo < hi:
        probe = min(lo + reach - 1, hi)
        if probe == hi or sum(lane.releasable(probe) for lane in lanes) >= want:
            hi = probe
            break
        lo, reach = probe + 1, 2 * reach
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(lane.releasable(mid) for lane in lanes) >= want:
            hi = mid
        else:
            lo = mid + 1
    return lo
