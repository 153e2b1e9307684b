"""The runs API's routes: one table of paths, bodies, answers and errors (FastAPI).

Each route names its request model and its answers (:mod:`aimu.serve.models`); FastAPI
validates the bodies against them and writes ``/openapi.json`` and ``/docs`` from this
table, so the document is what the server does. Handlers reach the runs through
``request.app.runs``; what they raise is answered through :func:`aimu.serve.errors.answer`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any, Final

from fastapi import APIRouter, Body, Header, Path, Query, Request
from fastapi.responses import Response, StreamingResponse

from aimu.aio import _sse as sse
from aimu.aio._ids import (
    CHAINED_STREAM_ID_PATTERN,
    EVENT_NUMBER_PATTERN,
    RUN_ID_PATTERN,
    STREAM_ID_PATTERN,
)
from aimu.aio.images import image_urls, received_images
from aimu.aio.store._protocol import MAX_RUNS_PAGE
from aimu.serve.errors import BadRequest, Conflict, NotFound
from aimu.serve.http import JSON
from aimu.serve.ids import check_run_id
from aimu.serve.models import (
    CancelBody,
    CancelledMany,
    CancelManyBody,
    DecisionBody,
    DecisionSchema,
    EmptyBody,
    Error,
    Run,
    RunRecordList,
    SendBody,
    SessionList,
    SessionSchema,
    StartBody,
    Started,
)
from aimu.serve.runs import Runs, RunView, validate_name

__all__ = ["READ", "WRITE", "errors", "router", "streamed"]

_WHY: Final = {
    400: "Malformed request: bad JSON, a bad session name, event id or grace, or a host "
    "name this server does not answer to",
    401: "Missing or wrong bearer token (when the server has one)",
    403: "A cross-site request: another origin may not change state here",
    404: "No such run or session",
    409: "The session or run is in a state that does not allow this",
    413: "The request body is over the server's limit",
    415: "The request body is not declared application/json",
    422: "The JSON body has missing, unknown or mistyped fields",
    503: "The session store or Redis cannot serve this now",
}
#: FastAPI would document its own 422 body; ours has the one error shape.
#: The statuses a read, and a state-changing request, may be answered with.
READ: Final = (400, 401, 404, 422, 503)
WRITE: Final = (*READ, 403, 409, 413, 415)


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": Error, "description": _WHY[status]} for status in statuses}


def streamed(description: str) -> dict[int | str, dict[str, Any]]:
    """The 200 answer of a route that streams Server-Sent Events: ``description``."""
    return {200: {"description": description, "content": {sse.CONTENT_TYPE: {}}}}


_NAME: Final = "^[A-Za-z0-9._-]{1,128}$"
SessionName = Annotated[
    str,
    Path(
        description="1-128 of A-Z a-z 0-9 . _ -, not . or ..",
        json_schema_extra={"pattern": _NAME},
    ),
]
RunIdParam = Annotated[str, Path(json_schema_extra={"pattern": RUN_ID_PATTERN})]
_EVENT_ID: Final = {
    "anyOf": [
        {"type": "string", "maxLength": 0},
        {"type": "string", "pattern": EVENT_NUMBER_PATTERN},
        {"type": "string", "pattern": STREAM_ID_PATTERN},
        {"type": "string", "pattern": CHAINED_STREAM_ID_PATTERN},
    ]
}

router = APIRouter()


def _runs(request: Request) -> Runs:
    runs: Runs = request.app.runs
    return runs


def _started(record: RunView) -> Response:
    return JSON(
        {"run_id": record.run_id, "session": record.session, "status": record.status},
        status_code=202,
        headers={"Location": f"/runs/{record.run_id}"},
    )


# -- sessions ------------------------------------------------------------------------------


@router.get(
    "/sessions", response_model=SessionList, summary="Every stored session",
    responses=errors(401, 422, 503),
)
async def sessions(request: Request) -> dict[str, Any]:
    runs = _runs(request)
    infos = await runs.store.sessions()
    running = await runs.session_runs([info.name for info in infos])
    listed = [
        {
            "name": info.name,
            "created": info.created,
            "updated": info.updated,
            "message_count": info.message_count,
            "status": info.status,
            "run_id": running.get(info.name),
        }
        for info in infos
    ]
    return {"sessions": listed}


@router.get(
    "/sessions/{session}", response_model=SessionSchema, summary="A session's transcript",
    responses=errors(*READ),
)
async def session(request: Request, session: SessionName) -> dict[str, Any]:
    runs = _runs(request)
    name = validate_name(session)
    info = await runs.store.info(name)
    active = await runs.session_run(name)
    if info is None and active is None:
        raise NotFound(f"no session {name!r} in the store")
    paused, pending = (None, []) if active is not None else await runs.paused_on(name)
    return {
        "name": name,
        "status": None if info is None else info.status,
        "run_id": None if active is None else active.run_id,
        "run_messages_from": None if active is None else active.messages_from,
        "paused_run_id": paused,
        "pending": pending,
        "messages": await runs.store.load(name),
    }


@router.delete(
    "/sessions/{session}", status_code=204, response_class=Response, summary="Delete a session",
    responses={204: {"description": "Deleted"}, **errors(*READ, 403, 409, 415)},
)
async def delete_session(request: Request, session: SessionName) -> Response:
    runs = _runs(request)
    name = validate_name(session)
    active = await runs.session_run(name)
    if active is not None:
        raise Conflict(f"session {name!r} has a run in progress ({active.run_id}); stop it first")
    if not await runs.store.delete(name):  # SessionLockedError: a 409
        raise NotFound(f"no session {name!r} in the store")
    return Response(status_code=204)


_STARTED: Final[dict[int | str, dict[str, Any]]] = {
    202: {"model": Started, "description": "Accepted, once the run's record is stored "
          "(a server that dies now loses nothing): follow /runs/{run_id}/events"},
}


@router.post(
    "/sessions/{session}/runs", status_code=202, response_model=Started,
    summary="Start a run on the session (409 if one is in progress)",
    responses={**_STARTED, **errors(*WRITE)},
)
async def start(request: Request, session: SessionName, body: StartBody) -> Response:
    name = validate_name(session)
    if not body.task.strip():
        raise BadRequest("the task is empty: say what the run should do")
    return _started(await _runs(request).start(name, body.task))


@router.post(
    "/sessions/{session}/resume", status_code=202, response_model=Started,
    summary="Continue the session exactly where its last run stopped (409: nothing to "
    "resume, its last run completed)",
    responses={**_STARTED, **errors(*WRITE)},
)
async def resume(
    request: Request, session: SessionName, body: Annotated[EmptyBody | None, Body()] = None
) -> Response:
    return _started(await _runs(request).start(validate_name(session), None))


# -- runs -----------------------------------------------------------------------------------


@router.get(
    "/runs", response_model=RunRecordList,
    summary="The stored run records, the latest started first, a page at a time",
    description="Filter by session and status (running, completed, cancelled, ...); pass "
    "next_before as before= for the next page. A run whose server died stays running.",
    responses=errors(400, 401, 422, 503),
)
async def run_records(
    request: Request,
    session: Annotated[str | None, Query(json_schema_extra={"pattern": _NAME})] = None,
    status: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_RUNS_PAGE)] = 100,
    before: Annotated[str | None, Query(description="A run record's id")] = None,
) -> dict[str, Any]:
    try:
        found = await _runs(request).store.runs(session, status, limit, before)
    except ValueError as error:
        raise BadRequest(str(error)) from None
    return {
        "runs": [record.to_json() for record in found],
        "next_before": found[-1].id if len(found) == limit else None,
    }


@router.get(
    "/runs/{run_id}", response_model=Run, summary="A run's status, reply, usage and timing",
    responses=errors(*READ),
)
async def run(request: Request, run_id: RunIdParam) -> dict[str, Any]:
    return await _runs(request).public(run_id)


@router.get(
    "/runs/{run_id}/events",
    summary="The run's events as Server-Sent Events, the terminal one last",
    description="Each event has an id; reconnect with Last-Event-ID (or ?after=) to "
    "continue after it, missing nothing and repeating nothing. The last event is "
    "handle_finished.",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "An event stream",
            "content": {sse.CONTENT_TYPE: {"schema": {"type": "string"}}},
        },
        **errors(*READ),
    },
)
async def events(
    request: Request,
    run_id: RunIdParam,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", json_schema_extra=_EVENT_ID)
    ] = None,
    after: Annotated[str | None, Query(json_schema_extra=_EVENT_ID)] = None,
) -> StreamingResponse:
    runs = _runs(request)
    check_run_id(run_id)
    start_after = last_event_id or after
    await runs.check_follow(run_id, start_after)  # errors now, before the stream starts
    follow = runs.follow(run_id, start_after)

    async def stream() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(follow):
            async for batch in follow:
                yield b"".join(map(_sse, batch)) if batch else sse.KEEP_ALIVE

    return StreamingResponse(
        stream(),
        media_type=sse.CONTENT_TYPE,
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _sse(item: tuple[str, dict[str, Any]]) -> bytes:
    """One Server-Sent Event (an empty id: a message without one, never resumed from)."""
    event_id, event = item
    data = json.dumps(event, separators=(",", ":"), default=str).encode()
    return sse.frame(data, event=event["type"], id=event_id or None)


_ACCEPTED: Final[dict[int | str, dict[str, Any]]] = {
    202: {"model": Run, "description": "Accepted: the run as the request found it"}
}


@router.post(
    "/runs/{run_id}/cancel", status_code=202, response_model=Run,
    summary="Cancel the run now (its partial reply is kept)",
    responses={**_ACCEPTED, **errors(*WRITE)},
)
async def cancel(
    request: Request, run_id: RunIdParam, body: Annotated[CancelBody | None, Body()] = None
) -> dict[str, Any]:
    return await _runs(request).cancel(run_id, None if body is None else body.reason)


@router.post(
    "/runs/cancel", status_code=202, response_model=CancelledMany,
    summary="Cancel many runs now, at once (each keeps its partial reply)",
    description="One request for a cancel-all: each run named is cancelled as "
    "POST /runs/{run_id}/cancel would, all at once. A run that cannot be (unknown, ended) "
    "is listed in refused with that request's error; a malformed or repeated id refuses "
    "the whole request and cancels nothing.",
    responses={202: {"model": CancelledMany, "description": "Accepted: the runs cancelled, "
                     "each as the request found it, and those refused"},
               **errors(*WRITE)},
)
async def cancel_many(request: Request, body: CancelManyBody) -> dict[str, Any]:
    return await _runs(request).cancel_many(body.run_ids, body.reason)


@router.post(
    "/runs/{run_id}/interrupt", status_code=202, response_model=Run,
    summary="Stop the run at its next step boundary",
    responses={**_ACCEPTED, **errors(*WRITE)},
)
async def interrupt(
    request: Request, run_id: RunIdParam, body: Annotated[EmptyBody | None, Body()] = None
) -> dict[str, Any]:
    return await _runs(request).interrupt(run_id)


@router.post(
    "/runs/{run_id}/stop", status_code=202, response_model=Run,
    summary="Interrupt, then cancel if still running after grace seconds",
    responses={**_ACCEPTED, **errors(*WRITE)},
)
async def stop(
    request: Request,
    run_id: RunIdParam,
    grace: Annotated[float, Query(ge=0, le=3600, description="Seconds")] = 5.0,
    body: Annotated[EmptyBody | None, Body()] = None,
) -> dict[str, Any]:
    return await _runs(request).stop(run_id, grace)


@router.post(
    "/runs/{run_id}/send", status_code=202, response_model=Run,
    summary="Add a user message to the running run at its next step boundary (409 once "
    "it has ended)",
    responses={**_ACCEPTED, **errors(*WRITE)},
)
async def send(request: Request, run_id: RunIdParam, body: SendBody) -> dict[str, Any]:
    if not body.text.strip():
        raise BadRequest("the text is empty: nothing to send")
    return await _runs(request).send(run_id, body.text, _images(body.images))


def _images(images: list[str]) -> tuple[str, ...]:
    """The images of a send, checked as ``run(images=)`` checks them; only ``data:`` URLs,
    so a client cannot have the server read one of its files."""
    try:
        return tuple(image_urls(received_images(images)))
    except ValueError as error:
        raise BadRequest(str(error)) from None


@router.post(
    "/runs/{run_id}/approvals/{call_id}", status_code=202, response_model=DecisionSchema,
    summary="Approve or deny a tool call the paused run waits on; the last decision "
    "resumes it (404: the run waits on no such call; 409: not paused, decided already, or "
    "the call that waits now is not the one shown: another pause_id)",
    responses={
        202: {"model": DecisionSchema, "description": "Decided; after the last decision the run "
              "resumed as resumed_run_id"},
        **errors(*WRITE),
    },
)
async def decide(
    request: Request,
    run_id: RunIdParam,
    call_id: Annotated[str, Path(min_length=1, max_length=200)],
    body: DecisionBody,
) -> dict[str, Any]:
    if body.result is not None and not body.approve:
        raise BadRequest("a result is given with approve: true (a denial has no result)")
    return await _runs(request).decide(
        run_id, call_id, body.approve, body.reason, body.pause_id, body.result
    )
