"""A2A (the Agent2Agent protocol, 1.0, JSON-RPC binding) over ``aimu serve``.

- ``GET /.well-known/agent-card.json``: the agent card (streaming, no push notifications).
- ``POST /a2a``: JSON-RPC 2.0 with ``SendMessage``, ``SendStreamingMessage``, ``GetTask``,
  ``ListTasks``, ``CancelTask`` and ``SubscribeToTask``.

A context is an aimu session and a task is one user message of it and everything the
agent did for it: its id is ``SESSION:INDEX``, the message's place in the session's
transcript. A task's state is read from the store every time it is asked for (the
transcript, the session's last status, the run in progress), so tasks survive the server:
a restarted server answers for them, and a task whose run died with its server is
``input-required`` (send any message on it to resume the run).

========================  ====================================================
aimu                      A2A task state
========================  ====================================================
a run in progress         ``TASK_STATE_WORKING``
completed                 ``TASK_STATE_COMPLETED`` (the answer is the artifact)
cancelled                 ``TASK_STATE_CANCELED`` (the partial answer is the artifact)
paused for approvals      ``TASK_STATE_INPUT_REQUIRED``: the next message decides
interrupted, out of       ``TASK_STATE_INPUT_REQUIRED``: the next message resumes
budget, cut, died
failed                    ``TASK_STATE_FAILED``
blocked (a guardrail)     ``TASK_STATE_REJECTED``
========================  ====================================================

``CancelTask`` cancels the task's run at once (the model's stream closes) and answers the
task ``canceled``, its partial answer kept. A client that drops a stream only detaches:
``SubscribeToTask`` picks the task up again, from its run's start.
"""

from __future__ import annotations

import contextlib
import json
import math
import secrets
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from fastapi import APIRouter, Request
from fastapi.responses import Response

from aimu import __version__
from aimu.aio._ids import is_event_number
from aimu.aio.events import StepFinished, ToolCallStarted, ToolResult
from aimu.aio.transcript import Message
from aimu.serve.errors import ServeError
from aimu.serve.http import JSON
from aimu.serve.protocols import EventStream
from aimu.serve.runs import Runs, RunView, validate_name
from aimu.serve.stream_runs import RunFollower, decide_all, sse_response

__all__ = ["AGENT_CARD_PATH", "router"]

AGENT_CARD_PATH: Final = "/.well-known/agent-card.json"
PROTOCOL_VERSION: Final = "1.0"

WORKING: Final = "TASK_STATE_WORKING"
COMPLETED: Final = "TASK_STATE_COMPLETED"
CANCELED: Final = "TASK_STATE_CANCELED"
INPUT_REQUIRED: Final = "TASK_STATE_INPUT_REQUIRED"
FAILED: Final = "TASK_STATE_FAILED"
REJECTED: Final = "TASK_STATE_REJECTED"
TERMINAL: Final = frozenset({COMPLETED, CANCELED, FAILED})
#: A session's last status as a task state (a run in progress is WORKING before this).
_STATES: Final[dict[str | None, str]] = {
    "completed": COMPLETED, "cancelled": CANCELED, "failed": FAILED, "blocked": REJECTED,
}
_APPROVE: Final = frozenset({"approve", "approved", "yes", "y", "allow", "ok"})
_DENY: Final = frozenset({"deny", "denied", "no", "n", "refuse"})

# JSON-RPC and A2A error codes.
PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
TASK_NOT_FOUND: Final = -32001
TASK_NOT_CANCELABLE: Final = -32002
PUSH_NOT_SUPPORTED: Final = -32003
UNSUPPORTED: Final = -32004


