"""What the HTTP providers share: the pool, one request with retries, errors, a turn read.

:class:`HTTPModelClient` sends a request body that a provider encodes and reads the
reply through the provider's :class:`TurnDecoder`, line by line. Transport failures are
mapped to aimu errors in one place (``with reporter:``). Every message names the
service and its URL (credentials removed) and says what to check; no secret, neither a
header nor a key a server echoed back, reaches a message, a log record or a chained error.
"""

from __future__ import annotations

import abc
import asyncio
import base64
import collections
import contextlib
import copy
import functools
import ipaddress
import json
import os
import socket
import ssl
import sys
import time
import uuid
import warnings
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol, Self, cast
from urllib.parse import unquote, urlsplit, urlunsplit

import httpcore
import httpx

from aimu.aio._echo import echo
from aimu.aio._numbers import finite, is_count
from aimu.aio._sse import SSEParser
from aimu.aio.errors import ModelConnectionError, ModelError, ModelHTTPError, ModelProtocolError
from aimu.aio.providers._errors import clip, error_text, transport_error
from aimu.aio.providers._resume import Reading, TurnSoFar, broken_stream, tail
from aimu.aio.providers._retry import Retry, loading_model, log, retry_after
from aimu.aio.providers._unicode import TurnText, clean
from aimu.aio.providers._wire import WireEncoder, prefill, request_body
from aimu.aio.providers.base import (
    Chunk,
    ModelClient,
    ToolCallDelta,
    TurnRequest,
    check_context_window,
)
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage

__all__ = [
    "AuthSource",
    "HTTPModelClient",
    "Pool",
    "Reporter",
    "SSETurnDecoder",
    "Secrets",
    "TurnDecoder",
    "as_dict",
    "as_list",
    "call_id",
    "display_url",
    "in_scope",
    "split_credentials",
    "ssl_context",
    "tail",
    "tool_call",
    "unique_id",
    "with_cached",
]

_DRAIN_LIMIT = 1.0
_TEXT_LIMIT = 500
_REDACTED = "***"
#: Requests in flight per model client at most, unless ``concurrency=`` says otherwise
#: (None: no limit). More wait for a slot, for at most the read timeout, and a warning
#: says they wait. See docs/scaling.md.
DEFAULT_CONCURRENCY = 1024
#: Connections per httpx client of a pool. httpcore's pool scans every connection it
#: holds on every request start and finish (for each idle one, a poll syscall, and once
#: more over all of them: O(n^2) in its size): with 1,000 connections in one client that
#: stalled the loop for seconds (bench_scale). A pool spreads its requests over clients of
#: this many connections, never more requests in flight than that on one client, so each
#: scan stays this small whatever N is. 16 still cost 14,000 Python calls a run (200 runs
#: at once, cProfile; 2,600 of them httpcore's scans); 2 costs 9,800 (4: 10,400; 1: the
#: same as 2), for 21 tracked objects (~3 KB) per client.
SHARD_SIZE = 2
#: Seconds an idle connection is kept for the next request (httpx's default is 5). Runs
#: come in bursts: a tool round, an approval, the next task. After 5 s every connection of
#: a burst was gone and the next burst connected anew (bench_scale, 100 runs and then 100
#: more: 182 connections for 402 requests; with 60 s, 100). httpcore checks that an idle
#: connection is still open before reusing it, and a request that finds it closed by the
#: server before any byte of the reply is retried.
KEEP_ALIVE = 60.0
#: New connections a pool opens at once; more wait for a slot before they start (and
#: before their connect timeout starts). Thousands of runs started together otherwise
#: start thousands of TCP connects in one pass of the loop: the listener's SYN queue
#: overflows and the loop, busy starting the rest, sees the first ones complete too
#: late (bench_scale, 5,000 runs at once: 4,738 failed "could not connect within 5s").
MAX_CONNECTING = 64


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """The one TLS context of the process (loading the CA bundle costs ~36 ms)."""
    return httpx.create_ssl_context()


def call_id() -> str:
    """A fresh tool-call id for a call the server sent without one."""
    return f"call_{uuid.uuid4().hex[:16]}"


def unique_id(raw: object, seen: set[str]) -> str:
    """The id a call is kept under: the server's (cleaned) unless it gave none or one
    this reply already used (then a fresh one); added to ``seen``."""
    identifier = clean(raw) if isinstance(raw, str) and raw else call_id()
    if identifier in seen:
        identifier = call_id()
    seen.add(identifier)
    return identifier


def tool_call(
    identifier: str, name: str, arguments: dict[str, Any], error: str | None
) -> ToolCallDelta:
    """A complete tool call (``error``: why its arguments could not be used)."""
    call: ToolCall = {
        "id": identifier,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }
    return ToolCallDelta(call, error)


def with_cached(usage: Usage, cached: object) -> Usage:
    """``usage`` with ``cached_input_tokens`` when the server gave a count above zero."""
    if is_count(cached) and cached:
        usage["cached_input_tokens"] = cached
    return usage


