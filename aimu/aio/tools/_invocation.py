"""Running one tool call: bind the arguments, run the function, turn the result into text.

Every failure becomes a :class:`ToolOutcome` the model can read, except
``CancelledError``, which always propagates. Sync tools run in a worker thread; a
thread cannot be killed, so on a cancel or timeout the caller moves on at once and
the thread's result goes nowhere.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aimu.aio import _tracing as tracing
from aimu.aio.tools._context import ToolContext
from aimu.aio.tools._definition import Tool, ToolOutcome
from aimu.aio.tools._json_values import NotText, to_text
from aimu.aio.tools._parameters import BadArguments
from aimu.aio.transcript import ToolCall

__all__ = ["ToolOutcome", "invoke"]

# Problems at INFO (the model's) and WARNING (the tool's), named but without contents;
# arguments and results only at DEBUG.
log = logging.getLogger("aimu.aio.tools")


def run_sync(fn: Callable[..., Any], args: Sequence[object], kwargs: dict[str, object]) -> str:
    # Runs in the worker thread, so a large result is serialised off the event loop.
    return to_text(fn(*args, **kwargs))


async def invoke(tools: Mapping[str, Tool], call: ToolCall, ctx: ToolContext) -> ToolOutcome:
    """Run one tool call; every failure becomes an error outcome the model can read.

    Unknown tool, invalid arguments, a raising tool, a timeout (which also marks ``ctx``
    cancelled) and an unserialisable result are outcomes; ``CancelledError`` marks
    ``ctx`` cancelled and propagates. With OpenTelemetry set up, the call is a span.
    """
    if not tracing.enabled():
        return await _invoke(tools, call, ctx)
    name = call["function"]["name"]
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call["id"],
        "gen_ai.tool.type": "function",
    }
    with tracing.span(f"execute_tool {name}", attributes) as notes:
        outcome = await _invoke(tools, call, ctx)
        if notes is not None:
            if outcome.is_error:
                notes.ended("failed", error="tool_error")
            else:
                notes.ended("completed")
        return outcome


async def _invoke(tools: Mapping[str, Tool], call: ToolCall, ctx: ToolContext) -> ToolOutcome:
    outcome = await _outcome_of(tools, call, ctx)
    tool = tools.get(call["function"]["name"])
    if tool is None or tool.max_result is None:
        return outcome
    return _capped(outcome, tool.max_result, tool.name, call["id"])


def _capped(outcome: ToolOutcome, cap: int, name: str, call_id: str) -> ToolOutcome:
    """``outcome`` with its text cut to ``cap`` bytes of UTF-8 (on a character boundary)
    and a marker saying how much was dropped: what the transcript and the store keep."""
    text = outcome.content
    if len(text) <= cap // 4:  # 4 bytes a character at most: short enough, not encoded
        return outcome
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= cap:
        return outcome
    kept = data[:cap].decode("utf-8", "ignore")  # a character cut in two is left out
    dropped = len(data) - len(kept.encode("utf-8", "surrogatepass"))
    log.info("tool %r returned %d bytes, cut to %d (call %s)", name, len(data), cap, call_id)
    marker = (
        f"\n[cut: {dropped:,} of {len(data):,} bytes dropped; "
        f"tool {name!r} results are capped at {cap:,} bytes]"
    )
    return ToolOutcome(kept + marker, outcome.is_error)


async def _outcome_of(
    tools: Mapping[str, Tool], call: ToolCall, ctx: ToolContext
) -> ToolOutcome:
    function = call["function"]
    name = function["name"]
    tool = tools.get(name)
    if tool is None:
        log.info("the model called an unknown tool %r (call %s)", name, call["id"])
        available = ", ".join(repr(n) for n in tools) or "none"
        return ToolOutcome(f"unknown tool {name!r}; available tools: {available}", True)
    try:
        args, kwargs = _arguments(tool, function.get("arguments", {}), ctx)
    except BadArguments as exc:
        log.info("tool %r: the model sent invalid arguments (call %s)", name, call["id"])
        log.debug("tool %r (call %s): %s", name, call["id"], exc)
        return ToolOutcome(str(exc), True)
    try:
        outcome = await _run_within_timeout(tool, args, kwargs, ctx)
    except asyncio.CancelledError:
        ctx.mark_cancelled()
        raise
    except NotText as exc:
        log.warning("tool %r returned a value that is not text or JSON (call %s)", name, call["id"])
        return ToolOutcome(f"tool {name!r} returned {exc}", True)
    except Exception as exc:
        log.warning("tool %r raised %s (call %s)", name, type(exc).__name__, call["id"])
        log.debug("tool %r (call %s) raised", name, call["id"], exc_info=exc)
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return ToolOutcome(f"tool {name!r} failed: {detail}", True)
    if log.isEnabledFor(logging.DEBUG):
        log.debug("tool %r (call %s): %r -> %r", name, call["id"], kwargs, outcome.content)
    return outcome


async def _run_within_timeout(
    tool: Tool, args: list[object], kwargs: dict[str, object], ctx: ToolContext
) -> ToolOutcome:
    """The tool's result as text, or an error outcome if its own timeout passed."""
    if tool.timeout is None:
        return _outcome(await _run(tool, args, kwargs))
    deadline = asyncio.timeout(tool.timeout)
    try:
        async with deadline:
            result = await _run(tool, args, kwargs)
    except TimeoutError:
        if not deadline.expired():
            raise  # the tool's own TimeoutError: a failure like any other
        ctx.mark_cancelled()
        log.warning("tool %r timed out after %g s (call %s)", tool.name, tool.timeout, ctx.call_id)
        return ToolOutcome(f"tool {tool.name!r} timed out after {tool.timeout:g} s", True)
    return _outcome(result)


def _outcome(result: str | ToolOutcome) -> ToolOutcome:
    return result if isinstance(result, ToolOutcome) else ToolOutcome(result, False)


def _arguments(
    tool: Tool, arguments: object, ctx: ToolContext
) -> tuple[list[object], dict[str, object]]:
    """The positional and keyword arguments of the call, the context included."""
    params = tool._params
    kwargs = params.bind(arguments)
    if params.context_param is not None:
        kwargs[params.context_param] = ctx
    args: list[object] = []
    for param, default in params.positional:
        if param in kwargs:
            args.append(kwargs.pop(param))
        elif default is not inspect.Parameter.empty:
            args.append(default)
        else:  # a required positional-only argument was missing: bind() reported it
            break
    return args, kwargs


async def _run(tool: Tool, args: list[object], kwargs: dict[str, object]) -> str | ToolOutcome:
    if tool.is_async:
        result = await tool.fn(*args, **kwargs)
        # A tool from a schema (an MCP server's) may answer with a whole outcome.
        return result if isinstance(result, ToolOutcome) else to_text(result)
    return await asyncio.to_thread(run_sync, tool.fn, args, kwargs)