class RPCError(Exception):
    """Answered as a JSON-RPC error object."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


router = APIRouter()


@router.get(AGENT_CARD_PATH, summary="The A2A agent card", include_in_schema=False)
async def agent_card(request: Request) -> Response:
    base = str(request.base_url).rstrip("/")
    card: dict[str, Any] = {
        "name": "aimu",
        "description": "An aimu agent: runs that can be cancelled, interrupted and resumed "
        "without losing anything.",
        "version": __version__,
        "supportedInterfaces": [
            {"url": f"{base}/a2a", "protocolBinding": "JSONRPC",
             "protocolVersion": PROTOCOL_VERSION},
        ],
        "capabilities": {"streaming": True, "pushNotifications": False},
        "defaultInputModes": ["text/plain", "application/json"],
        "defaultOutputModes": ["text/plain"],
        "skills": [{
            "id": "chat", "name": "Chat", "tags": ["chat", "tools"],
            "description": "Answers a message, calling its tools; a tool that needs a "
            "person's approval makes the task input-required.",
        }],
    }
    if getattr(request.app, "needs_token", False):
        card["securitySchemes"] = {"bearer": {"httpAuthSecurityScheme": {"scheme": "Bearer"}}}
        card["securityRequirements"] = [{"schemes": {"bearer": {"list": []}}}]
    return JSON(card)


@router.post("/a2a", summary="A2A JSON-RPC", include_in_schema=False)
async def rpc(request: Request) -> Response:
    runs: Runs = request.app.runs
    call_id: object = None
    try:
        envelope = _envelope(await request.body())
        call_id = envelope.get("id")
        method, params = envelope.get("method"), envelope.get("params", {})
        if not isinstance(method, str) or not isinstance(params, dict):
            raise RPCError(INVALID_REQUEST, "'method' must be a string, 'params' an object")
        if method == "SendStreamingMessage":
            return sse_response(_streamed(runs, call_id, *await _send(runs, params)))
        if method == "SubscribeToTask":
            task = await _task(runs, _task_id(params))
            follower = await _live_follower(runs, task)
            if follower is None:
                raise RPCError(UNSUPPORTED, f"task {task.id!r} is {task.state}: nothing to "
                               "follow (GetTask answers for it)")
            return sse_response(_streamed(runs, call_id, task.id, follower))
        result = await _call(runs, method, params)
        return JSON({"jsonrpc": "2.0", "id": call_id, "result": result})
    except RPCError as error:
        return JSON({"jsonrpc": "2.0", "id": call_id,
                     "error": {"code": error.code, "message": str(error)}})
    except ServeError as error:  # a busy session, a store that cannot serve now
        return JSON({"jsonrpc": "2.0", "id": call_id,
                     "error": {"code": INVALID_PARAMS if error.status < 500 else -32603,
                               "message": str(error)}})


def _envelope(body: bytes) -> dict[str, Any]:
    """The request object in ``body``: strict JSON (no ``NaN``, no ``Infinity``), one
    JSON-RPC 2.0 request whose ``id`` is a string, a number or null, or an ``RPCError``."""
    try:
        envelope = json.loads(body, parse_constant=_not_json)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        raise RPCError(PARSE_ERROR, "the body is not JSON") from None
    if isinstance(envelope, list):
        raise RPCError(INVALID_REQUEST, "batches are not supported: send one request object "
                       "per POST")
    if not isinstance(envelope, dict) or envelope.get("jsonrpc") != "2.0":
        raise RPCError(INVALID_REQUEST, "not a JSON-RPC 2.0 request object")
    call_id = envelope.get("id")
    if isinstance(call_id, bool) or not isinstance(call_id, str | int | float | None) or (
            isinstance(call_id, float) and not math.isfinite(call_id)):
        raise RPCError(INVALID_REQUEST, "'id' must be a string, a number or null")
    return envelope


def _not_json(constant: str) -> object:
    """``json.loads`` takes ``NaN``, ``Infinity`` and ``-Infinity``; JSON has none of them."""
    raise ValueError(f"{constant} is not JSON")


async def _call(runs: Runs, method: str, params: Mapping[str, Any]) -> dict[str, Any]:
    if method == "SendMessage":
        task_id, follower = await _send(runs, params)
        configuration = params.get("configuration") or {}
        if not (isinstance(configuration, Mapping) and configuration.get("returnImmediately")):
            async with contextlib.aclosing(follower.events()) as events:
                async for _ in events:
                    pass
        return {"task": (await _task(runs, task_id)).json()}
    if method == "GetTask":
        task = await _task(runs, _task_id(params))
        return task.json(_history_length(params))
    if method == "ListTasks":
        return await _list(runs, params)
    if method == "CancelTask":
        return await _cancel(runs, _task_id(params))
    if method.endswith("PushNotificationConfig") or method.endswith("PushNotificationConfigs"):
        raise RPCError(PUSH_NOT_SUPPORTED, "push notifications are not supported: stream "
                       "(SendStreamingMessage, SubscribeToTask) or poll GetTask")
    if method == "GetExtendedAgentCard":
        raise RPCError(-32007, "this agent has no extended card")
    raise RPCError(METHOD_NOT_FOUND, f"no method {method!r}")


# -- tasks, read from the store ---------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """One task as the store shows it now."""

    id: str
    session: str
    index: int
    state: str
    messages: list[Message]
    """The task's part of the transcript: its user message and what followed it."""
    note: str | None = None
    """Why it waits (input-required), or why it failed."""
    pending: tuple[dict[str, Any], ...] = ()
    live: RunView | None = None

    def json(self, history: int | None = None) -> dict[str, Any]:
        status: dict[str, Any] = {"state": self.state}
        if self.note is not None:
            parts: list[dict[str, Any]] = [{"text": self.note}]
            if self.pending:
                parts.append({"data": {"pending": list(self.pending)}})
            status["message"] = self._message("ROLE_AGENT", parts, "status")
        task: dict[str, Any] = {"id": self.id, "contextId": self.session, "status": status}
        answer = _answer(self.messages)
        if answer is not None:
            text, partial = answer
            artifact: dict[str, Any] = {"artifactId": "answer", "name": "answer",
                                        "parts": [{"text": text}]}
            if partial:
                artifact["metadata"] = {"aimuPartial": True}
            task["artifacts"] = [artifact]
        turns = [(i, m) for i, m in enumerate(self.messages)
                 if m["role"] in ("user", "assistant") and m["content"]]
        if history is not None:
            turns = turns[-history:] if history else []
        task["history"] = [
            self._message("ROLE_USER" if m["role"] == "user" else "ROLE_AGENT",
                          [{"text": m["content"]}], str(i))
            for i, m in turns
        ]
        return task

    def _message(self, role: str, parts: list[dict[str, Any]], key: str) -> dict[str, Any]:
        return {"messageId": f"{self.id}:{key}", "contextId": self.session,
                "taskId": self.id, "role": role, "parts": parts}


