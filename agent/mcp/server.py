"""`mmtrace mcp`: the tools and the prompt over MCP's stdio transport, on the
official SDK's low-level server (the schemas are written out, not derived
from signatures, so each bound is where an assistant can read it).

Every call's arguments are checked against its schema first; the work runs
in a worker thread, one call at a time (a replay holds its memory only
while it runs), so the transport keeps answering meanwhile. Whatever goes
wrong in a call comes back as that call's tool error (isError): the server
serves the next one."""

import json
import logging
import math
from functools import partial
from importlib.metadata import version

import anyio
import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS
from mcp.server.stdio import stdio_server

from mmtrace.agent import heap
from mmtrace.agent.errors import MmtraceError
from mmtrace.agent.mcp import prompts
from mmtrace.agent.mcp.arguments import Answers, Arguments, shown
from mmtrace.agent.mcp.schemas import TOOLS
from mmtrace.agent.mcp.tools import Investigation

log = logging.getLogger("mmtrace.mcp")
MAX_ANSWER_BYTES = 1 << 20

INSTRUCTIONS = (
    "mmtrace traces this host's CPU run queues and GPU/NPU calls with eBPF and explains "
    "latency. Start with `status`, then `anomalies`, `explain` a process, and read the "
    "flight `recordings` of the moment asked about. Times are CLOCK_MONOTONIC seconds "
    "(with wall-clock stamps beside them).")


def build(investigation: Investigation) -> Server:
    checker, answers = Arguments(TOOLS), Answers(TOOLS)
    one_at_a_time = anyio.CapacityLimiter(1)

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[
            types.Tool(name=name, title=spec["title"], description=spec["description"],
                       input_schema=spec["input"], output_schema=spec["output"],
                       annotations=types.ToolAnnotations(read_only_hint=name != "dump",
                                                         open_world_hint=False))
            for name, spec in TOOLS.items()])

    async def call_tool(ctx, params) -> types.CallToolResult:
        name = params.name
        try:
            if name not in TOOLS:
                raise MmtraceError(f"expected a tool among {', '.join(TOOLS)}, got "
                                   f"{shown(name)}")
            arguments = checker.check(name, params.arguments)
            work = partial(_then_trim, getattr(investigation, name), arguments)
            answer = await anyio.to_thread.run_sync(work, limiter=one_at_a_time)
            return _answer(answers.check(name, _finite(answer)), name)
        except MmtraceError as exc:
            return _error(f"{name[:60]}: {exc.message}")
        except Exception as exc:            # a bug must cost one call, not the server
            log.exception("mcp: tool %s failed", name[:60])
            return _error(f"{name[:60]}: internal error ({type(exc).__name__}: "
                          f"{str(exc)[:200]}); the server goes on")

    async def list_prompts(ctx, params) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=[types.Prompt(
            name=prompts.NAME, description=prompts.DESCRIPTION,
            arguments=[types.PromptArgument(name=n, description=d, required=False)
                       for n, d in prompts.ARGUMENTS])])

    async def get_prompt(ctx, params) -> types.GetPromptResult:
        if params.name != prompts.NAME:
            raise MCPError(INVALID_PARAMS, f"expected the prompt {prompts.NAME}, got "
                                           f"{shown(params.name)}")
        given = {k: prompts.clean(v) for k, v in (params.arguments or {}).items()
                 if k in dict(prompts.ARGUMENTS)}
        return types.GetPromptResult(description=prompts.DESCRIPTION, messages=[
            types.PromptMessage(role="user",
                                content=types.TextContent(text=prompts.investigate(**given)))])

    return Server("mmtrace", version=version("mmtrace"), instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool,
                  on_list_prompts=list_prompts, on_get_prompt=get_prompt)


def _then_trim(tool, arguments: dict):
    """A replay's batches freed go back to the kernel after each call: a
    server an assistant keeps for days must not hold its busiest call's
    memory for good."""
    try:
        return tool(**arguments)
    finally:
        heap.trim()


def _answer(answer: dict, tool: str) -> types.CallToolResult:
    """The answer as structured content and as its JSON text, or a tool error
    when it is larger than an answer may be: both go on the wire, so the
    bound is on twice the text."""
    text = json.dumps(answer, allow_nan=False, default=str)
    wire = 2 * len(text.encode())
    if wire > MAX_ANSWER_BYTES:
        narrowing = [a for a in ("pid", "window", "window_s", "limit")
                     if a in TOOLS[tool]["input"]["properties"]]
        how = f"narrow it ({', '.join(narrowing)})" if narrowing else \
            "it takes no arguments that narrow it"
        raise MmtraceError(f"the answer is {wire:,} bytes on the wire (its JSON as text and "
                           f"as structured content), more than the {MAX_ANSWER_BYTES:,} an "
                           f"answer may hold; {how}")
    return types.CallToolResult(content=[types.TextContent(text=text)],
                                structured_content=answer)


MAX_ERROR_CHARS = 2000


def _error(message: str) -> types.CallToolResult:
    """A tool error, short: a daemon's or a file's text inside it may be long."""
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... (cut: {len(message):,} characters)"
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True)


def _finite(value):
    """NaN and infinities (no JSON has them) as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def serve(investigation: Investigation) -> None:
    """Serve over stdin and stdout until the client closes them."""
    server = build(investigation)

    async def main():
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    anyio.run(main)
