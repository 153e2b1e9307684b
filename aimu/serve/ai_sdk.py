"""The AI SDK's UI message stream (v1) over ``aimu serve``: what ``useChat`` speaks.

- ``POST /api/chat`` (``useChat``'s default path) takes ``{id, messages, trigger}``: the chat
  id is an aimu session, and the session in the store is the conversation, so of
  ``messages`` only the last one is read: a user message is a run of its text (with the
  page's own tools, aimu's ``tools`` field, offered as external tools); an assistant
  message whose tool parts carry approval responses, or the outputs of the page's tool
  calls (``addToolResult``), decides the paused run's calls and resumes it. The answer is
  the UI message stream (``x-vercel-ai-ui-message-stream: v1``): ``start``,
  ``start-step``, ``text-*``, ``reasoning-*``, ``tool-input-start``,
  ``tool-input-available``, ``tool-output-available``, ``tool-approval-request``,
  ``tool-output-denied`` (a call the page's approval response denied: the part's state
  ``output-denied``), ``finish-step``, then ``finish``, ``abort`` or ``error``, and
  ``[DONE]``. The stream that resumes a paused run continues the page's message (its
  ``start`` names it): the calls the page was shown are not started again, only their
  outputs follow.
- ``GET /api/chat/{id}/stream`` (the resumable-stream convention): the chat's run in
  progress from its start (204 when none), for a page that was refreshed. A GET only
  reads: a run that died with its server is not resumed by it (``--recover`` resumes it,
  or ``POST /api/chat/{id}/stream``, which does what the GET does and resumes such a run
  first, under the cross-site guard every POST passes).
- ``POST /api/chat/{id}/stop``: cancels the chat's run in progress, server-side.

Leaving the POST stream (the client's ``stop()`` aborts its fetch) cancels the run, as the
stop route does, unless the request said ``"resumable": true``: then it only detaches, as
the AI SDK documents for resumable streams, and the run goes on for a reconnect. Leaving a
reconnected stream only detaches.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Mapping
from typing import Annotated, Any, Final, Literal

from fastapi import APIRouter, Body, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from aimu.aio.events import ToolCallStarted, ToolResult, TurnRetried
from aimu.serve.errors import BadRequest, Conflict, ServeError
from aimu.serve.http import JSON
from aimu.serve.models import EmptyBody, Run
from aimu.serve.protocols import EventStream, text_parts
from aimu.serve.routes import READ, WRITE, errors, streamed
from aimu.serve.runs import Runs, validate_name
from aimu.serve.stream_runs import (
    ClosingStreamingResponse,
    RunEnd,
    RunFollower,
    client_tools,
    decide_all,
    live_or_revived,
    not_waiting,
    shown_id,
    sse_response,
)

__all__ = ["ChatRequest", "router"]

#: The header that says which UI message stream protocol a response speaks.
STREAM_HEADER: Final = {"x-vercel-ai-ui-message-stream": "v1"}
_DONE: Final = b"data: [DONE]\n\n"
#: aimu's stop reasons as the AI SDK's finish reasons.
_FINISH: Final = {"stop": "stop", "length": "length", "tool_calls": "tool-calls"}


class UIMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: Annotated[str, Field(max_length=200)] = ""
    role: Literal["system", "user", "assistant"]
    parts: list[dict[str, Any]] = Field(default_factory=list)


class ChatRequest(BaseModel):
    """The body ``useChat``'s transport posts (unknown fields allowed: apps add their own)."""

    model_config = ConfigDict(extra="allow")

    id: Annotated[str, Field(min_length=1, max_length=128)]
    messages: Annotated[list[UIMessage], Field(min_length=1)]
    trigger: Literal["submit-message", "regenerate-message"] = "submit-message"
    resumable: bool = False
    """Leaving the stream only detaches; the run goes on for ``GET /api/chat/{id}/stream``."""
    tools: list[ClientTool] | None = None
    """aimu's: the page's own tools (run by ``onToolCall``, answered by ``addToolResult``),
    offered to the model from this message's run on (absent: the chat's stay as they were)."""