def _answer(messages: Sequence[Message]) -> tuple[str, bool] | None:
    """The task's answer so far: its last assistant text, and whether a stop cut it."""
    for message in reversed(messages):
        if message["role"] == "assistant" and message["content"]:
            return message["content"], bool(message.get("aimu_partial"))
    return None


def _task_id(params: Mapping[str, Any]) -> str:
    task_id = params.get("id")
    if not isinstance(task_id, str) or not task_id:
        raise RPCError(INVALID_PARAMS, "'id' (the task's id) is required")
    return task_id


def _history_length(params: Mapping[str, Any]) -> int | None:
    length = params.get("historyLength")
    if length is None:
        return None
    if isinstance(length, bool) or not isinstance(length, int) or length < 0:
        raise RPCError(INVALID_PARAMS, "'historyLength' must be a whole number >= 0")
    return length


def _place(task_id: str) -> tuple[str, int]:
    """``SESSION:INDEX``'s session and index; TASK_NOT_FOUND for anything else."""
    session, _, place = task_id.rpartition(":")
    if not is_event_number(place) or not session:  # ASCII digits only, at most 12 of them
        raise RPCError(TASK_NOT_FOUND, f"no task {task_id[:140]!r}")
    try:
        validate_name(session)
    except ServeError:
        raise RPCError(TASK_NOT_FOUND, f"no task {task_id[:140]!r}") from None
    return session, int(place)


async def _task(runs: Runs, task_id: str) -> Task:
    """The task ``SESSION:INDEX`` as the store and the runs show it now."""
    session, index = _place(task_id)
    transcript = await runs.store.load(session)
    if index >= len(transcript) or transcript[index]["role"] != "user":
        raise RPCError(TASK_NOT_FOUND, f"no task {task_id[:140]!r}")
    later = next((i for i in range(index + 1, len(transcript))
                  if transcript[i]["role"] == "user" and _starts_task(transcript[i])), None)
    messages = transcript[index:later]
    if later is not None:  # a later task started: this one ended as its messages show
        answer = _answer(messages)
        state = CANCELED if answer is not None and answer[1] else COMPLETED
        return Task(task_id, session, index, state, messages)
    active = await runs.session_run(session)
    if active is not None and active.messages_from >= index:
        return Task(task_id, session, index, WORKING, messages, live=active)
    info = await runs.store.info(session)
    status = None if info is None else info.status
    if status == "paused":
        _, pending = await runs.paused_on(session)
        if pending:
            return Task(task_id, session, index, INPUT_REQUIRED, messages,
                        "Tool calls wait for approval: reply 'approve' or 'deny' (or a data "
                        "part {\"approved\": true|false, \"reason\": ...}).", tuple(pending))
    if status in _STATES:
        note = {"failed": "the run failed", "blocked": "a guardrail blocked the run"}.get(
            str(status))
        return Task(task_id, session, index, _STATES[status], messages, note)
    return Task(task_id, session, index, INPUT_REQUIRED, messages,
                f"The run stopped ({status or 'when its server did'}): send a message on "
                "this task to resume it.")


