"""AG-UI over ``aimu serve``: ``POST /ag-ui`` takes a ``RunAgentInput`` and streams AG-UI events.

The thread is an aimu session (its id a session name) and the session in the store is the
conversation: of the client's ``messages`` only the new user message at the end is taken
(the server holds the rest, as it wrote it). A request is one of three things:

- a new user message last: a run of it (409 if the thread has a run in progress), the
  input's ``tools`` offered to the model as external tools (a call of one ends the run
  with the ``success`` outcome's ``pendingToolCallIds``: the page runs it) and its
  ``state`` the thread's shared state (``STATE_SNAPSHOT`` before the run's end);
- ``tool`` messages last, or ``resume`` entries: the results of the page's tool calls,
  and the decisions on the approvals (the ``interrupt`` outcome named them), that the
  thread's paused run waits on; the last one resumes the run;
- neither (a page that came back): a ``MESSAGES_SNAPSHOT`` of the session, then the run in
  progress from its start, if there is one (a run that died with its server is resumed).

The response is a Server-Sent Events stream of AG-UI events. Leaving it is a stop: a
client that aborts (closes the stream) cancels the run it was following, and the run ends
``cancelled`` with its partial reply kept in the session, as aimu's own cancel route
does. A run stopped by that route ends the stream with the ``cancelled`` outcome too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from aimu.aio._session import SHARED
from aimu.aio.agent import Agent
from aimu.aio.events import ToolCallStarted, ToolProgress, ToolResult, TurnRetried
from aimu.aio.tools import Tool
from aimu.aio.transcript import Message
from aimu.serve.errors import BadRequest
from aimu.serve.protocols import EventStream, text_parts
from aimu.serve.routes import WRITE, errors, streamed
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

__all__ = ["RunAgentInput", "router", "to_ag_ui_messages"]

_log = logging.getLogger("aimu.serve")

PROTOCOL_VERSION: Final = "1.0"
#: The ``reason`` of the interrupts a paused run reports (a tool call waits for a person).
APPROVAL_REASON: Final = "tool_approval"
#: What a resume entry's ``payload`` may say (a bare true/false means the same).
DECISION_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "properties": {
        "approved": {"type": "boolean"},
        "reason": {"type": "string", "description": "Why (told to the model on a denial)"},
    },
    "required": ["approved"],
}


class _Model(BaseModel):
    """AG-UI's JSON: camelCase on the wire, unknown fields kept (the protocol adds them)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow")


class InputMessage(_Model):
    id: Annotated[str, Field(max_length=200)]
    role: Literal["developer", "system", "assistant", "user", "tool", "activity", "reasoning"]
    content: Any = None
    tool_call_id: str | None = None


class ResumeEntry(_Model):
    interrupt_id: Annotated[str, Field(min_length=1, max_length=200)]
    status: Literal["resolved", "cancelled"]
    payload: Any = None


class InputTool(_Model):
    name: str
    description: str = ""
    parameters: Any = None


class RunAgentInput(_Model):
    """The body of ``POST /ag-ui`` (AG-UI 1.0's ``RunAgentInput``)."""

    thread_id: Annotated[str, Field(min_length=1, max_length=128)]
    run_id: Annotated[str, Field(min_length=1, max_length=200)]
    messages: list[InputMessage]
    tools: list[InputTool] | None = None
    resume: list[ResumeEntry] | None = None
    parent_run_id: str | None = None
    protocol_version: str | None = None
    state: Any = None
    context: Any = None
    forwarded_props: Any = None


router = APIRouter()


@router.post(
    "/ag-ui",
    summary="Run the agent on a thread, speaking AG-UI (RunAgentInput in, AG-UI events out)",
    description="The thread is a session. A new user message last: a run of it; resume "
    "entries: the decisions on the paused run's approvals; neither: a MESSAGES_SNAPSHOT and "
    "the run in progress. Closing the stream cancels the run (its partial reply is kept).",
    response_class=ClosingStreamingResponse,
    responses={**streamed("AG-UI events"), **errors(*WRITE)},
)
async def ag_ui(request: Request, body: RunAgentInput) -> Response:
    runs: Runs = request.app.runs
    session = validate_name(body.thread_id)
    tools = client_tools(
        [(tool.name, tool.description, tool.parameters) for tool in body.tools or []]
    )
    if body.state is not None and not isinstance(body.state, dict):
        raise BadRequest("'state' must be a JSON object (or absent)")
    begun = await _begin(runs, session, body, tools)
    return sse_response(_events(runs, session, body, begun))


