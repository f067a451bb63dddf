"""The latency series the P99-drift detector watches, cut from batches of
events with numpy (one key lookup per distinct group, none per event).
`series_id(key)` is the caller's: it gives the detector's id of a
SeriesKey (agent/ingest/series_keys.py).

- runq_delay{pid=P}: run-queue delay of the threads of P that do GPU/NPU
  work (the threads whose starvation delays the device);
- sync_wait{pid=P,stream=0x..}: time blocked in a sync call;
- submit_to_retire{pid=P}: from a submission to the first sync covering it.

Values are in seconds; contributors are thread ids.
"""

from dataclasses import dataclass

import numpy as np

from mmtrace.bpf import device as device_stream

from mmtrace.agent.ingest import series_keys
from mmtrace.agent.ingest.series_keys import SeriesKey

SYNC = device_stream.KIND_IDS["sync"]
SUBMISSIONS = device_stream.id_table(device_stream.KIND_IDS[k]
                                     for k in device_stream.SUBMISSION_KINDS)
DEVICE_WORK = device_stream.id_table(device_stream.KIND_IDS[k]
                                     for k in device_stream.EXPORTED_KINDS)


@dataclass
class Series:
    ids: np.ndarray          # dense series ids of the detector
    ts_ns: np.ndarray
    values_s: np.ndarray
    contributors: np.ndarray

    @staticmethod
    def empty():
        z = np.zeros(0, np.int64)
        return Series(z, z, np.zeros(0), z)

    def __len__(self):
        return len(self.ids)


def concat(parts: list[Series]) -> Series:
    parts = [p for p in parts if len(p)]
    if not parts:
        return Series.empty()
    return Series(*(np.concatenate([getattr(p, f) for p in parts])
                    for f in ("ids", "ts_ns", "values_s", "contributors")))


def _named(series_id, key_of, keys: np.ndarray) -> np.ndarray:
    """Dense ids for each row's key: the key is built once per distinct one."""
    uniq, inverse = np.unique(keys, return_inverse=True)
    ids = np.array([series_id(key_of(k)) for k in uniq.tolist()], np.int64)
    return ids[inverse]


