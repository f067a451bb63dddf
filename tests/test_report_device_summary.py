"""The report's GPU/NPU summary (DeviceSummary) counts rows grouped by API
id with numpy; here it is checked against the same figures counted row by
row, on random rows of every exported API: failed calls of aclnn launches
that name different ops, API ids that share a name (a _ptsz variant),
copies of lengths near 2**64, batches cut anywhere."""

from collections import Counter

import numpy as np
import pytest

from mmtrace.bpf import device as ds

from mmtrace.agent.recording.device_view import DeviceContext, decode
from mmtrace.agent.recording.report import DeviceSummary

OPS = {1: "aclnnAdd", 2: "aclnnMatmul", 3: "aclnnSoftmax"}


def _events(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    infos = ds.default_infos()
    exported = [i for i, info in infos.items() if info.kind in ds.EXPORTED_KINDS]
    ev = np.zeros(n, ds.DEV_EVENT)
    ev["ts_ns"] = np.sort(rng.integers(1, 10**9, n)).astype(np.uint64)
    ev["api"] = rng.choice(exported, n)
    ev["pid"] = ev["tid"] = 7
    ev["flags"] = np.where(rng.random(n) < 0.9, ds.FLAG_RETURNED, 0)
    codes = [1, 35, 100, *rng.integers(1, 1 << 31, 200).tolist()]     # a storm of codes too
    ev["ret"] = np.where(rng.random(n) < 0.3, rng.choice(codes, n), 0)
    ev["duration_ns"] = rng.integers(0, 10**6, n)
    ev["direction"] = rng.choice([0, 1, 2, 3, ds.NO_DIRECTION], n)
    big = rng.random(n) < 0.05      # garbled lengths: their sums pass 2**64
    ev["bytes"] = np.where(big, np.uint64(2**64 - 5), rng.integers(0, 1 << 20, n).astype(np.uint64))
    ev["symbol_id"] = rng.choice(list(OPS), n)
    ev["op_id"] = np.arange(1, n + 1)
    return ev


def _by_rows(batches) -> dict:
    """The same figures, one row at a time."""
    events, failures, ops, waits, copies = Counter(), Counter(), Counter(), {}, {}
    launches = [0, 0]
    for rows in batches:
        ev = rows.events
        for i in range(len(rows)):
            s, k, a = rows.stream[i], rows.kind[i], rows.api[i]
            if rows.error[i] is not None:
                failures[(s, k, a, rows.error[i])] += 1
                continue
            returned = bool(ev["flags"][i] & ds.FLAG_RETURNED)
            events[f"{s}.{k}"] += 1
            if k == "launch":
                launches[0] += 1
                launches[1] += returned
            if k in ("launch", "graph_launch", "model_exec"):
                ops[(s, k, a, rows.op_name[i])] += 1
            if k == "sync" and returned:
                waits.setdefault((s, a), []).append(int(ev["duration_ns"][i]))
            if k == "memcpy":
                entry = copies.setdefault((s, rows.direction[i]), [0, 0])
                entry[0] += 1
                entry[1] += int(ev["bytes"][i])
    return {"events": events, "failures": failures, "ops": ops, "launches": launches,
            "waits": {key: (len(v), sum(v), max(v)) for key, v in waits.items()},
            "copies": copies}


def _by_summary(batches) -> dict:
    summary = DeviceSummary()
    for rows in batches:
        summary.add(rows)
    return {"events": summary.events, "failures": summary.failures,
            "ops": summary.ops.counts, "launches": summary.launch_returns,
            "waits": {key: (p.count, p.total, p.max) for key, p in summary.waits.items()},
            "copies": summary.copies}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_grouped_summary_counts_what_a_row_by_row_count_does(seed):
    rows = decode(_events(5000, seed), DeviceContext(ds.default_infos(), symbol_names=OPS))
    cuts = np.sort(np.random.default_rng(seed).integers(0, len(rows), 6)).tolist()
    batches = [rows.where((np.arange(len(rows)) >= lo) & (np.arange(len(rows)) < hi))
               for lo, hi in zip([0] + cuts, cuts + [len(rows)])]
    want, got = _by_rows(batches), _by_summary(batches)
    # The cases the grouping must get right are all in the data.
    assert len({a for (_, k, a, _) in want["failures"] if k == "launch"}) > 3
    assert max(total for _, total in want["copies"].values()) > 2**64
    assert ("gpu", "cudaStreamSynchronize") in want["waits"]
    for key in want:
        assert got[key] == want[key], key