class ClientTool(BaseModel):
    name: str
    description: str = ""
    parameters: Any = None


ChatId = Annotated[str, Path(json_schema_extra={"pattern": "^[A-Za-z0-9._-]{1,128}$"})]

router = APIRouter()


@router.post(
    "/api/chat",
    summary="Chat in the AI SDK's UI message stream (v1): a user message last runs it; "
    "approval responses decide the paused run",
    response_class=ClosingStreamingResponse,
    responses={
        **streamed("A UI message stream"),
        **errors(*WRITE),
    },
)
async def chat(request: Request, body: ChatRequest) -> Response:
    runs: Runs = request.app.runs
    session = validate_name(body.id)
    if body.trigger == "regenerate-message":
        raise BadRequest("regenerate is not supported: the session keeps every answer; send "
                         "a new message instead")
    last = body.messages[-1]
    tools = None if body.tools is None else client_tools(
        [(tool.name, tool.description, tool.parameters) for tool in body.tools]
    )
    if last.role == "user":
        text = _user_text(last)
        prepare = None if tools is None else (lambda agent: agent.set_external_tools(tools))
        follower = RunFollower(runs, await runs.start(session, text, prepare),
                               owned=not body.resumable)
    elif last.role == "assistant":
        return await _answer(runs, session, last, body.resumable)
    else:
        raise BadRequest("the last message must be the user's, or approval responses")
    return _response(runs, follower)


async def _answer(runs: Runs, session: str, last: UIMessage, resumable: bool) -> Response:
    """Decide the paused run's calls by ``last``'s approval responses and tool outputs;
    the resumed run's stream, which continues ``last`` (the page has its calls)."""
    decisions = _approval_responses(last)
    results = await _tool_outputs(runs, session, last)
    if not decisions and not results:
        raise BadRequest(f"message {last.id!r} answers no approval request and no "
                         "client-side tool call: end the messages with a user message, "
                         "approval responses or tool outputs")
    _, pending = await runs.paused_on(session)
    decisions += [(call_id, True, None) for call_id in results]
    resumed = await decide_all(runs, session, decisions, results)
    if resumed is None:
        raise Conflict("other tool calls still wait for a decision: answer them together")
    resumed.owned = not resumable
    denied = frozenset(given.rpartition("@")[0] if "@" in given else given
                       for given, approved, _ in decisions if not approved)
    shown = frozenset(str(call["call_id"]) for call in pending)
    return _response(runs, resumed, shown, denied, last.id or None)


@router.get(
    "/api/chat/{id}/stream",
    summary="Reattach to the chat's run in progress, from its start (204: none)",
    response_class=ClosingStreamingResponse,
    responses={
        **streamed("A UI message stream"),
        204: {"description": "The chat has no run in progress"},
        **errors(*READ),
    },
)
async def reconnect(request: Request, id: ChatId) -> Response:
    runs: Runs = request.app.runs
    active = await runs.session_run(validate_name(id))  # a GET changes nothing
    if active is None:
        return Response(status_code=204)
    return _response(runs, RunFollower(runs, active, owned=False))


@router.post(
    "/api/chat/{id}/stream",
    summary="Reattach to the chat's run in progress, from its start; a run that died with "
    "its server is resumed first (204: none)",
    response_class=ClosingStreamingResponse,
    responses={
        **streamed("A UI message stream"),
        204: {"description": "The chat has no run in progress, nor one to resume"},
        **errors(*WRITE),
    },
)
async def revive(
    request: Request, id: ChatId, body: Annotated[EmptyBody | None, Body()] = None
) -> Response:
    runs: Runs = request.app.runs
    active = await live_or_revived(runs, validate_name(id))
    if active is None:
        return Response(status_code=204)
    return _response(runs, RunFollower(runs, active, owned=False))


