"""An aimu agent as an MCP server: one tool, a task in and the agent's answer out.

:func:`agent_server` builds it (the official ``mcp`` SDK's ``MCPServer``) over a
:class:`~aimu.serve.runs.Runs`, so ``aimu mcp`` (stdio) and ``aimu serve``'s ``/mcp``
(Streamable HTTP) run it the same way:

- each call is a run on a session (the call's ``session`` argument, else a new one), its
  events reported as MCP progress notifications (tool calls, tool results, steps);
- MCP's cancel (``notifications/cancelled``, or the aborted request on the newer HTTP
  protocol) cancels the run at once: the model's stream closes and the partial answer is
  kept in the session;
- a tool call that needs a person's approval becomes an elicitation to the client when it
  supports them (asked mid-call on a connection that can, or as an ``input_required``
  result that the client answers by calling again, on the 2026-07-28 protocol); otherwise
  the call answers with what waits and how to decide (call the tool again on the same
  session with ``approve`` or ``deny``). The pause is the run's own, kept in the store, so
  nothing holds the call open while a person decides.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final

from mcp import types
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import InputRequiredResult
from pydantic import BaseModel, Field

from aimu.aio.events import StepFinished, ToolCallStarted, ToolResult
from aimu.serve.errors import ServeError
from aimu.serve.protocols import EventStream
from aimu.serve.runs import Runs, validate_name
from aimu.serve.stream_runs import RunFollower, decide_all, shown_id

__all__ = ["TOOL_NAME", "agent_server"]

TOOL_NAME: Final = "run_agent"
_APPROVE: Final = frozenset({"approve", "approved", "yes", "y", "allow", "ok"})
_DENY: Final = frozenset({"deny", "denied", "no", "n", "refuse"})


class Approval(BaseModel):
    """What the elicitation asks the client's person for."""

    approve: bool = Field(description="Run this tool call?")
    reason: str = Field(default="", description="Why (told to the model if denied)")


def agent_server(runs: Runs, *, name: str = "aimu", tool: str = TOOL_NAME) -> MCPServer:
    """An MCP server whose one tool, ``tool``, runs the agent of ``runs`` on a task."""
    # The SDK's MCPServer sets up the process's root logger (logging.basicConfig with
    # its own handler, at INFO): every library's INFO records would then reach stderr
    # (and come before aimu serve's banner). Logging is the application's: put it back.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        server = MCPServer(
            name=name,
            instructions=f"Call {tool} with a task; the agent answers it, calling its own "
            "tools. Give the same session to continue a conversation.",
        )
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)

    @server.tool(
        name=tool,
        description="Ask the agent to do a task; returns its answer. Cancelling the call "
        "stops the agent at once (its partial answer is kept in the session).",
        annotations=types.ToolAnnotations(destructive_hint=True, idempotent_hint=False,
                                          open_world_hint=True),
    )
    async def run_agent(
        task: Annotated[str, Field(description="What the agent should do; on a session "
                                   "waiting for approval: approve or deny")],
        ctx: Context,
        session: Annotated[str, Field(description="Continue this session (1-128 of "
                                      "A-Z a-z 0-9 . _ -); empty: a new one")] = "",
    ) -> str | InputRequiredResult:
        return await _answer(runs, ctx, task, session or f"mcp-{secrets.token_hex(6)}")

    return server


async def _answer(
    runs: Runs, ctx: Context, task: str, session: str
) -> str | InputRequiredResult:
    try:
        validate_name(session)
        if ctx.input_responses is not None and ctx.request_state == _ASKED:
            follower = await _answered(runs, session, ctx.input_responses)
        else:
            follower = await _begin(runs, session, task)
        while True:
            try:
                await _report(follower, ctx)
            finally:
                await follower.aclose()  # the call was cancelled: so is the run
            end = follower.end
            assert end is not None
            if end.status != "paused":
                return _result(session, end.status, end.reply, end.error, end.reason)
            capabilities = ctx.client_capabilities
            if capabilities is None or capabilities.elicitation is None:
                return await _waiting(runs, session)
            _, pending = await runs.paused_on(session)
            if not ctx.session.can_send_request:  # 2026-07-28: ask in the result
                return InputRequiredResult(input_requests=_questions(pending),
                                           request_state=_ASKED)
            decided = await _elicit(runs, session, ctx, pending)
            if decided is None:
                return await _waiting(runs, session)
            follower = decided
    except ServeError as error:
        raise ToolError(str(error)) from None


