"""How a recording's meta tables (probe states, op names, the symbol table)
stay within what a reader keeps, whatever the host does."""

import json
from collections import Counter

from mmtrace.agent.recording.file_format import MAX_META_BYTES

# A reader keeps MAX_META_BYTES of meta, all chunks together, and refuses a
# chunk larger than that: the tables written (probe states, op names, the
# symbol table) stay within this, with room for the rest, whatever the host
# does; what does not fit is counted in the footer (meta_omitted).
META_BUDGET_BYTES = MAX_META_BYTES - (1 << 20)
META_CHUNK_BYTES = 1 << 20      # one table chunk at most
# Probe states may take this much of the budget: files come and go, and
# their states must leave room for the names.
PROBE_META_SHARE = 0.25


class MetaBudget:
    """The meta tables of one recording, written within META_BUDGET_BYTES
    all together (probe states within PROBE_META_SHARE of it), in chunks
    of at most META_CHUNK_BYTES. A reader keeps only the latest symbol
    table: a new one takes the place of the last. `omitted` counts the
    rows (and symbol tables) left out."""

    def __init__(self, writer, budget: int = META_BUDGET_BYTES):
        self.writer = writer
        self.left = budget
        self.omitted: Counter[str] = Counter()
        self._share_left = {"probes": int(budget * PROBE_META_SHARE)}
        self._symbols_bytes = 0

    def table(self, key: str, rows: list):
        chunk, size = [], 0
        for row in rows:
            cost = _json_size(row) + 2
            if cost > min(self.left, self._share_left.get(key, self.left)):
                self.omitted[key] += 1
                continue
            if key in self._share_left:
                self._share_left[key] -= cost
            if size + cost > META_CHUNK_BYTES and chunk:
                self.writer.write_meta({key: chunk})
                chunk, size = [], 0
            chunk.append(row)
            size += cost
            self.left -= cost
        if chunk:
            self.writer.write_meta({key: chunk})

    def symbols(self, table: dict):
        cost = _json_size(table)
        if cost > self.left + self._symbols_bytes:
            self.omitted["symbol_names"] += 1
            return
        self.left += self._symbols_bytes - cost
        self._symbols_bytes = cost
        self.writer.write_meta({"symbol_names": table})


def _json_size(value) -> int:
    return len(json.dumps(value, sort_keys=True))


def fit_meta(doc: dict, budget: int = META_BUDGET_BYTES) -> dict:
    """One meta document (a flight recording's) within `budget` bytes of
    JSON: when over, the probe states of symbols their library lacks are
    summarised, one row per library, then the oldest op-name rows dropped,
    and last the probe states counted by state only. `omitted` says what
    was left out."""
    if _json_size(doc) <= budget:
        return doc
    out = {"probes": [], "op_names": [], **doc}
    probes, rows = out["probes"], out["op_names"]
    out["probes"] = summarised_probe_states(probes)
    omitted = {"probe_rows": len(probes) - len(out["probes"])}
    rest = _json_size({k: v for k, v in out.items() if k != "op_names"}) + 256
    out["op_names"] = _newest_within(rows, budget - rest)
    omitted["op_names"] = len(rows) - len(out["op_names"])
    if _json_size(out) > budget:
        out["probes"] = [{"state": state, "count": n} for state, n in sorted(Counter(
            s.get("state", "") for s in probes).items())]
        omitted["probe_rows"] = len(probes)
    out["omitted"] = omitted
    return out


def summarised_probe_states(states: list[dict]) -> list[dict]:
    """The states, with the not_found rows (symbols a library lacks) folded
    into one per library that counts them."""
    out, folded = [], {}
    for state in states:
        if state.get("state") != "not_found":
            out.append(state)
            continue
        key = (state.get("path"), state.get("inode"))
        row = folded.get(key)
        if row is None:
            row = folded[key] = {**state, "symbol": "*", "api": "*", "reason": "",
                                 "count": 0}
            out.append(row)
        row["count"] += int(state.get("count", 1))
    return out


def _newest_within(rows: list, budget: int) -> list:
    """The newest rows whose JSON fits in `budget` bytes."""
    kept, used = 0, 0
    for row in reversed(rows):
        used += _json_size(row) + 2
        if used > budget:
            break
        kept += 1
    return rows[len(rows) - kept:]