def _starts_task(message: Message) -> bool:
    """A user message that began a task (a sent-in or correcting one did not)."""
    return not any(key.startswith("aimu_") for key in message)


async def _live_follower(runs: Runs, task: Task) -> RunFollower | None:
    if task.live is None:
        return None
    return RunFollower(runs, task.live, owned=False)


async def _list(runs: Runs, params: Mapping[str, Any]) -> dict[str, Any]:
    session = params.get("contextId")
    if not isinstance(session, str):
        raise RPCError(INVALID_PARAMS, "'contextId' is required: tasks are listed per context")
    transcript = await runs.store.load(validate_name(session))
    ids = [f"{session}:{i}" for i, m in enumerate(transcript)
           if m["role"] == "user" and _starts_task(m)]
    history = _history_length(params)
    tasks = [(await _task(runs, task_id)).json(history) for task_id in ids]
    return {"tasks": tasks, "nextPageToken": "", "pageSize": len(tasks),
            "totalSize": len(tasks)}


# -- sending --------------------------------------------------------------------------------


async def _send(runs: Runs, params: Mapping[str, Any]) -> tuple[str, RunFollower]:
    """Start what a SendMessage asks for, a new task or an answer to one that waits: the
    task's id and its run."""
    message = params.get("message")
    if not isinstance(message, Mapping):
        raise RPCError(INVALID_PARAMS, "'message' is required")
    if message.get("role") not in ("ROLE_USER", "user"):
        raise RPCError(INVALID_PARAMS, "the message must be the user's (role ROLE_USER)")
    text, data = _content(message)
    task_id = message.get("taskId")
    if task_id:
        task = await _task(runs, str(task_id))
        if task.state != INPUT_REQUIRED:
            raise RPCError(UNSUPPORTED, f"task {task.id!r} is {task.state}: send a message "
                           "without taskId (in the same contextId) to start a new task")
        if task.pending:
            resumed = await decide_all(runs, task.session, _decisions(task, text, data))
            if resumed is None:
                raise RPCError(INVALID_PARAMS, "other tool calls still wait: decide them all")
            resumed.owned = False
            return task.id, resumed
        return task.id, RunFollower(runs, await runs.start(task.session, None), owned=False)
    if not text.strip():
        raise RPCError(INVALID_PARAMS, "the message has no text: say what the task is")
    context = message.get("contextId") or f"a2a-{secrets.token_hex(8)}"
    if not isinstance(context, str):
        raise RPCError(INVALID_PARAMS, "'contextId' must be a string")
    try:
        session = validate_name(context)
    except ServeError:
        raise RPCError(INVALID_PARAMS, "'contextId' must be 1-128 of A-Z a-z 0-9 . _ -") from None
    view = await runs.start(session, text)
    return f"{view.session}:{view.messages_from}", RunFollower(runs, view, owned=False)


def _content(message: Mapping[str, Any]) -> tuple[str, list[Mapping[str, Any]]]:
    parts = message.get("parts")
    if not isinstance(parts, list) or not parts:
        raise RPCError(INVALID_PARAMS, "the message needs parts")
    texts: list[str] = []
    data: list[Mapping[str, Any]] = []
    for part in parts:
        if isinstance(part, Mapping) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, Mapping) and isinstance(part.get("data"), Mapping):
            data.append(part["data"])
        else:
            raise RPCError(INVALID_PARAMS, "only text and data parts are supported")
    return "\n".join(texts), data