@router.post(
    "/api/chat/{id}/stop", status_code=202, response_model=Run,
    summary="Cancel the chat's run in progress, server-side (its partial reply is kept; "
    "409: none in progress)",
    responses={202: {"model": Run, "description": "The run as the stop found it"},
               **errors(*WRITE)},
)
async def stop(request: Request, id: ChatId) -> Response:
    runs: Runs = request.app.runs
    session = validate_name(id)
    active = await runs.session_run(session)
    if active is None:
        raise Conflict(f"chat {session!r} has no run in progress")
    return JSON(await runs.cancel(active.run_id, "stopped by the chat"), status_code=202)


def _response(
    runs: Runs, follower: RunFollower, shown: frozenset[str] = frozenset(),
    denied: frozenset[str] = frozenset(), message_id: str | None = None,
) -> Response:
    """The run's UI message stream: a new message, or the one ``message_id`` names (the
    page's, which a resumed run continues)."""
    stream = AiSdkStream(follower.view.run_id, shown, denied)
    message_id = message_id or f"{follower.view.run_id}-reply"
    return sse_response(_chunks(runs, follower, stream, message_id),
                        headers=STREAM_HEADER, last=_DONE)


def _user_text(message: UIMessage) -> str:
    texts = text_parts(message.parts)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise BadRequest(f"message {message.id!r}: only text parts are supported")
    text = "\n".join(str(text) for text in texts)
    if not text.strip():
        raise BadRequest(f"message {message.id!r} is empty: say what the run should do")
    return text


def _approval_responses(message: UIMessage) -> list[tuple[str, bool, str | None]]:
    """The ``(call_id, approved, reason)`` of the message's tool parts that were answered."""
    decisions = []
    for part in message.parts:
        approval = part.get("approval")
        if part.get("state") != "approval-responded" or not isinstance(approval, Mapping):
            continue
        approved, reason = approval.get("approved"), approval.get("reason")
        if not isinstance(approved, bool) or not (reason is None or isinstance(reason, str)):
            raise BadRequest(f"tool part {part.get('toolCallId')!r}: 'approval' needs a "
                             "boolean 'approved' and an optional string 'reason'")
        decisions.append((str(approval.get("id") or part.get("toolCallId")), approved, reason))
    return decisions


async def _tool_outputs(runs: Runs, session: str, message: UIMessage) -> dict[str, str]:
    """The outputs the message's tool parts carry for the client-side calls the chat's
    paused run waits on (``addToolResult``), by call id. The message repeats the calls
    answered before: the server's own are skipped, the page's too unless nothing waits
    at all (``Conflict``: the outputs were sent already); an output for a call the chat
    never had is a ``BadRequest``."""
    outputs = {
        part["toolCallId"]: part.get("output") for part in message.parts
        if part.get("state") == "output-available" and isinstance(part.get("toolCallId"), str)
    }
    if not outputs:
        return {}
    _, pending = await runs.paused_on(session)
    waiting = {str(call["call_id"]) for call in pending if call.get("external")}
    results: dict[str, str] = {}
    repeated: ServeError | None = None
    for call_id, output in outputs.items():
        if call_id in waiting:
            results[call_id] = output if isinstance(output, str) else json.dumps(output)
            continue
        error = await not_waiting(runs, session, call_id)  # None: the server's own call
        if isinstance(error, BadRequest):
            raise error
        repeated = repeated or error
    if not results and repeated is not None:
        raise repeated  # the page's outputs had their results already: sent twice
    return results


async def _chunks(
    runs: Runs, follower: RunFollower, stream: AiSdkStream, message_id: str
) -> AsyncGenerator[dict[str, Any], None]:
    """The run's UI message chunks; leaving early stops the run if the follower owns it."""
    try:
        yield {"type": "start", "messageId": message_id}
        async for event in follower.events():
            for chunk in stream.feed(event):
                yield chunk
        for chunk in stream.close():
            yield chunk
        for chunk in await _ending(runs, follower.view.session, follower.end, stream):
            yield chunk
    finally:
        await follower.aclose()