def as_dict(value: object) -> dict[str, Any]:
    """``value`` if a JSON object, else an empty one (a reply's field of the wrong type)."""
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[Any]:
    """``value`` if a JSON array, else an empty one."""
    return value if isinstance(value, list) else []


def display_url(url: str) -> str:
    """``url`` without user info or query, fit to name in an error or a repr."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def is_local(url: str) -> bool:
    """Whether ``url``'s host is this machine or a private network's (``localhost``,
    ``127.0.0.1``, ``::1``, ``10.x``, ``192.168.x``...): where a model server with no API
    key is normal."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


_KEYLESS: set[tuple[str, str]] = set()


def _warn_no_key(variable: str, host: str) -> None:
    """Say once per process and host that requests to ``host`` go without an API key: a
    warning (shown by default, as a library's avoidable mistake is), and a log record."""
    if (variable, host) in _KEYLESS:
        return
    _KEYLESS.add((variable, host))
    said = f"no API key for {host}: requests go without one (set {variable}, or pass api_key=)"
    warnings.warn(said, UserWarning, stacklevel=_outside_aimu())  # the line that made it
    log.warning("%s", said)


_AIMU = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _outside_aimu() -> int:
    """The ``stacklevel`` of the first caller outside the aimu package (for its caller)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_AIMU):
        frame, level = frame.f_back, level + 1
    return level


def split_credentials(url: str) -> tuple[str, dict[str, str], list[str]]:
    """``url`` without ``user:password@``, the Basic auth header for it, and the secrets.

    The URL that httpx sees (and logs at INFO) never carries the credentials.
    """
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, {}, []
    user, _, password = userinfo.partition(":")
    user, password = unquote(user), unquote(password)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    bare = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    secrets = [s for s in (password, user, token) if len(s) >= 4]
    return bare, {"Authorization": f"Basic {token}"}, secrets


class Secrets(tuple[str, ...]):
    """Strings to redact from every message; never shown by a repr."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{len(self)} secrets>"

    __str__ = __repr__


class Reporter:
    """Builds the errors of one model request; each names the service, host and model."""

    __slots__ = ("hint", "host", "model", "secrets", "service", "timeout")

    def __init__(
        self,
        service: str,
        host: str,
        model: str,
        secrets: Sequence[str],
        timeout: httpx.Timeout,
        hint: str,
    ) -> None:
        self.service = service
        self.hint = hint
        self.host = host
        self.model = model
        self.secrets = secrets
        self.timeout = timeout

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, _REDACTED)
        return text

    def protocol(self, what: str) -> ModelProtocolError:
        """The reply could not be understood: ``what`` the server did, redacted."""
        return ModelProtocolError(
            self.redact(f"{self.service} at {self.host} {what} (model {self.model!r})"),
            host=self.host,
        )

    def json_object(self, raw: str | bytes, what: str) -> dict[str, Any]:
        """``raw`` parsed as a JSON object, else the protocol error naming ``what`` it was.

        Raised outside the ``except``: no chained error keeps the raw text (which may
        echo a secret).
        """
        problem = ""
        value: object = None
        try:
            value = json.loads(raw)
        except ValueError as error:
            problem = f"not JSON: {error}"
        if not problem and not isinstance(value, dict):
            problem = "not a JSON object"
        if problem or not isinstance(value, dict):
            raise self.protocol(
                f"sent {what} that could not be understood ({problem}): {clip(raw)}"
            )
        return value

    def server_error(self, detail: object, status: int = 200) -> ModelHTTPError:
        """An error object the server sent inside a 200 reply; ``status`` is the HTTP
        status its kind stands for (Anthropic's ``overloaded_error``: 529), so an error
        that arrives before any byte of the turn is retried as that status would be."""
        text = self.redact(error_text(detail))
        return ModelHTTPError(
            f"{self.service} at {self.host} reported an error mid-reply for model "
            f"{self.model!r}: {text[:_TEXT_LIMIT]}",
            host=self.host, status_code=status, body=text,
        )

    def http_error(self, response: httpx.Response, raw: bytes, hint: str) -> ModelHTTPError:
        body = self.redact(raw.decode("utf-8", "replace"))
        text = error_text(body)[:_TEXT_LIMIT] or response.reason_phrase
        status = response.status_code
        return ModelHTTPError(
            f"{self.service} at {self.host} answered HTTP {status} for model {self.model!r}: "
            f"{text}{hint}",
            host=self.host, status_code=status, body=body,
        )

    # Used as ``with reporter:`` around every read and write: like httpx's own
    # map_httpcore_exceptions, the one place transport failures become aimu errors.
    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> None:
        if isinstance(error, httpx.TransportError):
            raise transport_error(
                error, service=self.service, host=self.host, hint=self.hint, timeout=self.timeout
            ) from error
        if isinstance(error, httpx.DecodingError):
            raise self.protocol(f"sent a body that could not be decoded ({error})") from error


