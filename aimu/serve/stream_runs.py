"""Following one run for a protocol (AG-UI, the AI SDK's UI message stream, A2A, MCP).

:class:`RunFollower` yields a run's events (as JSON, from its start) until its terminal
event and keeps how it ended (:class:`RunEnd`). A follower may own its run (AG-UI, a
non-resumable AI SDK stream, an MCP call): closing it before that end cancels the run,
since a client that leaves such a stream asked for a stop. :func:`sse_response` and
:class:`ClosingStreamingResponse` make sure a stream's generator is closed when the
client goes, at once, not when it is collected; :func:`decide_all` and
:func:`live_or_revived` are the decisions and the reattach every protocol shares.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from aimu.aio._session import EXTERNAL
from aimu.aio._sse import CONTENT_TYPE
from aimu.aio.errors import ToolDefinitionError
from aimu.aio.tools import Tool, external_tool
from aimu.aio.transcript import Usage
from aimu.serve.errors import BadRequest, Conflict, ServeError
from aimu.serve.runs import Runs, RunView, check_fits

__all__ = [
    "ClosingStreamingResponse",
    "RunEnd",
    "RunFollower",
    "client_tools",
    "decide_all",
    "live_or_revived",
    "not_waiting",
    "shown_id",
    "sse_data",
    "sse_response",
]

#: Why a run is cancelled when the client that owned its stream left.
LEFT = "the client closed the stream"


@dataclass(frozen=True, slots=True)
class RunEnd:
    """How a followed run ended: its handle's status and what its last event said."""

    status: str
    reply: str | None
    error: str | None
    usage: Usage | None
    reason: str | None
    run_id: str | None = None


class RunFollower:
    """Follows ``view``'s run from its first event; ``owned``: leaving early cancels it."""

    def __init__(self, runs: Runs, view: RunView, *, owned: bool) -> None:
        self.runs = runs
        self.view = view
        self.owned = owned
        self.end: RunEnd | None = None
        self._events: AsyncGenerator[dict[str, Any], None] | None = None

    def events(self) -> AsyncGenerator[dict[str, Any], None]:
        """The run's events up to (not including) its terminal one, which sets :attr:`end`;
        :meth:`aclose` closes them."""
        self._events = self._follow()
        return self._events

    async def _follow(self) -> AsyncGenerator[dict[str, Any], None]:
        reply: str | None = None
        usage: Usage | None = None
        follow = self.runs.follow(self.view.run_id, None)
        async with contextlib.aclosing(follow):
            async for batch in follow:
                for _, event in batch:
                    kind = event.get("type")
                    if kind == "handle_finished":
                        status = str(event.get("status"))
                        error = None if status == "cancelled" else event.get("error")
                        self.end = RunEnd(
                            status, reply, error, usage, event.get("reason"), self.view.run_id
                        )
                        return
                    if event.get("path"):
                        continue  # an agent called as a tool: a protocol shows the top's own
                    if kind == "run_continued":  # its server died; recovery went on with it
                        self.view = await self.runs.backend.view(str(event["continued_as"]))
                        reply = usage = None
                        event = _restarted(event)
                    if kind == "run_finished":
                        reply, usage = event.get("reply"), event.get("usage")
                    yield event

    async def aclose(self) -> None:
        """Stop following; cancel the run if this follower owns it and it has not ended
        (shielded: this runs while the stream is being torn down)."""
        with anyio.CancelScope(shield=True):
            if self._events is not None:
                await self._events.aclose()
            if self.end is not None or not self.owned:
                return
            # ServeError: it ended meanwhile, or the control is gone: nothing to stop.
            with contextlib.suppress(ServeError):
                await self.runs.cancel(self.view.run_id, LEFT)


def _restarted(continued: dict[str, Any]) -> dict[str, Any]:
    """A protocol's view of ``run_continued``: the turn in progress when the server died
    starts again in the run that continues it (a reader drops its text, as for any
    restarted turn); what the dead run stored before it is in the session."""
    return {
        "type": "turn_retried", "source": "agent", "mode": "restarted", "kept": "",
        "error": f"the server running run {continued['run_id']} died; run "
                 f"{continued['continued_as']} goes on with it",
        "attempt": 1,
    }


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that closes its generator when the response ends in any way,
    so a client that disconnects runs the generator's ``finally`` at once."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):
                    await close()


def sse_data(event: object) -> bytes:
    """One Server-Sent Event carrying ``event`` as compact JSON (no id, no event name)."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_response(
    events: AsyncGenerator[Any, None], *, headers: Mapping[str, str] | None = None,
    last: bytes = b"",
) -> ClosingStreamingResponse:
    """A protocol's events as Server-Sent Events (``last`` after them when they end), the
    events' generator closed as soon as the client goes."""

    async def encoded() -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(events):
            async for event in events:
                yield sse_data(event)
        if last:
            yield last

    return ClosingStreamingResponse(
        encoded(), media_type=CONTENT_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
    )


