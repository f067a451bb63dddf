"""`mmtrace mcp` as an assistant's MCP client starts it: the official SDK's
own Client over stdio, driven from synchronous tests through an anyio
blocking portal (one event loop in a thread holds the session open across
tests)."""

import os
from pathlib import Path

from anyio.from_thread import start_blocking_portal
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client

from conftest import MMTRACE

CALL_TIMEOUT_S = 120.0


class McpSession:
    def __init__(self, args: list[str], log: Path, env: dict | None = None,
                 as_user: list[str] = ()):
        """`as_user`: a command that runs the server as another user
        (setpriv --reuid=...), its arguments before mmtrace's."""
        self._errlog = open(log, "w")
        self._portal_cm = start_blocking_portal()
        self.portal = self._portal_cm.__enter__()
        command = [*as_user, str(MMTRACE), "mcp", *map(str, args)]
        params = StdioServerParameters(command=command[0], args=command[1:],
                                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                            **(env or {})})
        before = set(_children())
        self._client_cm = self.portal.wrap_async_context_manager(
            Client(stdio_client(params, errlog=self._errlog),
                   read_timeout_seconds=CALL_TIMEOUT_S))
        try:
            self.client = self._client_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            raise
        started = [pid for pid in _children() if pid not in before and _is_server(pid)]
        self.pid = started[0] if started else None
        self.tools()        # listed once, the client checks every answer against its schema

    def call(self, name: str, arguments=None):
        return self.portal.call(self.client.call_tool, name, arguments)

    def tools(self):
        return self.portal.call(self.client.list_tools).tools

    def prompts(self):
        return self.portal.call(self.client.list_prompts).prompts

    def prompt(self, name: str, arguments: dict):
        return self.portal.call(self.client.get_prompt, name, arguments)

    def rss_kib(self) -> int:
        """The server process's resident memory (VmRSS), from /proc."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"no VmRSS for pid {self.pid}")

    def alive(self) -> bool:
        return self.pid is not None and Path(f"/proc/{self.pid}").exists()

    def close(self):
        try:
            self._client_cm.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)
            self._errlog.close()


def _children() -> list[int]:
    """This process's children (the SDK spawns the server itself)."""
    me, out = os.getpid(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                out.append(int(entry))
    return out


def _is_server(pid: int) -> bool:
    try:
        return b"mcp" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False