@dataclass(frozen=True)
class _Begun:
    """What a request started, before its stream."""

    follower: RunFollower | None
    """The run to follow, if any."""
    came_back: bool = False
    """The client asked for nothing new (a page that came back)."""
    answered: frozenset[str] = frozenset()
    """The client-side calls whose results it brought: neither call nor result is
    streamed back to it."""
    shown: frozenset[str] = frozenset()
    """The calls the paused run waited on: the client was shown them (with the outcome
    that paused it), so the resumed run does not start them again."""


async def _begin(
    runs: Runs, session: str, body: RunAgentInput, tools: list[Tool]
) -> _Begun:
    """Start what ``body`` asks for on ``session`` before the stream starts, so that a bad
    request is an HTTP error with nothing changed."""
    results = await _client_results(runs, session, body.messages)
    if body.resume or results:
        _, pending = await runs.paused_on(session)
        follower = await _decide(runs, session, body.resume or [], results)
        return _Begun(follower, answered=frozenset(results),
                      shown=frozenset(str(call["call_id"]) for call in pending))
    task = _new_user_text(body.messages)
    if task is not None:

        def prepare(agent: Agent) -> None:
            agent.set_external_tools(tools)
            if body.state is not None:
                agent.set_shared_state(body.state)

        view = await runs.start(session, task, prepare)
        return _Begun(RunFollower(runs, view, owned=True))
    active = await live_or_revived(runs, session)
    return _Begun(None if active is None else RunFollower(runs, active, owned=True), True)


async def _client_results(
    runs: Runs, session: str, messages: list[InputMessage]
) -> dict[str, str]:
    """The results of client-side tool calls the input ends with (its ``tool`` messages
    after the last other one), by call id; each must answer a call the thread's paused run
    waits on (``Conflict`` for one answered already, ``BadRequest`` for an unknown one),
    or be a result of the server's own tools the page was streamed (skipped)."""
    trailing: list[InputMessage] = []
    for message in reversed(messages):
        if message.role != "tool":
            break
        trailing.insert(0, message)
    if not trailing:
        return {}
    _, pending = await runs.paused_on(session)
    waiting = {str(call["call_id"]) for call in pending if call.get("external")}
    results: dict[str, str] = {}
    for message in trailing:
        call_id = message.tool_call_id
        if not call_id:
            raise BadRequest(f"tool message {message.id!r}: it names no toolCallId")
        if call_id in results:
            raise BadRequest(f"tool call {call_id!r:.80} is answered twice")
        if call_id not in waiting:
            error = await not_waiting(runs, session, call_id)
            if error is None:
                continue  # the server's own call: the page repeats what it was streamed
            raise error
        results[call_id] = _text_of(message.content, message.id)
    return results


def _new_user_text(messages: list[InputMessage]) -> str | None:
    """The text of the user message the input ends with, or None if it ends otherwise."""
    if not messages or messages[-1].role != "user":
        return None
    text = _text_of(messages[-1].content, messages[-1].id)
    if not text.strip():
        raise BadRequest(f"message {messages[-1].id!r} is empty: say what the run should do")
    return text


def _text_of(content: object, message_id: str) -> str:
    """A user message's text: its string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = text_parts(content)
        if len(texts) == len(content) and all(isinstance(text, str) for text in texts):
            return "\n".join(str(text) for text in texts)
    raise BadRequest(
        f"message {message_id!r}: only text content is supported (a string, or text parts)"
    )


async def _decide(
    runs: Runs, session: str, entries: list[ResumeEntry], results: dict[str, str]
) -> RunFollower | None:
    """Apply the decisions of ``entries``, and the client-side tools' ``results``, to the
    session's paused run, all checked first."""
    decisions = [(entry.interrupt_id, *_decision(entry)) for entry in entries]
    decisions += [(call_id, True, None) for call_id in results]
    return await decide_all(runs, session, decisions, results)


def _decision(entry: ResumeEntry) -> tuple[bool, str | None]:
    if entry.status == "cancelled":
        return False, "the user dismissed it"
    payload = entry.payload
    if isinstance(payload, bool):
        return payload, None
    if isinstance(payload, Mapping) and isinstance(payload.get("approved"), bool):
        reason = payload.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise BadRequest(f"interrupt {entry.interrupt_id!r}: 'reason' must be a string")
        return bool(payload["approved"]), reason
    raise BadRequest(
        f"interrupt {entry.interrupt_id!r}: the payload must be true, false or "
        '{"approved": true|false, "reason": "..."}'
    )