class AuthSource(Protocol):
    """Where a changing credential comes from (:mod:`aimu.aio.providers._auth`)."""

    async def headers(self, reporter: Reporter) -> dict[str, str]:
        """The auth headers of one request; each secret in them joins ``reporter``'s."""
        ...


class TurnDecoder(abc.ABC):
    """Reads one reply of a provider's protocol into chunks."""

    #: True once the reply's final marker was read: what follows is only the body's end.
    finished: bool = False
    #: The stream is binary messages, not lines: :meth:`split` cuts it into what
    #: :meth:`line` reads (AWS's event stream).
    framed: ClassVar[bool] = False

    def split(self, data: bytes) -> tuple[list[bytes], bytes]:
        """The whole units at the head of ``data`` and the rest (a framed decoder's)."""
        units = data.split(b"\n")
        return units, units.pop()

    @abc.abstractmethod
    def line(self, line: bytes) -> list[Chunk]:
        """The chunks of one line of a streamed body (without its newline)."""

    @abc.abstractmethod
    def end(self) -> list[Chunk]:
        """The last chunks when the body ends; raise if the reply did not finish."""

    @abc.abstractmethod
    def whole(self, body: bytes) -> list[Chunk]:
        """The chunks of a reply that was asked for in one piece."""

    def salvage(self) -> list[Chunk] | None:
        """The last chunks of a reply whose stream broke after the reply had finished
        (only its end was lost: a usage event, the final marker), or None if it had not
        finished (the default): the turn is then asked again."""
        return None


class SSETurnDecoder(TurnDecoder):
    """A reply streamed as server-sent events: each event's data goes to :meth:`event`.

    A stream that ends without its final marker ends the reply if :meth:`end_unmarked`
    says it may; else the reply did not finish, and :attr:`unfinished` says so.
    """

    #: The error's words for a stream that ended before the reply finished.
    unfinished: ClassVar[str]

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.parser = SSEParser()
        self.text = TurnText()

    @abc.abstractmethod
    def event(self, data: str) -> list[Chunk]:
        """The chunks of one event's data."""

    def line(self, line: bytes) -> list[Chunk]:
        event = self.parser.feed(line.decode("utf-8", "replace").rstrip("\r"))
        return [] if event is None else self.event(event.data)

    def end(self) -> list[Chunk]:
        last = self.parser.flush()  # an event the stream ended without its blank line
        chunks = self.event(last.data) if last is not None else []
        if self.finished:
            return chunks
        rest = self.end_unmarked()
        if rest is None:
            raise self.reporter.protocol(self.unfinished)
        return chunks + rest

    def end_unmarked(self) -> list[Chunk] | None:
        """The last chunks of a reply whose stream ended without the final marker, or
        None if such a reply did not finish (the default)."""
        return None

    def salvage(self) -> list[Chunk] | None:
        return None if self.finished else self.end_unmarked()


