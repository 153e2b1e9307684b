"""The ASGI application of ``aimu serve``: the runs API, its OpenAPI document, the chat page.

:func:`app` builds a FastAPI application around a :class:`~aimu.serve.runs.Runs`.
Routes answer JSON (:mod:`aimu.serve.routes` is the contract, served at ``/openapi.json``
and browsable at ``/docs``), errors included, each through one table (:func:`answer`);
``GET /runs/{id}/events`` streams Server-Sent Events. Mounted inside another ASGI
application, call ``await app.aclose()`` when that application shuts down (a mounted
app receives no lifespan events of its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from types import EllipsisType
from typing import TYPE_CHECKING, Any, Final

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from aimu import __version__
from aimu.aio._numbers import finite
from aimu.aio._tasks import cancel_and_wait
from aimu.aio.client import ModelClient
from aimu.aio.errors import AimuError
from aimu.aio.limits import UsageLimits
from aimu.aio.store import Store
from aimu.aio.tools import Tool, Toolset
from aimu.serve import a2a, ag_ui, ai_sdk
from aimu.serve.agents import agent_factory, open_store
from aimu.serve.backends.local import LocalBackend
from aimu.serve.docs import add_docs
from aimu.serve.errors import answer
from aimu.serve.guards import RequestGuard
from aimu.serve.http import JSON, BearerAuth, BodyLimit, error_response, validation_answer
from aimu.serve.models import Error, Health, name_schemas_by_title
from aimu.serve.recovery import MAX_CRASHES, Recovery
from aimu.serve.routes import router
from aimu.serve.runs import AgentFactory, Runs, RunsBackend

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

    from aimu.aio.control import RedisControl

__all__ = ["DEFAULT_MAX_BODY", "ServeApp", "app", "openapi_document"]

#: Request bodies above this many bytes are refused with 413.
DEFAULT_MAX_BODY: Final = 1 << 20
STATIC: Final = Path(__file__).with_name("static")
_log = logging.getLogger("aimu.serve")

_TITLE: Final = "aimu runs API"
_DESCRIPTION: Final = (
    "Start, follow, stop, steer and resume agent runs. Every route but /health, /docs, "
    "/openapi.json and the chat page needs 'Authorization: Bearer <token>' when the server "
    "has a token. Every error is {\"error\": message, \"status\": code}."
)


class ServeApp(FastAPI):
    """The FastAPI application :func:`app` returns; ``runs`` executes the runs."""

    runs: Runs
    #: Requests need ``Authorization: Bearer <token>`` (the A2A card says so).
    needs_token: bool = False
    _closers: list[Callable[[], Awaitable[None]]]

    recovery: Recovery | None = None
    """What resumes the runs to go on with, when built with ``recover=``."""
    _looking: asyncio.Task[None] | None = None

    max_crashes: int = MAX_CRASHES
    _control: RedisControl | None = None
    _toolsets: list[Toolset]
    _mcp: MCPServer | None = None
    _recover_every: float | None = None

    def start_recovery(self, every: float) -> None:
        """Look for runs to go on with now and every ``every`` seconds (``recover=``)."""
        if self._looking is None:
            self.recovery = Recovery(self.runs, self.max_crashes)
            self._looking = asyncio.ensure_future(self.recovery.keep_looking(every))

    async def _stop_recovery(self) -> None:
        looking, self._looking = self._looking, None
        if looking is not None:
            await cancel_and_wait([looking])

    async def drain(self, grace: float) -> None:
        """Refuse new runs (503 with ``Retry-After``), interrupt the runs in progress at
        their next step boundary, cancel those still going ``grace`` seconds later, and
        wait; each so stopped is recorded and marked to be recovered."""
        recovery = self.recovery
        await self._stop_recovery()
        await self.runs.drain(grace)
        if recovery is not None:
            with contextlib.suppress(AimuError):  # the next server's looks tidy what is left
                await recovery.tidy()

    async def aclose(self) -> None:
        """Cancel the runs in progress (transcripts kept), then close what app() opened."""
        await self._stop_recovery()
        await self.runs.aclose()
        closers, self._closers = self._closers, []
        for close in closers:
            await close()


def app(
    model: str | ModelClient = "test",
    *,  # the agent and its sessions:
    store: str | os.PathLike[str] | Store | None = None, agents: AgentFactory | None = None,
    tools: Sequence[Callable[..., Any] | Tool | Toolset] = (), system: str | None = None,
    max_rounds: int = 10, limits: UsageLimits | None = None,
    session_limits: UsageLimits | None = None,
    # who may call it:
    token: str | EllipsisType | None = ..., cors_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None, max_body: int = DEFAULT_MAX_BODY,
    # where its runs execute, and how they go on after a crash:
    redis: str | RedisControl | None = None, redis_prefix: str = "aimu",
    temporal: str | None = None, task_queue: str | None = None,
    recover: float | None = None, max_crashes: int = MAX_CRASHES,
) -> ServeApp:
    """The runs API and the chat page as an ASGI application.

    ``model`` is a spec for :func:`aimu.aio.client` or a client (closed with the app);
    ``store`` a SQLite path, a ``postgresql://`` URL, or a store (default
    ``$AIMU_HOME/sessions.db``); ``agents`` replaces how a session's agent is built;
    ``limits`` bound each run and ``session_limits`` all of a session's runs, across
    restarts and recoveries (:class:`~aimu.aio.UsageLimits`). ``token`` (default:
    ``AIMU_API_TOKEN``) guards every route but ``/health`` and the page shell;
    ``cors_origins`` allows those browser origins (none by default); ``allowed_hosts``
    are the host names served besides loopback ones (default: none without a token, any
    with one; :class:`~aimu.serve.guards.RequestGuard`). ``redis`` (a URL or a control) shares
    the runs with every server on the same Redis and store; the app checks that Redis
    answers when it starts. ``temporal`` (``HOST:PORT``) with ``task_queue`` hands every
    run to ``aimu worker`` processes instead (``redis`` then makes their cancels land at
    once); the app connects when it starts. ``recover`` (seconds) looks for runs to go
    on with (their process died, or a drain stopped them) as the app starts and then that
    often, and resumes each exactly once (:mod:`aimu.serve.recovery`); a run whose
    process died ``max_crashes`` times in a row with no progress is left failed.
    """
    _check(max_crashes, recover, temporal, task_queue)
    if token is ...:
        token = os.environ.get("AIMU_API_TOKEN") or None
    opened, close_store = open_store(store)
    closers = [] if close_store is None else [close_store]
    if agents is None:
        agents, close_model = agent_factory(
            model, opened, tools=tools, system=system, max_rounds=max_rounds, limits=limits,
            session_limits=session_limits,
        )
        closers.append(close_model)
    # Toolsets (aio.MCPServer) open when the app starts and close with it.
    toolsets = [t for t in tools if isinstance(t, Toolset)]
    closers[:0] = [toolset.aclose for toolset in toolsets]
    control = _control(redis, redis_prefix)
    if control is not None:
        closers.insert(0, control.aclose)
    backend = _backend(agents, opened, control, temporal, task_queue)
    application = _new_app(_middleware(allowed_hosts, token, cors_origins, max_body))
    application.runs = Runs(backend, opened, agents)
    application._mcp = _add_mcp(application, application.runs)
    application._control, application._toolsets = control, toolsets
    application._recover_every, application.max_crashes = recover, max_crashes
    application.needs_token = bool(token)
    application._closers = closers
    return application


def _check(
    max_crashes: int, recover: float | None, temporal: str | None, task_queue: str | None
) -> None:
    if isinstance(max_crashes, bool) or not isinstance(max_crashes, int) or max_crashes < 1:
        raise ValueError(f"max_crashes= takes a count, 1 or more; got {max_crashes!r}")
    if recover is not None and not (finite(recover) and recover > 0):
        raise ValueError(f"recover= takes seconds between looks, above 0; got {recover!r}")
    if temporal is not None and task_queue is None:
        raise ValueError("app(temporal=...) needs task_queue=: the queue the workers take")


def _new_app(middleware: list[Middleware]) -> ServeApp:
    """The FastAPI application with its routes, before its runs are set."""
    application = ServeApp(
        title=_TITLE,
        version=__version__,
        description=_DESCRIPTION,
        docs_url=None,  # our own page (aimu.serve.docs): no CDN, no inline script
        redoc_url=None,
        default_response_class=JSON,
        middleware=middleware,
        # Exception (a 500) is answered by Starlette's outermost layer, which then
        # re-raises it for the server to log; every known error is answered here.
        exception_handlers={
            HTTPException: _http_error,
            RequestValidationError: _invalid,
            AimuError: _error,
            ClientDisconnect: _client_gone,
            Exception: _error,
        },
        lifespan=_lifespan,
    )
    _add_routes(application)
    return application


def _control(redis: str | RedisControl | None, prefix: str) -> RedisControl | None:
    """The Redis control of ``redis=`` (a URL or one made already), or None."""
    if redis is None:
        return None
    from aimu.aio.control import RedisControl  # the aimu-agents[redis] extra

    return redis if isinstance(redis, RedisControl) else RedisControl(redis, prefix)


def _backend(
    agents: AgentFactory,
    store: Store,
    control: RedisControl | None,
    temporal: str | None,
    task_queue: str | None,
) -> RunsBackend:
    """Where runs execute: Temporal's workers, this process with Redis control, or this
    process alone."""
    if temporal is not None and task_queue is not None:
        from aimu.serve.backends.temporal import TemporalBackend  # the aimu-agents[temporal] extra

        return TemporalBackend(temporal, task_queue, store, redis=control)
    if control is None:
        return LocalBackend(agents, store)
    from aimu.serve.backends.redis import RedisBackend

    return RedisBackend(agents, store, control)


def _middleware(
    allowed_hosts: Sequence[str] | None,
    token: str | None,
    cors_origins: Sequence[str],
    max_body: int,
) -> list[Middleware]:
    """The request guard (Host, Origin, cross-site), CORS, the bearer token, the body limit."""
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
    middleware.append(Middleware(BodyLimit, limit=max_body))
    return middleware


@contextlib.asynccontextmanager
async def _lifespan(application: FastAPI) -> AsyncIterator[None]:
    """Connect to Redis and Temporal and open the MCP servers (each failure an error
    naming it, before serving), serve ``/mcp``, look for runs to recover; then close."""
    assert isinstance(application, ServeApp)
    if application._control is not None:
        await application._control.connect()
    connect = getattr(application.runs.backend, "connect", None)  # --temporal
    if connect is not None:
        await connect()
    for toolset in application._toolsets:
        await toolset.open()
    async with contextlib.AsyncExitStack() as mcp_running:
        if application._mcp is not None:
            await mcp_running.enter_async_context(application._mcp.session_manager.run())
        if application._recover_every is not None:
            application.start_recovery(application._recover_every)
        yield
        await application.aclose()


def _add_mcp(application: FastAPI, runs: Runs) -> MCPServer | None:
    """``/mcp``: the agent as an MCP server over Streamable HTTP (aimu.serve.mcp_agent),
    when the ``mcp`` extra is installed; the server to run while the app does."""
    try:
        from mcp.server.transport_security import TransportSecuritySettings

        from aimu.serve.mcp_agent import agent_server
    except ImportError:
        return None
    server = agent_server(runs)
    # RequestGuard checks Host and Origin for every route, this one included.
    checks = TransportSecuritySettings(enable_dns_rebinding_protection=False)
    endpoint = server.streamable_http_app(streamable_http_path="/mcp", transport_security=checks)
    application.router.routes.extend(endpoint.routes)
    return server


def openapi_document() -> dict[str, Any]:
    """The runs API's OpenAPI document, as every server built by :func:`app` serves it."""
    bare = FastAPI(
        title=_TITLE, version=__version__, description=_DESCRIPTION,
        default_response_class=JSON, docs_url=None, redoc_url=None, openapi_url=None,
    )
    _add_routes(bare)
    return bare.openapi()