async def _events(
    runs: Runs, session: str, body: RunAgentInput, begun: _Begun
) -> AsyncGenerator[dict[str, Any], None]:
    """The AG-UI events of this request; leaving early cancels the run being followed."""
    thread, run_id, follower = body.thread_id, body.run_id, begun.follower
    yield {
        "type": "RUN_STARTED", "threadId": thread, "runId": run_id,
        "protocolVersion": PROTOCOL_VERSION,
        **({"parentRunId": body.parent_run_id} if body.parent_run_id else {}),
    }
    seen = set(begun.shown)  # the calls the client has: from before, the snapshot, or now
    try:
        if begun.came_back:
            before = None if follower is None else follower.view.messages_from
            snapshot = to_ag_ui_messages((await runs.store.load(session))[:before], session)
            seen.update(call["id"] for m in snapshot for call in m.get("toolCalls", ()))
            yield {"type": "MESSAGES_SNAPSHOT", "messages": snapshot}
        end: RunEnd | None
        parent: str | None = None
        if follower is None:
            end = await _latest_end(runs, session)
        else:
            # A call the snapshot holds is not started again (a run that resumed after its
            # server died asks an idempotent call in doubt again, under the same id).
            stream = AgUiStream(run_id, begun.answered, frozenset(seen))
            async for event in follower.events():
                for out in stream.feed(event):
                    yield out
            end = follower.end
            parent = stream.step_text
            seen |= stream.calls
            for out in stream.close():
                yield out
        finished, waiting = await _finished(runs, session, thread, run_id, end)
        for call in waiting:  # each call the outcome names, started before it names it
            if str(call["call_id"]) not in seen:
                for out in _call_events(str(call["call_id"]), call["name"],
                                        call["arguments"], parent):
                    yield out
        shared = (await runs.store.load_state(session)).get(SHARED)
        if isinstance(shared, dict):
            yield {"type": "STATE_SNAPSHOT", "snapshot": shared}
        yield finished
    finally:
        if follower is not None:
            with anyio.CancelScope(shield=True):
                await follower.aclose()


async def _latest_end(runs: Runs, session: str) -> RunEnd:
    """How the thread's last run ended (for a request that ran nothing)."""
    paused, _ = await runs.paused_on(session)
    return RunEnd("paused" if paused is not None else "completed", None, None, None, None)