async def _ending(
    runs: Runs, session: str, end: RunEnd | None, stream: AiSdkStream
) -> list[dict[str, Any]]:
    if end is None or end.status == "failed":
        error = "the run failed" if end is None or not end.error else end.error
        return [{"type": "error", "errorText": error}]
    metadata = {"aimuStatus": end.status, "aimuRunId": end.run_id, "usage": end.usage}
    if end.status == "completed":
        reason = _FINISH.get(stream.stop_reason or "stop", "other")
        return [{"type": "finish", "finishReason": reason, "messageMetadata": metadata}]
    if end.status == "blocked":  # a guardrail refused the input or the answer
        metadata["aimuReason"] = end.reply or end.reason
        return [*stream.close(), {"type": "finish", "finishReason": "content-filter",
                                      "messageMetadata": metadata}]
    if end.status == "paused":
        _, pending = await runs.paused_on(session)
        chunks = []
        for call in pending:
            call_id = str(call["call_id"])
            if call_id not in stream.calls:  # asked before it was announced
                chunks += stream.on(ToolCallStarted(session, call_id, call["name"],
                                                    call["arguments"]))
            if not call.get("external"):  # a client-side call: the page runs it
                chunks.append({"type": "tool-approval-request",
                               "approvalId": shown_id(call), "toolCallId": call_id})
        return [*chunks, *stream.close(),
                {"type": "finish", "finishReason": "tool-calls", "messageMetadata": metadata}]
    return [{"type": "abort", "reason": end.reason or end.status}]


class AiSdkStream(EventStream[dict[str, Any]]):
    """aimu's run events as UI message chunks (the nesting is the base's). The calls in
    ``shown`` (the page has their parts) are not started again; a result of one in
    ``denied`` (the page's approval response denied it) is ``tool-output-denied``."""

    def __init__(self, run_id: str, shown: frozenset[str] = frozenset(),
                 denied: frozenset[str] = frozenset()) -> None:
        super().__init__(run_id, shown)
        self._denied = denied

    def step_start(self) -> list[dict[str, Any]]:
        return [{"type": "start-step"}]

    def step_end(self) -> list[dict[str, Any]]:
        return [{"type": "finish-step"}]

    def text_start(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "text-start", "id": part}]

    def text_delta(self, part: str, text: str) -> list[dict[str, Any]]:
        return [{"type": "text-delta", "id": part, "delta": text}]

    def text_end(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "text-end", "id": part}]

    def reasoning_start(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "reasoning-start", "id": part}]

    def reasoning_delta(self, part: str, text: str) -> list[dict[str, Any]]:
        return [{"type": "reasoning-delta", "id": part, "delta": text}]

    def reasoning_end(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "reasoning-end", "id": part}]

    def tool_call_start(
        self, call: ToolCallStarted, parent: str | None
    ) -> list[dict[str, Any]]:
        return [{"type": "tool-input-start", "toolCallId": call.call_id,
                 "toolName": call.name, "dynamic": True}]

    def tool_call_args(self, call: ToolCallStarted) -> list[dict[str, Any]]:
        return [{"type": "tool-input-available", "toolCallId": call.call_id,
                 "toolName": call.name, "dynamic": True, "input": call.arguments}]

    def tool_result(self, result: ToolResult) -> list[dict[str, Any]]:
        if result.call_id in self._denied:
            return [{"type": "tool-output-denied", "toolCallId": result.call_id}]
        if result.is_error:
            return [{"type": "tool-output-error", "toolCallId": result.call_id,
                     "errorText": result.content, "dynamic": True}]
        return [{"type": "tool-output-available", "toolCallId": result.call_id,
                 "output": result.content, "dynamic": True}]

    def turn_retried(self, retried: TurnRetried, part: str | None) -> list[dict[str, Any]]:
        """A ``data-aimu-turn-retried`` part naming the text part the broken reply
        concerns; a restarted reply's parts end after it (its new text is a new part; a
        client drops the one named)."""
        return [{"type": "data-aimu-turn-retried", "data": {
            "mode": retried.mode, "kept": retried.kept, "error": retried.error,
            "attempt": retried.attempt, "textId": part,
        }}]