def _add_routes(application: FastAPI) -> None:
    """The API's routes (:mod:`aimu.serve.routes`), the chat page, the health check."""
    application.include_router(router)
    application.include_router(ag_ui.router)
    application.include_router(ai_sdk.router)
    application.include_router(a2a.router)
    application.add_api_route("/", _page, methods=["GET"], include_in_schema=False)
    application.add_api_route(
        "/health", _health, methods=["GET"], summary="Health check (no token needed)",
        response_model=Health, openapi_extra={"security": []},
        responses={400: {"model": Error, "description": "A host name not served here"}},
    )
    application.mount("/static", StaticFiles(directory=STATIC), name="static")
    add_docs(application)
    application.openapi = lambda: _document(application)  # type: ignore[method-assign]


async def _page() -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def _health() -> dict[str, str]:
    return {"status": "ok"}


def _document(application: FastAPI) -> dict[str, Any]:
    """The OpenAPI document FastAPI writes from the routes, with the bearer scheme and
    the schemas named by their titles."""
    if application.openapi_schema is None:
        document = get_openapi(
            title=application.title,
            version=application.version,
            description=application.description,
            routes=application.routes,
        )
        document.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"}
        }
        document["security"] = [{"bearer": []}]
        name_schemas_by_title(document)
        application.openapi_schema = document
    return application.openapi_schema


async def _invalid(request: Request, error: Exception) -> Response:
    """A request FastAPI found off its model: 400 (not JSON, a bad path, query or
    header value) or 422 (JSON with missing, unknown or mistyped fields)."""
    assert isinstance(error, RequestValidationError)
    status, message = validation_answer(error.errors())
    return error_response(status, message)


async def _http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        message = f"no route {request.url.path[:200]!r}; see /docs"
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