async def _finished(
    runs: Runs, session: str, thread: str, run_id: str, end: RunEnd | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The terminal event (RUN_FINISHED with its outcome, or RUN_ERROR), and the calls
    the run paused on: the calls of client-side tools (for the page to run) and those
    waiting for approval (the interrupts name them), each to be streamed before it."""
    if end is None or end.status == "failed":
        message = "the run failed" if end is None or not end.error else end.error
        return {"type": "RUN_ERROR", "message": message, "code": "failed"}, []
    event: dict[str, Any] = {"type": "RUN_FINISHED", "threadId": thread, "runId": run_id}
    client: list[dict[str, Any]] = []
    if end.status == "completed":
        event["outcome"] = {"type": "success"}
        if end.reply is not None:
            event["result"] = end.reply
    elif end.status == "paused":
        _, pending = await runs.paused_on(session)
        approvals = [call for call in pending if not call.get("external")]
        client = [call for call in pending if call.get("external")]
        if approvals:
            event["outcome"] = {"type": "interrupt", "interrupts": _interrupts(approvals)}
            client = [*approvals, *client]
        elif client:  # the page's own tools: a completed run leaving calls to answer
            event["outcome"] = {
                "type": "success",
                "pendingToolCallIds": [str(call["call_id"]) for call in client],
            }
        else:  # decided meanwhile (another client): nothing waits
            event["outcome"] = {"type": "success"}
    else:  # cancelled, interrupted, timed out, limited, blocked (metadata says by what),
        # out of rounds: stopped, not failed
        event["outcome"] = {"type": "cancelled"}
    if end.usage is not None:
        event["usage"] = [{
            "inputTokens": end.usage["input_tokens"],
            "outputTokens": end.usage["output_tokens"],
            "totalTokens": end.usage["input_tokens"] + end.usage["output_tokens"],
        }]
    # A blocked run's why is its reply (the guardrail and its reason), as the AI SDK's is.
    reason = end.reply or end.reason if end.status == "blocked" else end.reason
    event["metadata"] = {"aimuStatus": end.status, "aimuRunId": end.run_id, "reason": reason}
    return event, client


def _interrupts(pending: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": shown_id(call),
            "reason": APPROVAL_REASON,
            "message": f"Allow {call['name']}({json.dumps(call['arguments'])})?"
            + (" It was running when the server stopped: allowing runs it again."
               if call.get("in_doubt") else ""),
            "toolCallId": str(call["call_id"]),
            "responseSchema": DECISION_SCHEMA,
            "metadata": {"tool": call["name"], "arguments": call["arguments"]},
        }
        for call in pending
    ]


def _call_events(
    call_id: str, name: str, arguments: object, parent: str | None
) -> list[dict[str, Any]]:
    """A tool call's events: streamed as the run made it, or, for a call the run paused
    on (a client-side tool's, for the page to run, or one waiting for approval, which
    the ``interrupt`` outcome then names), before the outcome."""
    start = {"type": "TOOL_CALL_START", "toolCallId": call_id, "toolCallName": name}
    return [
        {**start, "parentMessageId": parent} if parent else start,
        {"type": "TOOL_CALL_ARGS", "toolCallId": call_id,
         "delta": json.dumps(arguments, ensure_ascii=False)},
        {"type": "TOOL_CALL_END", "toolCallId": call_id},
    ]


class AgUiStream(EventStream[dict[str, Any]]):
    """aimu's run events as AG-UI events (the nesting is the base's). The calls in
    ``answered`` (the client-side calls whose results the client sent) are not streamed
    back to it; those in ``shown`` (it was shown them when the run paused) are not
    started again, their results are streamed."""

    def __init__(self, run_id: str, answered: frozenset[str] = frozenset(),
                 shown: frozenset[str] = frozenset()) -> None:
        super().__init__(run_id, shown)
        self.hidden_calls = answered | shown
        self.hidden_results = answered
        self._step_name = ""

    def step_start(self) -> list[dict[str, Any]]:
        self._step_name = f"step {self.next_id()}"
        return [{"type": "STEP_STARTED", "stepName": self._step_name}]

    def step_end(self) -> list[dict[str, Any]]:
        return [{"type": "STEP_FINISHED", "stepName": self._step_name}]

    def text_start(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "TEXT_MESSAGE_START", "messageId": part, "role": "assistant"}]

    def text_delta(self, part: str, text: str) -> list[dict[str, Any]]:
        return [{"type": "TEXT_MESSAGE_CONTENT", "messageId": part, "delta": text}]

    def text_end(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "TEXT_MESSAGE_END", "messageId": part}]

    def reasoning_start(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "REASONING_START", "messageId": part},
                {"type": "REASONING_MESSAGE_START", "messageId": part, "role": "reasoning"}]

    def reasoning_delta(self, part: str, text: str) -> list[dict[str, Any]]:
        return [{"type": "REASONING_MESSAGE_CONTENT", "messageId": part, "delta": text}]

    def reasoning_end(self, part: str) -> list[dict[str, Any]]:
        return [{"type": "REASONING_MESSAGE_END", "messageId": part},
                {"type": "REASONING_END", "messageId": part}]

    def tool_call_start(
        self, call: ToolCallStarted, parent: str | None
    ) -> list[dict[str, Any]]:
        return _call_events(call.call_id, call.name, call.arguments, parent)

    def tool_result(self, result: ToolResult) -> list[dict[str, Any]]:
        return [{"type": "TOOL_CALL_RESULT", "messageId": self.next_id(),
                 "toolCallId": result.call_id, "content": result.content, "role": "tool"}]

    def tool_progress(self, progress: ToolProgress) -> list[dict[str, Any]]:
        return [{"type": "CUSTOM", "name": "aimu.tool_progress", "value": {
            "call_id": progress.call_id, "name": progress.name, "progress": progress.progress,
            "total": progress.total, "message": progress.message,
        }}]

    def turn_retried(self, retried: TurnRetried, part: str | None) -> list[dict[str, Any]]:
        """A CUSTOM event naming the text message the broken reply concerns; a restarted
        reply's messages end after it (the new text is a new message; a client drops the
        one named, as the event's ``mode`` says)."""
        return [{"type": "CUSTOM", "name": "aimu.turn_retried", "value": {
            "mode": retried.mode, "kept": retried.kept, "error": retried.error,
            "attempt": retried.attempt, "messageId": part,
        }}]


def to_ag_ui_messages(messages: Iterable[Message], session: str) -> list[dict[str, Any]]:
    """A session's transcript as AG-UI messages (ids from their places in the session; a
    reply cut by a stop is marked ``metadata.aimuPartial``)."""
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        base = {"id": f"{session}-{index}", "role": message["role"]}
        if message["role"] == "tool":
            out.append({**base, "content": message["content"],
                        "toolCallId": message["tool_call_id"]})
        elif message["role"] == "assistant":
            item: dict[str, Any] = {**base, "content": message["content"]}
            calls = message.get("tool_calls") or []
            if calls:
                item["toolCalls"] = [
                    {"id": call["id"], "type": "function", "function": {
                        "name": call["function"]["name"],
                        "arguments": json.dumps(call["function"]["arguments"],
                                                ensure_ascii=False),
                    }}
                    for call in calls
                ]
            if message.get("aimu_partial"):
                item["metadata"] = {"aimuPartial": True}
            out.append(item)
        else:
            out.append({**base, "content": message["content"]})
    return out
