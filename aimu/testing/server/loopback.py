"""The loopback protocol server: Ollama, OpenAI-compatible and Gemini chat over real HTTP/1.1.

A :class:`LoopbackServer` listens on 127.0.0.1 (a random port by default) and plays a
script (:mod:`aimu.testing.script`) through each protocol's chat path (:mod:`.ollama`:
``/api/chat``, NDJSON; :mod:`.openai`: ``/v1/chat/completions``, SSE; :mod:`.gemini`:
``/v1beta/models/M:streamGenerateContent``, SSE), also behind Azure OpenAI's and Vertex
AI's paths and credentials (:mod:`.clouds`), with delays and injected faults
(:mod:`.playback`). It records every request, and for every chat reply
whether the client abandoned it and when: a closed client connection is noticed even
while the server waits between chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from typing import Any, Literal, Self

import h11

from aimu.aio._tasks import Background
from aimu.testing.script import Script, Turn
from aimu.testing.server._connection import BadRequest, Connection, Request
from aimu.testing.server.anthropic import ANTHROPIC
from aimu.testing.server.bedrock import BEDROCK
from aimu.testing.server.clouds import CloudAccess, is_cloud_path
from aimu.testing.server.gemini import GEMINI, is_gemini_path
from aimu.testing.server.model import default_script
from aimu.testing.server.ollama import OLLAMA
from aimu.testing.server.openai import OPENAI
from aimu.testing.server.playback import play
from aimu.testing.server.records import Headers, RecordedRequest, StreamRecord
from aimu.testing.server.responses import PREFIX, RESPONSES, BackgroundResponses, ResponsesWire
from aimu.testing.server.wire import (
    JSON,
    Protocol,
    Wire,
    alternation_error,
    image_error,
    json_bytes,
    prefill,
    trailing_assistant_error,
)

__all__ = ["LoopbackServer"]

_REDACTED = "***"
_BACKLOG = 4096
_SECRET_HEADERS = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "api-key", "x-goog-api-key",
     "x-amz-security-token"}
)


def _protocol(path: str) -> Protocol:
    if is_gemini_path(path):
        return GEMINI
    if path == PREFIX or path.startswith(PREFIX + "/"):
        return RESPONSES
    if path == ANTHROPIC.chat_path:
        return ANTHROPIC
    if path.startswith("/model/"):
        return BEDROCK
    return OPENAI if path == "/v1" or path.startswith("/v1/") else OLLAMA


def _json_body(request: Request) -> tuple[dict[str, Any], str | None]:
    """A POST's JSON object body, or why it is not one."""
    if request.method != "POST":
        return {}, None
    try:
        parsed = json.loads(request.body)
    except (UnicodeDecodeError, json.JSONDecodeError) as problem:
        return {}, f"the request body is not valid JSON ({problem})"
    if not isinstance(parsed, dict):
        return {}, f"the request body must be a JSON object, not {type(parsed).__name__}"
    return parsed, None


class _ScriptError(Exception):
    """The script could not give a turn; the message goes to the client as a 500."""


# -- the server ---------------------------------------------------------------------------