def _decisions(
    task: Task, text: str, data: list[Mapping[str, Any]]
) -> list[tuple[str, bool, str | None]]:
    """The message's decision on every call the task waits on: a data part
    ``{"approved": bool, "reason": str}`` or ``{"decisions": {call_id: bool}}``, or a
    text that says approve or deny."""
    calls = [str(call["call_id"]) for call in task.pending]
    for item in data:
        if isinstance(item.get("approved"), bool):
            reason = item.get("reason")
            return [(c, item["approved"], reason if isinstance(reason, str) else None)
                    for c in calls]
        decisions = item.get("decisions")
        if isinstance(decisions, Mapping) and all(isinstance(v, bool)
                                                  for v in decisions.values()):
            return [(str(c), bool(v), None) for c, v in decisions.items()]
    word = text.strip().lower().rstrip(".!")
    if word in _APPROVE or word in _DENY:
        return [(c, word in _APPROVE, None if word in _APPROVE else "denied over A2A")
                for c in calls]
    raise RPCError(INVALID_PARAMS, "the task waits for approvals: reply 'approve' or 'deny', "
                   "or a data part {\"approved\": true|false}")


async def _cancel(runs: Runs, task_id: str) -> dict[str, Any]:
    session, index = _place(task_id)
    live = await runs.session_run(session)
    if live is None or live.messages_from != index:  # not the run that began the task
        live = (await _task(runs, task_id)).live  # read the store: whose run is it?
    if live is None:
        task = await _task(runs, task_id)
        raise RPCError(TASK_NOT_CANCELABLE,
                       f"task {task.id!r} is {task.state}: no run of it is in progress")
    follower = RunFollower(runs, live, owned=False)
    await runs.cancel(live.run_id, "cancelled over A2A (CancelTask)")
    async with contextlib.aclosing(follower.events()) as events:
        async for _ in events:
            pass  # until the run has ended and its record is stored
    return (await _task(runs, task_id)).json()


# -- streaming ------------------------------------------------------------------------------


async def _streamed(
    runs: Runs, call_id: object, task_id: str, follower: RunFollower
) -> AsyncGenerator[dict[str, Any], None]:
    """The run's events as JSON-RPC stream responses; leaving only detaches."""
    first = await _task(runs, task_id)
    stream = _TaskStream(call_id, task_id, first.session)
    yield stream.answer({"task": {**first.json(), "status": {"state": WORKING}}})
    try:
        async for event in follower.events():
            for out in stream.feed(event):
                yield out
    finally:
        await follower.aclose()
    last = await _task(runs, task_id)
    yield stream.answer({"statusUpdate": {"taskId": task_id, "contextId": first.session,
                                          "status": last.json()["status"]}})


class _TaskStream(EventStream[dict[str, Any]]):
    """A task's run as A2A stream responses: its text as appends to a reply artifact
    (a new one after each tool call, result or step that followed text), its tool calls
    and results as ``working`` status updates."""

    def __init__(self, call_id: object, task_id: str, context: str) -> None:
        super().__init__(task_id)
        self._call_id, self._task_id, self._context = call_id, task_id, context
        self._reply = 0  # the reply artifact of this turn
        self._sent = 0  # the chunks sent of it

    def answer(self, result: dict[str, Any]) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "id": self._call_id, "result": result}

    def text_delta(self, part: str, text: str) -> list[dict[str, Any]]:
        self._sent += 1
        return [self.answer({"artifactUpdate": {
            "taskId": self._task_id, "contextId": self._context,
            "artifact": {"artifactId": f"reply-{self._reply}", "name": "reply",
                         "parts": [{"text": text}]},
            "append": self._sent > 1, "lastChunk": False,
        }})]

    def tool_call_start(
        self, call: ToolCallStarted, parent: str | None
    ) -> list[dict[str, Any]]:
        self._next_reply()
        data = {"call_id": call.call_id, "name": call.name, "arguments": call.arguments}
        return [self._status("tool_call", call.call_id, {"toolCall": data})]

    def tool_result(self, result: ToolResult) -> list[dict[str, Any]]:
        self._next_reply()
        data = {"call_id": result.call_id, "name": result.name, "content": result.content}
        return [self._status("tool_result", result.call_id, {"toolResult": data})]

    def step_finished(self, step: StepFinished) -> list[dict[str, Any]]:
        self._next_reply()
        return []

    def _next_reply(self) -> None:
        if self._sent:
            self._reply, self._sent = self._reply + 1, 0

    def _status(self, what: str, call_id: str, data: dict[str, Any]) -> dict[str, Any]:
        return self.answer({"statusUpdate": {
            "taskId": self._task_id, "contextId": self._context, "status": {
                "state": WORKING,
                "message": {"messageId": f"{self._task_id}:{what}:{call_id}",
                            "contextId": self._context, "taskId": self._task_id,
                            "role": "ROLE_AGENT", "parts": [{"data": data}]},
            }}})