class _Paced(httpcore.AsyncNetworkBackend):
    """A network backend that opens a TCP connection only with a slot of its pool's
    :data:`MAX_CONNECTING` (the pool's semaphore for its running loop)."""

    def __init__(self, inner: httpcore.AsyncNetworkBackend, pool: Pool) -> None:
        self.inner = inner
        self.pool = pool

    async def connect_tcp(self, *args: Any, **kwargs: Any) -> httpcore.AsyncNetworkStream:
        async with self.pool.connecting:
            return _Stream(await self.inner.connect_tcp(*args, **kwargs))

    async def connect_unix_socket(self, *args: Any, **kwargs: Any
                                  ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self.inner.connect_unix_socket(*args, **kwargs))

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class _Stream(httpcore.AsyncNetworkStream):
    """A connection's stream whose socket is shut the moment a read or write of it is
    cancelled (a Stop, a cancelled run), or when :meth:`shut` is called (a reply
    abandoned between two reads): the server sees the FIN at once.

    httpcore closes such a connection too (one whose reply was not read to its end is
    never reused), but only after its lock, a checkpoint and the transport's deferred
    close: two or three passes of the loop, 160-190 Python calls, later (a profile of
    the cancel). What a stop keeps is the reader's business and does not change."""

    __slots__ = ("inner", "sock")

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self.inner = inner
        self.sock = inner.get_extra_info("socket")  # looked up now: it costs 30 calls

    async def read(
        self, max_bytes: int, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> bytes:
        try:
            return await self.inner.read(max_bytes, timeout)
        except asyncio.CancelledError:
            self.shut()
            raise

    async def write(
        self, buffer: bytes, timeout: float | None = None  # noqa: ASYNC109 - httpcore's
    ) -> None:
        try:
            await self.inner.write(buffer, timeout)
        except asyncio.CancelledError:
            self.shut()
            raise

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self.inner.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        return self.inner.get_extra_info(info)

    def shut(self) -> None:
        """Shut the socket both ways (the close that follows is httpcore's)."""
        if self.sock is not None:
            try:  # noqa: SIM105 - not contextlib.suppress: 3 calls fewer before the FIN
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # closed already, or the peer's reset came first
                pass


class _Shard:
    """One httpx client of a pool and how many requests it carries now."""

    __slots__ = ("busy", "http", "spare")

    def __init__(self, http: httpx.AsyncClient, spare: list[_Shard]) -> None:
        self.http = http
        self.busy = 0
        self.spare = spare  # its pool's shards with room, while that pool is bound


class Pool:
    """The httpx clients that a model client and its forks share, per event loop.

    Requests take a slot (:meth:`acquire`, given back with :meth:`release`): a client
    with fewer than :data:`SHARD_SIZE` requests in flight, made when none has room, so
    httpcore's per-request scans stay small at any number of runs. ``concurrency``
    bounds the requests in flight (None: no bound); past it a request waits for a slot,
    a warning says so, and after the read timeout it fails (ModelConnectionError): a
    run starts or fails, it never waits forever.

    Bound to the loop that first uses it and rebound when another loop does (an agent
    used from two successive ``asyncio.run`` calls). While bound, a suspended async
    generator registered with the loop closes the httpx clients when the loop shuts its
    generators down, so no connection outlives its loop.
    """

    __slots__ = (
        "_closer", "_queue", "_shards", "_spare", "_warned", "busy", "concurrency",
        "connecting", "headers", "loop", "timeout",
    )

    def __init__(
        self, headers: dict[str, str], timeout: httpx.Timeout, concurrency: int | None
    ) -> None:
        if concurrency is not None and (
            isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
        ):
            raise ValueError(f"concurrency must be >= 1 or None, got {concurrency!r}")
        self.headers = headers
        self.timeout = timeout
        self.concurrency = concurrency
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Requests in flight now (holding a slot).
        self.busy = 0
        self._shards: list[_Shard] = []
        self._spare: list[_Shard] = []  # the shards with room, the last one used first
        self._queue: collections.deque[asyncio.Future[None]] = collections.deque()
        self._warned = False
        self._closer: AsyncGenerator[None, None] | None = None
        #: Slots to open a connection (:data:`MAX_CONNECTING`), new for each loop bound.
        self.connecting = asyncio.Semaphore(MAX_CONNECTING)
        ssl_context()  # now, outside any event loop, and once per process

    @property
    def http(self) -> httpx.AsyncClient | None:
        """The first httpx client, None before the pool is bound to a loop."""
        return self._shards[0].http if self._shards and self.loop is not None else None

    def _client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=SHARD_SIZE, max_keepalive_connections=SHARD_SIZE,
                              keepalive_expiry=KEEP_ALIVE)
        transport = httpx.AsyncHTTPTransport(verify=ssl_context(), limits=limits)
        pool = transport._pool  # httpcore's; its connections open through its backend
        pool._network_backend = _Paced(pool._network_backend, self)
        # verify= and limits= again: for the proxies' transports ($HTTPS_PROXY & co).
        return httpx.AsyncClient(headers=self.headers, timeout=self.timeout, transport=transport,
                                 verify=ssl_context(), limits=limits)

    async def bind(self) -> httpx.AsyncClient:
        """The first httpx client for the running loop, made for it if need be."""
        loop = asyncio.get_running_loop()
        if self.loop is loop and self._shards:
            return self._shards[0].http
        spare: list[_Shard] = []
        shard = _Shard(self._client(), spare)
        spare.append(shard)
        shards = [shard]
        closer = _close_at_shutdown(shards)
        # Bound before the await, so forks binding at once in a new loop share one pool.
        self.loop, self._shards, self._spare, self._closer = loop, shards, spare, closer
        self.busy, self._queue, self._warned = 0, collections.deque(), False
        self.connecting = asyncio.Semaphore(MAX_CONNECTING)
        await anext(closer)  # first iterated here: the loop now tracks it
        return shard.http

    async def acquire(self, reporter: Reporter) -> _Shard:
        """A slot: the shard to send one request through; give it back with release().

        Waits while ``concurrency`` requests are in flight, for at most the pool
        timeout, then raises ModelConnectionError saying so.
        """
        if self.loop is not asyncio.get_running_loop() or not self._shards:
            await self.bind()
        limit = self.concurrency
        if limit is not None and (self.busy >= limit or self._queue):
            await self._wait(limit, reporter)
        else:
            self.busy += 1
        spare = self._spare
        if spare:
            shard = spare[-1]
        else:
            shard = _Shard(self._client(), spare)
            self._shards.append(shard)
            spare.append(shard)
        shard.busy += 1
        if shard.busy >= SHARD_SIZE:
            spare.pop()
        return shard

    async def _wait(self, limit: int, reporter: Reporter) -> None:
        """Wait for a slot; release() hands it over with the count already taken."""
        if not self._warned:
            self._warned = True
            log.warning(
                "model %r at %s: %d requests are in flight, the client's concurrency=%d; "
                "more wait for a slot (raise concurrency=, or None for no limit: see "
                "docs/scaling.md)", reporter.model, reporter.host, self.busy, limit,
            )
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        seconds = self.timeout.pool
        try:
            async with asyncio.timeout(seconds):
                await waiter
        except BaseException as error:
            handed = waiter.done() and not waiter.cancelled()
            if handed and isinstance(error, TimeoutError):
                return  # the slot came as the time ran out: take it
            if handed:
                self._hand_over()  # handed a slot just as we were cancelled: pass it on
                raise
            if isinstance(error, TimeoutError):
                raise ModelConnectionError(
                    f"the request to {reporter.service} at {reporter.host} waited "
                    f"{seconds:g}s for a slot: concurrency={limit} requests were in flight "
                    "all along (raise concurrency=, or None for no limit)",
                    host=reporter.host,
                ) from None
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._queue.remove(waiter)

    def release(self, shard: _Shard) -> None:
        """Give back the slot of acquire()."""
        shard.busy -= 1
        if shard.spare is not self._spare:
            return  # a slot of a pool since closed or rebound to another loop
        if shard.busy == SHARD_SIZE - 1:
            self._spare.append(shard)
        self._hand_over()

    def _hand_over(self) -> None:
        """The slot just freed to the first live waiter, else back to the count."""
        queue = self._queue
        while queue:
            waiter = queue.popleft()
            if not waiter.done():
                waiter.set_result(None)  # its busy count stays taken
                return
        self.busy -= 1
        self._warned = False

    async def aclose(self) -> None:
        closer, self._closer = self._closer, None
        loop, self.loop = self.loop, None
        self._shards, self._spare, self._queue = [], [], collections.deque()
        if closer is not None and loop is asyncio.get_running_loop():
            await closer.aclose()
        # A pool bound to another loop is closed by that loop's shutdown.