async def _begin(runs: Runs, session: str, task: str) -> RunFollower:
    """The run this call follows: a new one of ``task``, the decisions a paused session
    waits for, or the session resumed (task ``continue``)."""
    word = task.strip().lower().rstrip(".!")
    paused, pending = await runs.paused_on(session)
    if paused is not None and pending:
        if word not in _APPROVE and word not in _DENY:
            raise ToolError(f"session {session!r} waits for approval of "
                            f"{_calls(pending)}: call again with task 'approve' or 'deny'")
        approve = word in _APPROVE
        decisions = [(str(call["call_id"]), approve, None if approve else "denied over MCP")
                     for call in pending]
        resumed = await decide_all(runs, session, decisions)
        assert resumed is not None  # every waiting call was decided
        return resumed
    if not word:
        raise ToolError("the task is empty: say what the agent should do")
    info = await runs.store.info(session)
    resumable = info is not None and info.status not in (None, "completed")
    text = None if word in ("continue", "resume") and resumable else task
    return RunFollower(runs, await runs.start(session, text), owned=True)


async def _report(follower: RunFollower, ctx: Context) -> None:
    """Follow the run to its end, its steps reported as progress (and "writing" once a
    step's reply has begun: a client that cancels after it knows the partial is kept)."""
    stream = _Progress(follower.view.run_id)
    done = 0
    async for event in follower.events():
        for message in stream.feed(event):
            done += 1
            await ctx.report_progress(done, None, message)


class _Progress(EventStream[str]):
    """A run's events as the messages of MCP progress notifications."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self._writing = False  # this step's reply has begun

    def text_delta(self, part: str, text: str) -> list[str]:
        if self._writing:
            return []
        self._writing = True
        return ["writing"]

    def tool_call_start(self, call: ToolCallStarted, parent: str | None) -> list[str]:
        return [f"calling {call.name}"]

    def tool_result(self, result: ToolResult) -> list[str]:
        return [f"{result.name} answered"]

    def step_finished(self, step: StepFinished) -> list[str]:
        self._writing = False
        return [f"step {step.step} done"]


#: The ``request_state`` of an ``input_required`` result that asked about approvals.
_ASKED: Final = "aimu-approvals"
_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "approve": {"type": "boolean", "description": "Run this tool call?"},
        "reason": {"type": "string", "description": "Why (told to the model if denied)"},
    },
    "required": ["approve"],
}


def _questions(pending: Sequence[Mapping[str, Any]]) -> dict[str, types.InputRequest]:
    """One elicitation per waiting call, keyed by the call's id."""
    return {
        shown_id(call): types.ElicitRequest(params=types.ElicitRequestFormParams(
            message=f"Allow {_calls([call])}?", requested_schema=_SCHEMA))
        for call in pending
    }


async def _answered(
    runs: Runs, session: str, responses: Mapping[str, types.InputResponse]
) -> RunFollower:
    """The run resumed with the answers to :func:`_questions`: every call decided."""
    decisions: list[tuple[str, bool, str | None]] = []
    for call_id, answer in responses.items():
        if not isinstance(answer, types.ElicitResult):
            raise ToolError(f"input {call_id!r} is not an answer to an elicitation")
        content = answer.content or {}
        approve = answer.action == "accept" and content.get("approve") is True
        reason = content.get("reason") if approve is False else None
        decisions.append((call_id, approve, str(reason) if reason else
                          (None if approve else "declined over MCP")))
    resumed = await decide_all(runs, session, decisions)
    if resumed is None:
        raise ToolError("every waiting tool call needs an answer")
    resumed.owned = True
    return resumed


async def _elicit(
    runs: Runs, session: str, ctx: Context, pending: Sequence[Mapping[str, Any]]
) -> RunFollower | None:
    """Ask the client's person about each waiting call, mid-call; the resumed run, or None
    when the person did not answer."""
    decisions: list[tuple[str, bool, str | None]] = []
    for call in pending:
        asked = await ctx.elicit(f"Allow {_calls([call])}?", Approval)
        if asked.action != "accept":
            return None
        decisions.append((shown_id(call), asked.data.approve, asked.data.reason or None))
    resumed = await decide_all(runs, session, decisions)
    if resumed is not None:
        resumed.owned = True
    return resumed


async def _waiting(runs: Runs, session: str) -> str:
    _, pending = await runs.paused_on(session)
    return (f"[paused] Session {session!r}: {_calls(pending)} waits for approval. Call "
            f"{TOOL_NAME} again with session {session!r} and task 'approve' or 'deny'.")


def _calls(pending: Sequence[Mapping[str, Any]]) -> str:
    return ", ".join(f"{call['name']}({json.dumps(call['arguments'])})" for call in pending)


def _result(
    session: str, status: str, reply: str | None, error: str | None, reason: str | None
) -> str:
    if status == "completed":
        return reply or ""
    if status == "failed":
        raise ToolError(f"the agent failed: {error or 'no reason given'}")
    if status == "blocked":
        raise ToolError(f"a guardrail blocked the run: {reason or reply or 'no reason given'}")
    said = f" What it had said: {reply}" if reply else ""
    why = f" ({reason})" if reason else ""
    raise ToolError(f"the run ended {status}{why}; session {session!r} keeps it and a call "
                    f"with task 'continue' goes on.{said}")