def shown_id(call: Mapping[str, Any]) -> str:
    """The id a protocol shows a waiting call by: ``CALL_ID@PAUSE_ID``, so that the
    answer names the very pause the person saw (a call id alone may come back under a
    later pause of a replaced session)."""
    pause = call.get("pause_id")
    return f"{call['call_id']}@{pause}" if pause else str(call["call_id"])


async def decide_all(
    runs: Runs, session: str, decisions: Sequence[tuple[str, bool, str | None]],
    results: Mapping[str, str] | None = None,
) -> RunFollower | None:
    """Apply ``(id, approve, reason)`` decisions to ``session``'s paused run, every one
    checked before any is applied; the run the session resumed as (owned by the caller),
    or None while other calls still wait. An id is a call's :func:`shown_id` (bound to its
    pause: ``Conflict`` if that pause no longer waits) or its bare call id. ``results``:
    by id, the results of external tools' calls (their decisions approve)."""
    results = results or {}
    paused, pending = await runs.paused_on(session)
    if paused is None or not pending:
        raise Conflict(f"session {session!r} has no paused run waiting on a decision")
    bound: list[tuple[str, str | None, bool, str | None, str | None]] = []
    for given, approve, reason in decisions:
        call_id, at, pause = given.rpartition("@") if "@" in given else (given, "", "")
        waiting = [call for call in pending if str(call["call_id"]) == call_id]
        if not waiting:
            raise BadRequest(f"no tool call {given!r} waits for a decision on {session!r}")
        if at and waiting[0].get("pause_id") != pause:
            raise Conflict(f"tool call {call_id!r} was shown for a pause that no longer "
                           "waits (the session went on or was replaced): nothing decided")
        result = results.get(given)
        check_fits(given, waiting[0], approve, result)
        bound.append((call_id, pause or None, approve, reason, result))
    if len({call_id for call_id, *_ in bound}) != len(bound):
        raise BadRequest("a tool call is decided twice")
    resumed: str | None = None
    for call_id, pause_id, approve, reason, result in bound:
        answer = await runs.decide(paused, call_id, approve, reason, pause_id, result)
        resumed = answer["resumed_run_id"] or resumed
    if resumed is None:
        return None
    return RunFollower(runs, await runs.backend.view(resumed), owned=True)


def client_tools(declared: Sequence[tuple[str, str, object]]) -> list[Tool]:
    """A page's ``(name, description, parameters)`` tools as external tools: the model
    may call them, and a call pauses the run for the page's result (``BadRequest`` naming
    a tool that cannot be one)."""
    tools: list[Tool] = []
    for name, description, parameters in declared:
        schema = None if parameters in (None, {}) else parameters
        if schema is not None and not isinstance(schema, dict):
            raise BadRequest(f"tool {name!r:.80}: 'parameters' must be a JSON schema")
        try:
            tools.append(external_tool(name, description, schema))
        except ToolDefinitionError as error:
            raise BadRequest(f"client-side tool: {error}") from None
    if len({tool.name for tool in tools}) != len(tools):
        raise BadRequest("two client-side tools share a name")
    return tools


async def not_waiting(runs: Runs, session: str, call_id: str) -> ServeError | None:
    """What a result the client sent for ``call_id``, on which ``session`` does not wait,
    means: None for a call of the server's own tools, answered in its run (the client
    repeats what it was streamed: nothing to do); else the error: it has its result
    already (sent twice, or by a stale page), or no such call waits."""
    stored = await runs.store.load(session)
    answered = [m for m in stored if m["role"] == "tool" and m["tool_call_id"] == call_id]
    if not answered:
        return BadRequest(f"no client-side tool call {call_id!r:.80} waits for a result on "
                          f"{session!r}: nothing changed")
    state = await runs.store.load_state(session)
    external = {str(tool.get("name")) for tool in state.get(EXTERNAL) or []
                if isinstance(tool, Mapping)}
    if answered[0]["name"] not in external:
        return None
    return Conflict(f"tool call {call_id!r:.80} of {session!r} has its result already: "
                    "nothing changed")


async def live_or_revived(runs: Runs, session: str) -> RunView | None:
    """The session's run in progress; else, if its last run died with its process (the
    store still says ``in_progress`` and no server runs it), that run resumed: a page
    that comes back after a crash or a deploy finds its run going on, nobody has to press
    resume. None when nothing runs or is left to resume."""
    active = await runs.session_run(session)
    if active is not None:
        return active
    info = await runs.store.info(session)
    if info is None or info.status != "in_progress":
        return None
    try:
        return await runs.start(session, None)
    except Conflict:  # another page revived it first
        return await runs.session_run(session)