class LoopbackServer:
    """An HTTP/1.1 server on asyncio streams speaking Ollama's, OpenAI's (chat completions
    and Responses), Anthropic's and Gemini's chat protocols.

    ``script``: a list of :class:`Turn` served in order, one per chat request (both
    protocols share the position), or a function of the request body; None serves the
    embedded ``test`` model. Use ``async with server:`` or ``LoopbackServer.in_thread()``.
    """

    def __init__(
        self,
        script: Script | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        strict_alternation: bool = False,
        continues_partial: bool = True,
        echoes_prefill: bool = False,
        keep_records: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        #: Continue a trailing assistant message (the script's turn is its continuation),
        #: as Ollama and llama.cpp's server do; False: refuse it (400), as a server that
        #: cannot continue one would be modelled.
        self.continues_partial = continues_partial
        #: Send a trailing assistant message (the prefill it continues) back before the
        #: continuation, as llama.cpp's server does: as the first streamed text delta, and
        #: at the start of a whole reply's content.
        self.echoes_prefill = echoes_prefill
        #: Refuse (400) a chat whose user and assistant turns do not alternate, as the
        #: chat templates of Mistral or Gemma on vLLM do.
        self.strict_alternation = strict_alternation
        #: Keep every request and reply in :attr:`requests` and :attr:`streams` (what
        #: tests assert on and the ``wait_*`` methods count). False for a server that
        #: answers many runs and is asked nothing (a benchmark, ``python -m
        #: aimu.testing.server``): kept, every request body stays alive, the heap grows
        #: with each request, and Python's full collections (every ~1 s of a busy server)
        #: grow with it, to pauses of 100-250 ms that land on whichever client is talking.
        self.keep_records = keep_records
        #: True: streamed replies send their next chunks without their turns' delays (a
        #: wait under way ends as it would), the ones streaming now included: a test whose
        #: stop, send or input has landed need not sit the rest of a slow reply out.
        self.hurried = False
        self.requests: list[RecordedRequest] = []
        self.streams: list[StreamRecord] = []
        self.connections_accepted = 0
        self._script: Script = default_script()
        self._position = 0
        self.script = script
        self._state: Literal["created", "running", "stopped"] = "created"
        self._server: asyncio.Server | None = None
        self._tasks = Background()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._models: dict[str, None] = {"test": None}
        #: Model names ``/api/pull`` and ``/api/show`` say do not exist.
        self.missing_models: set[str] = set()
        #: Model names the registry has but this server has not pulled yet: ``/api/show``
        #: answers 404 until ``/api/pull`` fetches them.
        self.not_pulled: set[str] = set()
        self._serial = iter(range(1, sys.maxsize))
        #: The credentials the clouds' doors accept (Azure OpenAI, Vertex AI; see
        #: :mod:`.clouds`) and the tokens its ``POST /token`` issued.
        self.clouds = CloudAccess()
        #: The Responses API's background responses (``background: true``), by id.
        self.background = BackgroundResponses(self._spawn, self._notify)

    # -- script ---------------------------------------------------------------------

    @property
    def script(self) -> Script:
        return self._script

    @script.setter
    def script(self, script: Script | None) -> None:
        """Replace the script; a list starts again from its first turn."""
        self._script = default_script() if script is None else script
        self._position = 0

    def _next_turn(self, body: Mapping[str, Any]) -> Turn:
        script = self._script
        if callable(script):
            try:
                return script(body)
            except Exception as error:
                raise _ScriptError(
                    f"loopback script function raised {type(error).__name__}: {error}"
                ) from error
        position = self._position
        if position >= len(script):
            raise _ScriptError(
                f"loopback script exhausted: it has {len(script)} turns and chat request "
                f"{position + 1} arrived; give the server more turns"
            )
        self._position = position + 1
        return script[position]

    # -- lifecycle ------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://HOST:PORT``, the Ollama host (the server must be started)."""
        if self._state != "running":
            raise RuntimeError(
                f"loopback server is {self._state}, not running: "
                "use `async with server:` or `await server.start()` first"
            )
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    @property
    def azure_base_url(self) -> str:
        """Azure OpenAI's v1 API (``.../openai/v1``): ``client("azure:D", base_url=...)``."""
        return self.url + "/openai/v1"

    @property
    def gemini_base_url(self) -> str:
        """The Gemini API's base (``.../v1beta``): ``client("gemini:M", base_url=...)``."""
        return self.url + "/v1beta"

    async def start(self) -> None:
        """Listen on ``host:port`` (port 0: a free one, then set in ``port``)."""
        if self._state != "created":
            raise RuntimeError(f"loopback server is {self._state}; a server starts only once")
        # asyncio's default backlog of 100 drops connections when a thousand clients
        # connect at once: their connects time out, or (the handshake done, the accept
        # queue full) their request waits unanswered. The kernel caps it at somaxconn.
        self._server = await asyncio.start_server(
            self._on_connection, self.host, self.port, backlog=_BACKLOG
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._state = "running"

    async def stop(self) -> None:
        """Stop listening, close every connection and wait for every task it started."""
        if self._state != "running" or self._server is None:
            self._state = "stopped"
            return
        self._state = "stopped"
        self._server.close()
        await asyncio.sleep(0)  # connections accepted just now start, see "stopped", and close
        await self._tasks.aclose()
        await self._server.wait_closed()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    @classmethod
    @contextlib.contextmanager
    def in_thread(
        cls, script: Script | None = None, *, host: str = "127.0.0.1", port: int = 0
    ) -> Iterator[LoopbackServer]:
        """The server on its own event loop in a daemon thread; stopped on exit."""
        server = cls(script, host=host, port=port)
        ready = threading.Event()
        failures: list[Exception] = []
        control: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

        async def serve() -> None:
            stop_requested = asyncio.Event()
            control.append((asyncio.get_running_loop(), stop_requested))
            try:
                await server.start()
            except Exception as error:
                failures.append(error)
                return
            finally:
                ready.set()
            try:
                await stop_requested.wait()
            finally:
                await server.stop()

        thread = threading.Thread(
            target=lambda: asyncio.run(serve()), name="aimu-loopback-server", daemon=True
        )
        thread.start()
        ready.wait()
        if failures:
            thread.join()
            raise failures[0]
        try:
            yield server
        finally:
            loop, stop_requested = control[0]
            loop.call_soon_threadsafe(stop_requested.set)
            thread.join()

    # -- abandoned streams ------------------------------------------------------------

    def _abandoned(self) -> list[StreamRecord]:
        return [record for record in self.streams if record.abandoned]

    async def wait_abandoned(
        self,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> list[StreamRecord]:
        """Wait until ``count`` replies were abandoned by their client; TimeoutError if not.

        Works from any event loop (also with :meth:`in_thread`).
        """
        await self.wait_until(
            lambda: len(self._abandoned()) >= count,
            timeout,
            lambda: f"{len(self._abandoned())} of {count} expected streams were abandoned",
        )
        return self._abandoned()

    async def wait_requests(
        self,
        count: int = 1,
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> list[RecordedRequest]:
        """Wait until the server has read ``count`` requests in all: a provable point."""
        await self.wait_until(
            lambda: len(self.requests) >= count,
            timeout,
            lambda: f"{len(self.requests)} of {count} expected requests arrived",
        )
        return self.requests

    async def wait_until(
        self,
        condition: Callable[[], bool],
        timeout: float = 5.0,  # noqa: ASYNC109 - the documented API takes a timeout
        what: Callable[[], str] = lambda: "the awaited state was not reached",
    ) -> None:
        """Wait until ``condition()`` holds; checked whenever a request arrives, a chunk is
        sent or a reply is abandoned. TimeoutError naming ``what()`` if it does not."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                while not condition():
                    await waiter[1].wait()
                    waiter[1].clear()
        except TimeoutError:
            raise TimeoutError(
                f"loopback server: {what()} within {timeout}s ({len(self.streams)} streams "
                "in all)"
            ) from None
        finally:
            self._waiters.remove(waiter)

    def _notify(self) -> None:
        """Wake every ``wait_until``, whichever loop it waits on."""
        here = asyncio.get_running_loop()
        for loop, wake in list(self._waiters):
            if loop is here:
                wake.set()
            else:
                with contextlib.suppress(RuntimeError):  # that loop has closed
                    loop.call_soon_threadsafe(wake.set)

    # -- connections -------------------------------------------------------------------

    @property
    def models(self) -> Mapping[str, None]:
        """The model names asked for so far, in order (``test`` first): ``/api/tags``."""
        return self._models

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._tasks.spawn(work)

    def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A task of our own (not the one start_server would make) so that stop() can
        # cancel it and wait for it without asyncio logging the cancel as an error.
        self.connections_accepted += 1
        connection = Connection(reader, writer, self._spawn, self.connections_accepted)
        self._spawn(self._serve_connection(connection))

    async def _serve_connection(self, connection: Connection) -> None:
        abort = True
        try:
            if self._state != "running":
                return
            while True:
                try:
                    request = await connection.read_request()
                except BadRequest as error:
                    body = json_bytes({"error": f"bad request: {error}"})
                    with contextlib.suppress(h11.LocalProtocolError):
                        await connection.send_response(400, body, JSON, close=True)
                    break
                except (ConnectionError, OSError):
                    break
                if request is None:
                    break
                if not await self._dispatch(connection, request):
                    break
                if not connection.next_request_allowed():
                    break
            abort = False
        finally:
            await connection.unwatch()
            await connection.close(abort=abort)

    def _record(
        self, connection: Connection, request: Request, body: dict[str, Any], shown: str
    ) -> None:
        """Keep the request (its path as sent, ``shown``; its wire by the path it maps to)."""
        if not self.keep_records:
            self._notify()
            return
        headers = Headers(
            (name, _REDACTED if name in _SECRET_HEADERS else value)
            for name, value in request.headers.items()
        )
        protocol = _protocol(request.path).name
        self.requests.append(
            RecordedRequest(
                request.method,
                shown,
                protocol,
                body,
                headers,
                time.monotonic(),
                connection.number,
            )
        )
        self._notify()

    async def _dispatch(self, connection: Connection, request: Request) -> bool:
        """Answer one request; False when the connection must close."""
        shown = request.path
        if is_cloud_path(shown):  # a cloud's door: its credential checked, its path mapped
            request, answer = self.clouds.route(request)
            if answer is not None:
                self._record(connection, request, {}, shown)
                return await connection.send_response(
                    answer.status, answer.body, answer.content_type
                )
        path = request.path
        body, error = _json_body(request)
        self._record(connection, request, body, shown)
        protocol = _protocol(path)
        wire = protocol.make_wire(request.target, body, self._serial)
        model = wire.model
        if self.keep_records and wire.script_body() is not body:
            self.requests[-1].view = dict(wire.script_body())

        async def reply(status: int, payload: bytes, content_type: str = JSON) -> bool:
            extra = wire.error_headers(status) if status >= 400 else []
            return await connection.send_response(status, payload, content_type, extra)

        denied = protocol.authorize(request.method, request.target, request.headers, request.body)
        if denied is not None:
            return await connection.send_response(
                denied.status, denied.body, denied.content_type, denied.headers
            )

        if isinstance(wire, ResponsesWire) and path != protocol.chat_path:
            streams = self.streams if self.keep_records else []
            return await self.background.serve(connection, request, wire, streams)
        method = protocol.method(path)
        if method is None:
            return await reply(404, wire.error_body(404, f"no such endpoint: {path}"))
        if request.method != method and not (method == "GET" and request.method == "HEAD"):
            message = f"{path} takes {method}, not {request.method}"
            return await reply(405, wire.error_body(405, message))
        if not protocol.is_chat(path):
            if error is not None:
                return await reply(400, wire.error_body(400, error))
            answer = protocol.endpoints[path][1](self, body)
            return await reply(answer.status, answer.body, answer.content_type)
        if error is None:
            error = wire.refusal()
        messages = wire.script_body().get("messages")  # in the chat shape, whatever the wire
        if error is None and self.strict_alternation:
            error = alternation_error(messages)
        if error is None:
            error = image_error(messages)
        if error is None and not self.continues_partial:
            error = trailing_assistant_error(messages)
        if error is not None:
            return await reply(400, wire.error_body(400, error))
        self._models[model] = None
        return await self._chat(connection, wire, path)

    async def _chat(self, connection: Connection, wire: Wire, path: str) -> bool:
        try:
            turn = self._next_turn(wire.script_body())
        except _ScriptError as error:
            return await connection.send_response(500, wire.error_body(500, str(error)), JSON)
        record = StreamRecord(path, wire.protocol, wire.streamed(), time.monotonic(), turn.fault)
        if self.keep_records:
            self.streams.append(record)
        self._notify()
        if isinstance(wire, ResponsesWire) and wire.background():
            return await self.background.create(connection, wire, turn, record)
        echo = prefill(wire.body.get("messages")) if self.echoes_prefill else ""
        return await play(connection, wire, turn, record, self._notify, echo,
                          lambda: self.hurried)