def _named_pairs(series_id, key_of, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """_named for keys of two columns, in the same order (by the first, then
    the second): one lexsort, where np.unique of records sorts structured
    values, several times slower."""
    order = np.lexsort((second, first))
    a, b = first[order], second[order]
    starts = np.ones(len(order), bool)
    starts[1:] = (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    ids = np.array([series_id(key_of(x, y)) for x, y in zip(a[starts].tolist(),
                                                             b[starts].tolist())], np.int64)
    out = np.empty(len(order), np.int64)
    out[order] = ids[np.cumsum(starts) - 1]
    return out


class Submitters:
    """Threads seen doing device work (submitting or syncing: with per-launch
    probes off, a launching thread still shows by its syncs), bounded.

    A run-queue batch is asked about twice (the metrics' counts, the P99
    series): `select` keeps its answer for the batch it was last given, until
    the threads known change. On a host without GPU/NPU work no thread is
    known, and a batch costs nothing."""

    def __init__(self, limit: int = 1 << 16):
        self.limit = limit
        self._tids = np.zeros(0, np.uint32)       # sorted, unique
        self.version = 0        # counts the changes of the known threads
        self._asked: tuple[np.ndarray, np.ndarray] | None = None    # (batch, its submitters' events)

    def learn(self, device_events: np.ndarray):
        if not len(device_events):
            return
        work = device_stream.in_table(device_events["kind"], DEVICE_WORK)
        tids = device_events["tid"][work]
        new = tids[~self.mask(tids)]        # known ones dropped before any sort
        if len(new):        # most batches bring none: the known ones are left as they are
            self._tids = np.union1d(self._tids, new)[-self.limit:]
            self._asked = None
            self.version += 1

    def mask(self, tids: np.ndarray) -> np.ndarray:
        """Which of `tids` are known (a binary search each in the sorted known
        ones: no sort of the batch, as np.isin does)."""
        known = self._tids
        if not len(known) or not len(tids):
            return np.zeros(len(tids), bool)
        at = np.searchsorted(known, tids)
        np.minimum(at, len(known) - 1, out=at)
        return known[at] == tids

    def select(self, runq: np.ndarray) -> np.ndarray:
        """The events of `runq` whose thread is known."""
        asked = self._asked
        if asked is not None and asked[0] is runq:
            return asked[1]
        if not len(self._tids) or not len(runq):
            mine = runq[:0]
        else:
            mine = runq[self.mask(runq["tid"])]
        self._asked = (runq, mine)
        return mine

    @property
    def tids(self) -> np.ndarray:
        return self._tids


def runq_series(series_id, runq: np.ndarray, submitters: Submitters) -> Series:
    mine = submitters.select(runq)
    if not len(mine):
        return Series.empty()
    ids = _named(series_id, lambda pid: SeriesKey(series_keys.RUNQ, pid=pid), mine["pid"])
    return Series(ids, mine["ts_ns"].astype(np.int64), mine["delay_ns"] / 1e9,
                  mine["tid"].astype(np.int64))


def sync_series(series_id, device_events: np.ndarray) -> Series:
    """Syncs whose return was seen (their duration is the time blocked),
    less those that failed (they waited for nothing)."""
    if not len(device_events):
        return Series.empty()
    done = ((device_events["kind"] == SYNC) & device_stream.returned(device_events)
            & ~device_stream.failed(device_events))
    syncs = device_events[done]
    if not len(syncs):
        return Series.empty()
    ids = _named_pairs(series_id, lambda pid, stream: SeriesKey(series_keys.SYNC, pid=pid,
                                                                 stream=stream),
                       syncs["pid"], syncs["stream_handle"])
    return Series(ids, syncs["ts_ns"].astype(np.int64), syncs["duration_ns"] / 1e9,
                  syncs["tid"].astype(np.int64))


def retire_series(series_id, aligned: np.ndarray) -> Series:
    """Submissions whose retirement is known (aligned events, retired_ns >= 0)."""
    if not len(aligned):
        return Series.empty()
    done = device_stream.in_table(aligned["kind"], SUBMISSIONS) & (aligned["retired_ns"] >= 0)
    subs = aligned[done]
    if not len(subs):
        return Series.empty()
    ts = subs["ts_ns"].astype(np.int64)
    latency = np.maximum(subs["retired_ns"] - ts, 0) / 1e9
    ids = _named(series_id, lambda pid: SeriesKey(series_keys.RETIRE, pid=pid), subs["pid"])
    return Series(ids, ts, latency, subs["tid"].astype(np.int64))


def failure_calls(device_events: np.ndarray, infos: dict):
    """What detectors/call_failures.py takes of device events: (pid, ts_ns,
    failed, api name, error text, pair key) per call, the names and texts
    only where it failed (the detector reads them nowhere else), each made
    once per (API, code) of the batch, and the key of that pair (the
    detector counts by it): a process whose calls all fail costs a few
    lookups a batch, not a Python step per call."""
    failed = device_stream.failed(device_events)
    names = np.empty(len(device_events), object)      # None where the call did not fail
    errors = np.empty(len(device_events), object)
    keys = device_stream.api_code_keys(device_events["api"], device_events["ret"])
    at = np.flatnonzero(failed)
    if len(at):
        # The columns, not the rows: a structured row copy goes field by field.
        api, ret = device_events["api"][at], device_events["ret"][at]
        _, first, inverse = np.unique(keys[at], return_index=True, return_inverse=True)
        pair_names, pair_errors = np.empty(len(first), object), np.empty(len(first), object)
        for j, (a, code) in enumerate(zip(api[first].tolist(), ret[first].tolist())):
            pair_names[j] = infos[a].api if a in infos else str(a)
            pair_errors[j] = device_stream.error_text(infos.get(a), int(code))
        names[at] = pair_names[inverse]
        errors[at] = pair_errors[inverse]
    return device_events["pid"], device_events["ts_ns"], failed, names, errors, keys