async def _close_at_shutdown(shards: list[_Shard]) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        for shard in shards:
            await shard.http.aclose()


class HTTPModelClient(ModelClient):
    """A model client over HTTP: the request, its retries and the reading of the reply.

    A provider sets :attr:`service`, :attr:`hint` and :attr:`path`, encodes the body
    (:meth:`body`) and decodes the reply (:meth:`decoder`). Forks share the pool and
    copy the settings; only the client first made closes the pool.
    """

    service: ClassVar[str]
    hint: ClassVar[str]
    #: Where the server is when ``base_url=`` is not given: this environment variable,
    #: else :attr:`default_url`; :attr:`url_example` shows a URL with its scheme.
    url_env: ClassVar[str] = ""
    default_url: ClassVar[str] = ""
    url_example: ClassVar[str] = ""
    #: The API key when ``api_key=`` is not given: the first of these variables set.
    key_envs: ClassVar[tuple[str, ...]] = ()
    #: The header that carries the key (None: the service takes none), after this prefix.
    key_header: ClassVar[str | None] = None
    key_prefix: ClassVar[str] = ""
    #: The chat endpoint's path under the base URL (what a 404 says to check).
    chat_path: ClassVar[str] = ""

    #: Each request is signed (:meth:`sign`) before it is sent.
    signs: ClassVar[bool] = False

    options: dict[str, Any]
    _owner: bool = True
    #: Where a bearer token that changes comes from (an Entra ID provider, Google's
    #: credentials), asked before every request; None: the headers are fixed.
    _auth: AuthSource | None = None

    @classmethod
    def service_settings(
        cls,
        base_url: str | None,
        api_key: str | None,
        headers: Mapping[str, str] | None,
        fixed: Mapping[str, str] | None = None,
    ) -> tuple[str, dict[str, str], list[str]]:
        """The base URL (``base_url``, :attr:`url_env`, :attr:`default_url`), the headers
        (``fixed``, then ``headers``, then the API key) and the secrets to redact."""
        url = (base_url or os.environ.get(cls.url_env) or cls.default_url).strip()
        if "://" not in url:
            raise ValueError(
                f"base_url {display_url(url)!r} needs a scheme, e.g. {cls.url_example}"
            )
        key = api_key
        if key is None:
            key = next((os.environ[name] for name in cls.key_envs if os.environ.get(name)), None)
        # api_key="" is a client that authenticates another way (a token, a signature).
        if (api_key is None and not key and cls.key_envs and cls.key_header is not None
                and not is_local(url)):
            _warn_no_key(cls.key_envs[0], display_url(url))
        sent = {"Accept": "application/json", **(fixed or {}), **(headers or {})}
        if key and cls.key_header is not None:
            sent[cls.key_header] = cls.key_prefix + key
        return url, sent, [key] if key else []

    def __init__(
        self,
        model: str,
        url: str,
        *,
        headers: dict[str, str],
        secrets: Sequence[str],
        timeout: float,
        connect_timeout: float,
        retries: int,
        retry_delay: float,
        merge_roles: bool,
        concurrency: int | None,
        to_wire: Any,
        options: Mapping[str, Any] | None = None,
        context_window: int | None = None,
    ) -> None:
        for what, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not finite(seconds) or seconds <= 0:
                raise ValueError(
                    f"{what} must be a positive number of seconds, got {echo(seconds)}"
                )
        super().__init__(model)
        bare, auth, url_secrets = split_credentials(url.strip().rstrip("/"))
        self.url = bare
        self._secrets = Secrets((*secrets, *url_secrets))
        self.retry = Retry(retries, retry_delay)
        self._pool = Pool({**headers, **auth}, httpx.Timeout(timeout, connect=connect_timeout),
                          concurrency)
        self._wire = WireEncoder(to_wire, merge_roles)
        self.options = dict(options or {})
        self.context_window = check_context_window(context_window)

    @property
    def host(self) -> str:
        return display_url(self.url)

    @property
    def base_url(self) -> str:
        """The server's base URL (without credentials)."""
        return self.url

    @property
    def has_api_key(self) -> bool:
        return self.key_header is not None and self.key_header in self._pool.headers

    @property
    def merge_roles(self) -> bool:
        """Whether adjacent same-role messages are sent as one (for strict templates)."""
        return self._wire.merge_roles

    def fork(self) -> Self:
        twin = copy.copy(self)
        ModelClient.__init__(twin, self.model)  # a transcript of its own
        twin.options = dict(self.options)
        twin._wire = WireEncoder(self._wire._to_wire, self._wire.merge_roles)
        twin._owner = False
        return twin

    async def aclose(self) -> None:
        """Close the connection pool; a fork leaves it to the client it came from."""
        if self._owner:
            await self._pool.aclose()

    def reporter(self) -> Reporter:
        return Reporter(
            self.service, self.host, self.model, self._secrets, self._pool.timeout, self.hint
        )

    def endpoint(self) -> str:
        """The URL chat requests go to: the base URL and :attr:`chat_path`."""
        return self.url + self.chat_path

    def url_for(self, stream: bool) -> str:
        """The URL of a streamed, or a whole, reply (one URL for both unless overridden)."""
        return self.endpoint()

    @abc.abstractmethod
    def body(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None,
        stream: bool,
        request: TurnRequest | None = None,
    ) -> bytes:
        """The encoded request body."""

    @abc.abstractmethod
    def decoder(self, reporter: Reporter) -> TurnDecoder:
        """A fresh reader for one reply."""

    def compose(
        self,
        settings: dict[str, Any],
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None,
    ) -> bytes:
        """The body: ``settings`` with the transcript's cached wire form and the tools."""
        encoded = self._wire.messages(messages)
        return request_body(settings, encoded, self._wire.tools(tools) if tools else None)

    def not_found_elsewhere(self) -> bool:
        """After a 404: whether the service may serve at another base URL, now in
        :attr:`url` (the request is sent there); no by default."""
        return False

    async def sign(self, request: httpx.Request, reporter: Reporter) -> None:
        """Sign ``request`` in place (for a client whose :attr:`signs`); raise a ModelError
        when it cannot be (no credentials)."""

    def status_hint(self, status: int) -> str:
        """What to check after an HTTP error status (``"; ..."``), or ``""``."""
        if status in (401, 403) and self.key_envs:
            return f"; check api_key= / {self.key_envs[0]}"
        if status == 404 and self.chat_path:
            return f"; check the model name and that {self.host} serves {self.chat_path}"
        return ""

    def prefill_space(self, messages: Sequence[Message]) -> str:
        """The whitespace a trailing assistant message (a prefill to continue) is sent
        without, which the continuation's text then loses once; ``""``: sent whole."""
        return ""

    def counted_input(self, decoder: TurnDecoder) -> int | None:
        """The tokens of the request ``decoder``'s reply answered, if its server counted
        them before the reply broke off (None: it had not)."""
        return None

    async def stream_turn(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None, *,
        stream: bool = True, request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """The turn, asked again (see :mod:`._resume`) when its stream breaks, within the
        client's retries."""
        body, reporter, turn = self.body(messages, tools, stream, request), self.reporter(), \
            TurnSoFar(messages)
        # The run's (current at the first step): current again for a retry's waits.
        scope = current_scope.get()
        shard, attempt = await self._pool.acquire(reporter), 0
        try:
            while True:
                sent = turn.sent
                decoder = self.decoder(reporter)
                reading = self._reading(decoder, sent)
                with in_scope(scope):  # its retry waits see the run's stops
                    response, attempt = await self._send(shard.http, body, stream, reporter,
                                                         attempt)
                pieces = _pieces(response)  # closed below
                closed = False
                try:
                    with reporter:
                        if stream:
                            async for piece in pieces:
                                chunks = reading.lines(piece)
                                if decoder.finished:  # the connection goes back to the pool
                                    closed = True
                                    await _closed(pieces, response, drain=True)
                                for chunk in turn.chunks(chunks):
                                    yield chunk
                                if decoder.finished:
                                    return
                            chunks = reading.end()
                        else:
                            chunks = reading.whole(await response.aread())
                        for chunk in turn.chunks(chunks):
                            yield chunk
                        return
                except ModelError as error:
                    failure: ModelError = error
                    _raise_unless_broken(error, reading.at_end, turn.given, reporter)
                finally:  # closed now, however it ended: the server sees the connection go
                    if not closed:
                        await _closed(pieces, response, drain=False)
                attempt, mended = await self._mend(turn, decoder, failure, attempt, reporter,
                                                   scope)
                for chunk in mended:
                    yield chunk
                if decoder.finished:
                    return
                if turn.sent is not sent:  # continued from its text, or restarted after
                    body = self.body(turn.sent, tools, stream, request)
        finally:
            self._pool.release(shard)

    def _reading(self, decoder: TurnDecoder, sent: Sequence[Message]) -> Reading:
        """How an attempt's body is read: a server's echo of the prefill taken out."""
        prefix = prefill(sent, self._wire.merge_roles)  # sent back first by llama.cpp
        return Reading(decoder, prefix, self.prefill_space(sent) if prefix else "")

    async def _mend(
        self,
        turn: TurnSoFar,
        decoder: TurnDecoder,
        failure: ModelError,
        attempt: int,
        reporter: Reporter,
        scope: RunScope | None,
    ) -> tuple[int, list[Chunk]]:
        """After ``failure`` broke a reply: its last chunks if it had finished (the
        decoder is then finished); else the retry's number, once its wait is over, and
        the TurnRetry the reader gets if part of the turn went out. ``failure`` raised
        when no retry is left (or a stop cut the wait)."""
        salvaged = decoder.salvage() if turn.given else None
        if salvaged is not None:  # only the reply's end was lost
            return attempt, turn.chunks(salvaged)
        try:
            with in_scope(scope):
                attempt = await self._next_attempt(attempt, failure, reporter)
        except ModelError:
            if not isinstance(failure, ModelHTTPError):
                _note_dropped(reporter, failure, True)
            raise
        if not turn.given:
            return attempt, []
        counted = self.counted_input(decoder)
        return attempt, [turn.broke(failure, attempt, self.continues_partial, counted)]

    async def _next_attempt(self, attempt: int, failure: ModelError, reporter: Reporter) -> int:
        """The number of the next attempt, once the retry wait is over; ``failure``
        raised when no retry is left (or an interrupt cut the wait)."""
        attempt += 1
        if not await self.retry.wait(attempt, None, failure, reporter):
            raise failure
        self._retried += 1
        return attempt

    async def _open(
        self, http: httpx.AsyncClient, body: bytes, stream: bool, reporter: Reporter
    ) -> httpx.Response:
        """The response to the request, its head read; retried while no byte came back."""
        return (await self._send(http, body, stream, reporter, 0))[0]

    async def _send(
        self,
        http: httpx.AsyncClient,
        body: bytes,
        stream: bool,
        reporter: Reporter,
        attempt: int,
    ) -> tuple[httpx.Response, int]:
        """The response to the request, its head read, and the retries made so far
        (``attempt`` before); retried while no byte came back."""
        fixed = _STREAM_HEADERS if stream else _WHOLE_HEADERS
        loading_since: float | None = None  # when the server first said it was loading
        while True:
            headers = fixed if self._auth is None else await self.auth_headers(fixed, reporter)
            request = http.build_request(
                "POST", _parsed_url(self.url_for(stream)), content=body, headers=headers
            )
            wait: float | None = None
            try:
                if self.signs:  # signed anew for each attempt (a signature has a time)
                    await self.sign(request, reporter)
                with reporter:
                    response = await http.send(request, stream=True)
            except ModelError as error:
                failure: ModelError = error
                retryable = Retry.before_reply(error.__cause__)
            else:
                if response.status_code < 400:
                    return response, attempt
                if response.status_code == 404 and self.not_found_elsewhere():
                    await response.aclose()
                    continue  # the same request at the other base URL: no attempt spent
                failure = await self._http_error(response, reporter)
                retryable = Retry.retry_status(response.status_code)
                wait = retry_after(response.headers.get("retry-after"))
            if not retryable:
                raise failure
            attempt += 1
            loading_for: float | None = None
            if loading_model(failure):
                now = time.monotonic()
                loading_since = now if loading_since is None else loading_since
                loading_for = now - loading_since
            if not await self.retry.wait(attempt, wait, failure, reporter, loading_for):
                raise failure
            self._retried += 1

    async def auth_headers(self, headers: Mapping[str, str], reporter: Reporter) -> dict[str, str]:
        """``headers`` with the bearer token of :attr:`_auth` for one request."""
        sent = dict(headers)
        if self._auth is not None:
            sent.update(await self._auth.headers(reporter))
        return sent

    async def _http_error(self, response: httpx.Response, reporter: Reporter) -> ModelError:
        try:
            with reporter:
                raw = await response.aread()
        except ModelError as error:
            return error
        finally:
            await response.aclose()
        status = response.status_code
        hint = self.status_hint(status)
        if status == 429:
            wait = response.headers.get("retry-after")
            hint = f"; retry after {clip(wait, 40)}s" if wait else "; slow down and retry"
        return reporter.http_error(response, raw, hint)


_WHOLE_HEADERS = {"Content-Type": "application/json"}
_STREAM_HEADERS = {**_WHOLE_HEADERS, "Accept": "text/event-stream, application/x-ndjson"}


@functools.lru_cache(maxsize=64)
def _parsed_url(url: str) -> httpx.URL:
    """``url`` parsed once: httpx parses a string URL with regular expressions on every
    request (40 calls a request, cProfile); an ``httpx.URL`` it takes as it is."""
    return httpx.URL(url)


@contextlib.contextmanager
def in_scope(scope: RunScope | None) -> Iterator[None]:
    """``scope`` current for a few lines that do not yield to the stream's reader."""
    token = current_scope.set(scope)
    try:
        yield
    finally:
        current_scope.reset(token)


def _raise_unless_broken(
    error: ModelError, at_end: bool, began: bool, reporter: Reporter
) -> None:
    """Raise ``error`` unless it broke the stream in a way asking again may mend."""
    if broken_stream(error, at_end, began):
        return
    if not isinstance(error, ModelHTTPError):
        _note_dropped(reporter, error, False)
    raise error


def _note_dropped(reporter: Reporter, error: ModelError, retried: bool) -> None:
    """Log a reply that broke off after its head and is not asked again (no retry was
    left, or ``retried`` False: asking again would not mend it, as for a line that
    could not be understood): the error's words (which may quote the reply) only at
    DEBUG."""
    log.warning(
        "model %r at %s: the reply broke off mid-stream (%s); %s", reporter.model,
        reporter.host, type(error).__name__,
        "no retry was left" if retried else "asking again would not mend it",
    )
    log.debug("model %r at %s: %s", reporter.model, reporter.host, error)


#: Replies being closed (and drained) in tasks of their own: held here until done.
_CLOSING: set[asyncio.Future[None]] = set()


async def _closed(
    pieces: AsyncGenerator[bytes, None], response: httpx.Response, *, drain: bool
) -> None:
    """Close a reply (what is left of it read first when ``drain``) in a task of its own.

    httpx marks a response closed before httpcore gives its connection back, so a cancel
    landing inside that close (a Stop, a cancel of every run, a timeout around the
    drain) left the connection taken for good: its pool never served another request
    through it (a run waiting for it never started) and the socket stayed open until
    the process exited. The close therefore runs in a task nothing cancels; the caller
    waits for it (for a drain at most a second: the connection is back in the pool
    before the next request), and a cancel of the caller still reaches it at once.
    """
    if not drain:
        _shut(response)  # the server sees the stream end now, not a few loop turns later
    closing = asyncio.ensure_future(_close(pieces, response, drain))
    _CLOSING.add(closing)
    closing.add_done_callback(_forget)
    if closing.done():
        return
    if drain:  # a dawdling server keeps only the task waiting
        await asyncio.wait((closing,), timeout=_DRAIN_LIMIT)
    else:  # closed when this returns (a cancel of the caller returns at once)
        await asyncio.shield(closing)


def _pieces(response: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The body's bytes as they come: the raw ones when the server did not compress them
    (``aiter_bytes`` then only adds a generator around them, which a cancel leaves to the
    loop's finalizer hook: one more wake-up of the loop before the socket closes)."""
    if "content-encoding" in response.headers:
        return cast(AsyncGenerator[bytes, None], response.aiter_bytes())
    return cast(AsyncGenerator[bytes, None], response.aiter_raw())


def _shut(response: httpx.Response) -> None:
    """Shut the connection of a reply abandoned before its end (see :class:`_Stream`); a
    reply read to its end (httpx has closed it then) keeps its connection."""
    if not response.is_closed:
        stream = response.extensions.get("network_stream")
        if isinstance(stream, _Stream):
            stream.shut()


def _forget(task: asyncio.Future[None]) -> None:
    _CLOSING.discard(task)
    if not task.cancelled():
        task.exception()  # a failure closing a reply we are done with is not news


async def _close(
    pieces: AsyncGenerator[bytes, None], response: httpx.Response, drain: bool
) -> None:
    """Read what is left of a finished reply (``drain``), so its connection can serve the
    next request, then close it. After the final marker only the end of the body should
    remain; a server that sends more or dawdles keeps only this task waiting (each read
    bounded by the client's timeout), and a failure now is the server's."""
    try:
        if drain:
            with contextlib.suppress(httpx.HTTPError):
                async for _ in pieces:
                    pass
    finally:
        try:
            await pieces.aclose()
        finally:
            await response.aclose()
