"""The ASGI application of ``aimu serve``: the runs API, its OpenAPI document, the chat page.

:func:`app` builds a Starlette application around a :class:`~aimu.serve.runs.Runs`.
Routes answer JSON (see :mod:`aimu.serve.openapi` for the contract), errors included;
``GET /runs/{id}/events`` streams Server-Sent Events. Mounted inside another ASGI
application, call ``await app.aclose()`` when that application shuts down (a mounted
app receives no lifespan events of its own).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Final

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from aimu.aio import _sse as sse
from aimu.aio.client import ModelClient
from aimu.aio.errors import AimuError
from aimu.aio.store import Store
from aimu.aio.tools import Tool
from aimu.serve.agents import agent_factory, open_store
from aimu.serve.errors import BadRequest, Conflict, NotFound, answer
from aimu.serve.guards import RequestGuard
from aimu.serve.http import JSON, BearerAuth, error_response, fields, read_json
from aimu.serve.ids import check_run_id
from aimu.serve.local import LocalBackend
from aimu.serve.openapi import openapi_document
from aimu.serve.runs import AgentFactory, Runs, RunsBackend, validate_name

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl

__all__ = ["DEFAULT_MAX_BODY", "ServeApp", "app"]

#: Request bodies above this many bytes are refused with 413.
DEFAULT_MAX_BODY: Final = 1 << 20
STATIC: Final = Path(__file__).with_name("static")
_log = logging.getLogger("aimu.serve")

Handler = Callable[[Request], Awaitable[Response]]


class ServeApp(Starlette):
    """The Starlette application :func:`app` returns; ``runs`` executes the runs."""

    runs: Runs
    _closers: list[Callable[[], Awaitable[None]]]

    async def aclose(self) -> None:
        """Cancel the runs in progress (transcripts kept), then close what app() opened."""
        await self.runs.aclose()
        closers, self._closers = self._closers, []
        for close in closers:
            await close()


def app(
    model: str | ModelClient = "test",
    *,
    store: str | os.PathLike[str] | Store | None = None,
    tools: Sequence[Callable[..., Any] | Tool] = (),
    system: str | None = None,
    max_rounds: int = 10,
    token: str | EllipsisType | None = ...,
    cors_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    agents: AgentFactory | None = None,
    redis: str | RedisControl | None = None,
    redis_prefix: str = "aimu",
    temporal: str | None = None,
    task_queue: str | None = None,
) -> ServeApp:
    """The runs API and the chat page as an ASGI application.

    ``model`` is a spec for :func:`aimu.aio.client` or a client (closed with the app);
    ``store`` a SQLite path, a ``postgresql://`` URL, or a store (default
    ``$AIMU_HOME/sessions.db``). ``token`` (default: the
    ``AIMU_API_TOKEN`` variable) guards every route but ``/health`` and the page shell;
    ``cors_origins`` allows those browser origins (none by default). ``allowed_hosts``
    are the host names served besides loopback ones (default: none without a token, any
    with one; see :class:`~aimu.serve.guards.RequestGuard`). ``agents`` replaces
    how the agent of a session's run is built. ``redis`` (a URL or a control) shares
    the runs with every server on the same Redis and store; the app checks that Redis
    answers when it starts. ``temporal`` (``HOST:PORT``) with ``task_queue`` hands every
    run to ``aimu worker`` processes instead (``redis`` then makes their cancels land at
    once); the app connects when it starts.
    """
    closers: list[Callable[[], Awaitable[None]]] = []
    if token is ...:
        token = os.environ.get("AIMU_API_TOKEN") or None
    opened, close_store = open_store(store)
    if close_store is not None:
        closers.append(close_store)
    if agents is None:
        agents, close_model = agent_factory(
            model, opened, tools=tools, system=system, max_rounds=max_rounds
        )
        closers.append(close_model)

    backend: RunsBackend
    control: RedisControl | None = None
    connect: Callable[[], Awaitable[None]] | None = None
    if redis is not None:
        from aimu.aio.control import RedisControl

        control = redis if isinstance(redis, RedisControl) else RedisControl(redis, redis_prefix)
        closers.insert(0, control.aclose)
    if temporal is not None:
        if task_queue is None:
            raise ValueError("app(temporal=...) needs task_queue=: the queue the workers take")
        from aimu.serve.temporal import TemporalBackend  # the aimu[temporal] extra

        temporal_backend = TemporalBackend(temporal, task_queue, opened, redis=control)
        backend, connect = temporal_backend, temporal_backend.connect
    elif control is None:
        backend = LocalBackend(agents, opened)
    else:
        from aimu.serve.shared import RedisBackend

        backend = RedisBackend(agents, opened, control)
    runs = Runs(backend, opened, agents)
    api = _Routes(runs, max_body)
    middleware = [
        Middleware(
            RequestGuard, allowed_hosts=allowed_hosts, token=bool(token), origins=cors_origins
        )
    ]
    if cors_origins:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["GET", "POST", "DELETE"],
                allow_headers=["Authorization", "Content-Type", "Last-Event-ID"],
            )
        )
    if token:
        middleware.append(Middleware(BearerAuth, token=token))

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        if control is not None:
            await control.connect()  # a clear error naming the URL, before serving
        if connect is not None:
            await connect()  # Temporal: the same
        yield
        await application.aclose()

    application = ServeApp(
        routes=api.routes(),
        middleware=middleware,
        # Exception (a 500) is answered by Starlette's outermost layer, which then
        # re-raises it for the server to log; every known error is answered here.
        exception_handlers={
            HTTPException: _http_error,
            AimuError: _error,
            ClientDisconnect: _client_gone,
            Exception: _error,
        },
        lifespan=lifespan,
    )
    application.runs = runs
    application._closers = closers
    return application


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        message = f"no route {request.url.path[:200]!r}; see /openapi.json"
    elif error.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path[:200]!r}"
    else:
        message = str(error.detail)
    return error_response(error.status_code, message, error.headers)


async def _error(request: Request, error: Exception) -> Response:
    """Any error a route raised, answered through the one table (:func:`answer`)."""
    params = request.path_params
    where = (
        f"session {params['session']!r}" if "session" in params
        else f"run {params['run_id']!r}" if "run_id" in params
        else ""
    )
    told = answer(error, where)
    if told.log_level >= logging.ERROR:
        _log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    else:
        _log.log(told.log_level, "%s %s: %s: %s", request.method, request.url.path,
                 type(error).__name__, error)
    headers = None if told.retry_after is None else {"Retry-After": str(told.retry_after)}
    return error_response(told.status, told.message, headers)


async def _client_gone(request: Request, error: Exception) -> Response:
    """The client went away mid-body: nothing to answer, nothing wrong here."""
    _log.debug("%s %s: the client disconnected before sending its body",
               request.method, request.url.path)
    return error_response(400, "the client disconnected")


def _sse(item: tuple[str, dict[str, Any]]) -> bytes:
    """One Server-Sent Event (an empty id: a message without one, never resumed from)."""
    event_id, event = item
    data = json.dumps(event, separators=(",", ":"), default=str).encode()
    return sse.frame(data, event=event["type"], id=event_id or None)


class _Routes:
    """The route handlers, sharing the runs and the body limit."""

    def __init__(self, runs: Runs, max_body: int) -> None:
        self.runs = runs
        self.max_body = max_body

    def routes(self) -> list[Route | Mount]:
        return [
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/sessions", self.sessions, methods=["GET"]),
            Route("/sessions/{session}", self.session, methods=["GET"]),
            Route("/sessions/{session}", self.delete_session, methods=["DELETE"]),
            Route("/sessions/{session}/runs", self.start, methods=["POST"]),
            Route("/sessions/{session}/resume", self.resume, methods=["POST"]),
            Route("/runs/{run_id}", self.run, methods=["GET"]),
            Route("/runs/{run_id}/events", self.events, methods=["GET"]),
            Route("/runs/{run_id}/cancel", self.cancel, methods=["POST"]),
            Route("/runs/{run_id}/interrupt", self.interrupt, methods=["POST"]),
            Route("/runs/{run_id}/stop", self.stop, methods=["POST"]),
            Route("/runs/{run_id}/send", self.send, methods=["POST"]),
            Route("/runs/{run_id}/approvals/{call_id}", self.decide, methods=["POST"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]

    async def body(self, request: Request) -> dict[str, Any] | None:
        return await read_json(request, self.max_body)

    # -- pages and documents -----------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def health(self, request: Request) -> Response:
        return JSON({"status": "ok"})

    async def openapi(self, request: Request) -> Response:
        return JSON(openapi_document())

    # -- sessions ----------------------------------------------------------------------

    async def sessions(self, request: Request) -> Response:
        infos = await self.runs.store.sessions()
        running = await self.runs.session_runs([info.name for info in infos])
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
        return JSON({"sessions": listed})

    async def session(self, request: Request) -> Response:
        name = validate_name(request.path_params["session"])
        store = self.runs.store
        info = await store.info(name)
        active = await self.runs.session_run(name)
        if info is None and active is None:
            raise NotFound(f"no session {name!r} in the store")
        paused, pending = (None, []) if active is not None else await self.runs.paused_on(name)
        return JSON(
            {
                "name": name,
                "status": None if info is None else info.status,
                "run_id": None if active is None else active.run_id,
                "run_messages_from": None if active is None else active.messages_from,
                "paused_run_id": paused,
                "pending": pending,
                "messages": await store.load(name),
            }
        )

    async def delete_session(self, request: Request) -> Response:
        name = validate_name(request.path_params["session"])
        active = await self.runs.session_run(name)
        if active is not None:
            raise Conflict(
                f"session {name!r} has a run in progress ({active.run_id}); stop it first"
            )
        deleted = await self.runs.store.delete(name)  # SessionLockedError: a 409
        if not deleted:
            raise NotFound(f"no session {name!r} in the store")
        return Response(status_code=204)

    async def start(self, request: Request) -> Response:
        name = validate_name(request.path_params["session"])
        body = fields(await self.body(request), {"task": str})
        task: str = body["task"]
        if not task.strip():
            raise BadRequest("the task is empty: say what the run should do")
        return self._started(await self.runs.start(name, task))

    async def resume(self, request: Request) -> Response:
        name = validate_name(request.path_params["session"])
        fields(await self.body(request), {})
        return self._started(await self.runs.start(name, None))

    @staticmethod
    def _started(record: Any) -> Response:
        return JSON(
            {"run_id": record.run_id, "session": record.session, "status": record.status},
            status_code=202,
            headers={"Location": f"/runs/{record.run_id}"},
        )

    # -- runs ----------------------------------------------------------------------------

    async def run(self, request: Request) -> Response:
        return JSON(await self.runs.public(request.path_params["run_id"]))

    async def events(self, request: Request) -> Response:
        run_id = check_run_id(request.path_params["run_id"])
        after = request.headers.get("last-event-id") or request.query_params.get("after")
        await self.runs.check_follow(run_id, after)  # errors now, before the stream starts
        follow = self.runs.follow(run_id, after)

        async def stream() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(follow):
                async for batch in follow:
                    yield b"".join(map(_sse, batch)) if batch else sse.KEEP_ALIVE

        return StreamingResponse(
            stream(),
            media_type=sse.CONTENT_TYPE,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def cancel(self, request: Request) -> Response:
        body = fields(await self.body(request), {}, {"reason": str})
        record = await self.runs.cancel(request.path_params["run_id"], body.get("reason"))
        return JSON(record, status_code=202)

    async def interrupt(self, request: Request) -> Response:
        fields(await self.body(request), {})
        record = await self.runs.interrupt(request.path_params["run_id"])
        return JSON(record, status_code=202)

    async def stop(self, request: Request) -> Response:
        fields(await self.body(request), {})
        raw = request.query_params.get("grace", "5")
        try:
            grace = float(raw)
        except ValueError:
            raise BadRequest(f"grace must be a number of seconds, got {raw[:40]!r}") from None
        record = await self.runs.stop(request.path_params["run_id"], grace)
        return JSON(record, status_code=202)

    async def send(self, request: Request) -> Response:
        body = fields(await self.body(request), {"text": str})
        text: str = body["text"]
        if not text.strip():
            raise BadRequest("the text is empty: nothing to send")
        record = await self.runs.send(request.path_params["run_id"], text)
        return JSON(record, status_code=202)

    async def decide(self, request: Request) -> Response:
        body = fields(await self.body(request), {"approve": bool}, {"reason": str})
        result = await self.runs.decide(
            request.path_params["run_id"],
            request.path_params["call_id"],
            body["approve"],
            body.get("reason"),
        )
        return JSON(result, status_code=202)
