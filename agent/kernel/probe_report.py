"""What the GPU/NPU probes report: a row per probe (a pattern API's
symbols of one library counted in one row), the rows of files that could
not be probed, the count of probes by state, and what the probes hold."""

from collections import deque

from mmtrace.agent.kernel.probed_file import (ATTACHED, DETACHED, ENTRY, FAILED, NOT_FOUND,
                                              Probe, ProbedFile, ProbeState)

MAX_LIBRARY_FAILURES = 256  # failure rows kept; every failure is counted
COUNTERS = ("released_libraries", "library_failures", "exited_before_attach")


def summarise(probes: list[Probe]) -> list[ProbeState]:
    """A row per probe; a pattern API's symbols in one row per library,
    state and reason, with their count."""
    rows: dict[tuple, ProbeState] = {}
    out = []
    for p in probes:
        if p.api.pattern is None:
            out.append(ProbeState(p.library.path, p.library.inode, p.symbol, p.api.name,
                                  p.api.stream, p.point, p.state, p.reason))
            continue
        key = (p.library.inode, p.api.id, p.point, p.state, p.reason)
        row = rows.get(key)
        if row is None:
            row = rows[key] = ProbeState(p.library.path, p.library.inode,
                                         p.api.pattern, p.api.name, p.api.stream,
                                         p.point, p.state, p.reason, count=0)
            out.append(row)
        row.count += 1
    return out


def by_state(probes: list[Probe]) -> dict[str, int]:
    """Probe points by state (a pattern API counts each symbol)."""
    out = {ATTACHED: 0, DETACHED: 0, NOT_FOUND: 0, FAILED: 0}
    for probe in probes:
        out[probe.state] += 1
    return out


def footprint(libraries: list[ProbedFile], retired: int, counters) -> dict[str, int]:
    """What the probes hold: libraries (files probed), links (uprobe_multi
    links, perf events), descriptors (theirs and the files', the `retired`
    files still open included), retired; and the counters."""
    links = [a for library in libraries for a in library.attachments()]
    files_open = sum(lib.fd is not None for lib in libraries)
    return {"libraries": len(libraries), "links": len(links),
            "descriptors": files_open + retired
            + sum(getattr(a, "descriptors", 1) for a in links),
            "retired": retired, **{name: counters[name] for name in COUNTERS}}


class FailedFiles:
    """The rows of files that could not be probed: the latest
    MAX_LIBRARY_FAILURES, until their file is released."""

    def __init__(self):
        self._rows: deque[ProbeState] = deque(maxlen=MAX_LIBRARY_FAILURES)

    def add(self, target, reason: str) -> ProbeState:
        row = ProbeState(str(target.path), int(target.inode), "*", "*", "", ENTRY, FAILED,
                         reason)
        self._rows.append(row)
        return row

    def forget(self, targets: list):
        """The rows of released files go with them."""
        gone = {(str(t.path), int(t.inode)) for t in targets}
        if gone and any((row.path, row.inode) in gone for row in self._rows):
            self._rows = deque((row for row in self._rows if (row.path, row.inode) not in gone),
                               maxlen=MAX_LIBRARY_FAILURES)

    def rows(self) -> list[ProbeState]:
        return list(self._rows)
