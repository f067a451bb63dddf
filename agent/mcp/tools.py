"""What each MCP tool does, as plain functions of checked arguments: the
answers `mmtrace top --json`, `report --json` and `explain --json` give,
through the same code (the socket client, summarize, explain_recording).
A problem is raised as MmtraceError, whose message the server hands back
as the tool's error."""

from dataclasses import dataclass
from pathlib import Path

from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.recording.file_format import RecordingError
from mmtrace.agent.mcp.arguments import shown
from mmtrace.agent.mcp.roots import RecordingRoots
from mmtrace.agent.mcp.wording import in_tool_terms
from mmtrace.exporters.terminal import daemon_client
from mmtrace.exporters.terminal.daemon_client import NoDaemon

STATUS_TIMEOUT_S = 5.0         # more than top's 2 s: nobody watches a screen refresh
SERIES_TIMEOUT_S = 10.0
DUMP_TIMEOUT_S = 60.0
DEFAULT_ANOMALIES = 50
DEFAULT_RECORDINGS = 20


@dataclass
class Investigation:
    """What the tools reach: the daemon's socket and the recordings' roots;
    `allow_dump`: whether `dump` may have the daemon write a file."""
    socket: Path
    roots: RecordingRoots
    allow_dump: bool = False

    # ------------------------------------------------------------ live

    def _ask(self, kind: str, timeout_s: float, **fields) -> dict:
        try:
            reply = daemon_client.ask(self.socket, kind, timeout_s, **fields)
        except (NoDaemon, ValueError) as exc:
            raise MmtraceError(str(exc)) from None
        reply.pop("v", None)
        reply.pop("type", None)
        return reply

    def status(self) -> dict:
        return self._ask("status", STATUS_TIMEOUT_S)

    def dump(self) -> dict:
        if not self.allow_dump:
            raise MmtraceError("dump writes a flight recording, and this server was started "
                               "without --allow-dump; expected `mmtrace mcp --allow-dump` "
                               "(or use `recordings` for those already written)")
        reply = self._ask("dump", DUMP_TIMEOUT_S)
        if not isinstance(reply.get("path"), str):
            raise MmtraceError(f"expected the file's path in the daemon's dump reply, got "
                               f"{str(reply.get('path'))[:80]}")
        return reply

    # ------------------------------------------------------ recordings

    def _read(self, path: str, work):
        """`work(rec)` over the recording `path` names, opened within the
        roots; a file that changes while being read is one clear error."""
        rec = self.roots.open(path)
        try:
            with rec:
                return work(rec)
        except RecordingError as exc:
            raise MmtraceError(str(exc)) from None

    def report(self, path: str) -> dict:
        from mmtrace.agent.recording.report import summarize
        return self._read(path, summarize)

    def recordings(self, limit: int = DEFAULT_RECORDINGS) -> dict:
        cut = []
        listed = self.roots.recordings(limit, cut)
        return {"roots": [str(r) for r in self.roots.roots], "recordings": listed,
                "unreadable": self.roots.unreadable(), "cut": cut}

    # ------------------------------------------------------ either one

    def explain(self, pid: int | None = None, path: str | None = None,
                window: str | None = None, last_s: float = 10.0) -> dict:
        try:
            return self._explain(pid, path, window, last_s)
        except MmtraceError as exc:
            raise MmtraceError(in_tool_terms(exc.message, window is not None)) from None

    def _explain(self, pid, path, window, last_s) -> dict:
        from mmtrace.agent.recording.window_arg import parse_window
        span = parse_window(window)
        if path is not None:
            from mmtrace.agent.recording.explain import explain_recording
            return self._read(path, lambda rec: explain_recording(
                rec, span, [pid] if pid is not None else None))
        if pid is None:
            raise MmtraceError("expected pid (explain a process live, from the daemon) or "
                               "path (a recording), got neither")
        try:
            return daemon_client.explain(self.socket, [int(pid)], span, float(last_s))
        except (NoDaemon, ValueError) as exc:
            raise MmtraceError(str(exc)) from None

    def anomalies(self, path: str | None = None, limit: int = DEFAULT_ANOMALIES) -> dict:
        if path is None:
            found, source = self.status().get("anomalies"), "daemon"
        else:
            found, source = self.report(path).get("anomalies"), path
        if not isinstance(found, list):
            raise MmtraceError(f"expected a list of anomalies from the {source}, got "
                               f"{shown(found)}")
        return {"source": source, "count": len(found), "anomalies": found[-limit:]}

    def hints(self, path: str | None = None) -> dict:
        if path is None:
            status = self.status()
            return {"source": "daemon", "hints": status.get("hints") or [],
                    "hints_sent": status.get("hints_sent"), "policy": status.get("policy")}
        from mmtrace.agent.recording.report_telemetry import hint_summary
        audit = self._read(path, hint_summary)
        return {"source": path, "hints": audit["last"], "count": audit["count"],
                "by_kind_outcome": audit["by_kind_outcome"]}

    def series(self, name: str, window_s: float = 10.0, path: str | None = None) -> dict:
        from mmtrace.agent.ingest.series_window import check_name
        try:
            check_name(name)
        except ValueError as exc:
            raise MmtraceError(f"name: {exc}") from None
        if path is None:
            return self._ask("series", SERIES_TIMEOUT_S, name=name, window_s=float(window_s))
        from mmtrace.agent.recording.series_replay import series_of
        return self._read(path, lambda rec: series_of(rec, name, window_s))
