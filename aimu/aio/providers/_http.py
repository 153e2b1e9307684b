"""The HTTP model client: one request with its retries, the reply read and closed.

:class:`HTTPModelClient` sends a request body that a provider encodes and reads the
reply through the provider's :class:`~aimu.aio.providers._decoder.TurnDecoder`, line by
line, over the connections of its :class:`~aimu.aio.providers._pool.Pool`. Transport
failures are mapped to aimu errors in one place (``with reporter:``,
:mod:`~aimu.aio.providers._report`), where every message names the service and its URL
(credentials removed) and says what to check; no secret reaches a message, a log record
or a chained error.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import copy
import functools
import os
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Self, cast

import httpx

from aimu.aio._echo import echo
from aimu.aio._numbers import finite
from aimu.aio.errors import ModelError, ModelHTTPError
from aimu.aio.providers._backend import _Stream
from aimu.aio.providers._decoder import (
    TurnDecoder,
)
from aimu.aio.providers._errors import clip
from aimu.aio.providers._pool import (
    Pool,
)
from aimu.aio.providers._report import (
    AuthSource,
    Reporter,
    Secrets,
    _warn_no_key,
    display_url,
    is_local,
    split_credentials,
)
from aimu.aio.providers._resume import Reading, TurnSoFar, broken_stream
from aimu.aio.providers._retry import Retry, loading_model, log, retry_after
from aimu.aio.providers._settings import ClientSettings
from aimu.aio.providers._wire import WireEncoder, prefill, request_body
from aimu.aio.providers.base import (
    Chunk,
    ModelClient,
    TurnRequest,
    check_context_window,
)
from aimu.aio.scope import RunScope, current_scope
from aimu.aio.transcript import Message, ToolSpec

__all__ = ["HTTPModelClient", "TurnInput", "in_scope"]


@dataclass(frozen=True, slots=True)
class TurnInput:
    """What one request of a turn sends, which a provider encodes (:meth:`HTTPModelClient.body`):
    the transcript (a retry's: the part of the reply it continues included), the tools, a
    streamed or a whole reply, and what more the turn asks (:class:`TurnRequest`)."""

    messages: Sequence[Message]
    tools: Sequence[ToolSpec] | None = None
    stream: bool = True
    request: TurnRequest | None = None

_DRAIN_LIMIT = 1.0


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
        settings: ClientSettings,
        *,
        headers: dict[str, str],
        secrets: Sequence[str],
        to_wire: Any,
    ) -> None:
        """``settings`` as the provider took them (its ``merge_roles`` the wire's own where
        the wire decides); ``url``, ``headers`` and ``secrets`` as :meth:`service_settings`
        made them."""
        timeout, connect_timeout = settings.timeout, settings.connect_timeout
        for what, seconds in (("timeout", timeout), ("connect_timeout", connect_timeout)):
            if not finite(seconds) or seconds <= 0:
                raise ValueError(
                    f"{what} must be a positive number of seconds, got {echo(seconds)}"
                )
        super().__init__(model)
        bare, auth, url_secrets = split_credentials(url.strip().rstrip("/"))
        self.url = bare
        self.settings = settings
        self._secrets = Secrets((*secrets, *url_secrets))
        self.retry = Retry(settings.retries, settings.retry_delay)
        self._pool = Pool({**headers, **auth}, httpx.Timeout(timeout, connect=connect_timeout),
                          settings.concurrency)
        self._wire = WireEncoder(to_wire, settings.merge_roles)
        self.options = dict(settings.options or {})
        self.context_window = check_context_window(settings.context_window)
        self.continues_partial = bool(settings.continues_partial)

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
    def body(self, turn: TurnInput) -> bytes:
        """The encoded request body of ``turn``."""

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

    def stream_turn(
        self, messages: Sequence[Message], tools: Sequence[ToolSpec] | None = None, *,
        stream: bool = True, request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        return self._run_turn(TurnInput(messages, tools, stream, request))

    async def _run_turn(self, asked: TurnInput) -> AsyncGenerator[Chunk, None]:
        """The turn, asked again (see :mod:`._resume`) when its stream breaks, within the
        client's retries."""
        body, reporter, turn = self.body(asked), self.reporter(), TurnSoFar(asked.messages)
        # The run's (current at the first step): current again for a retry's waits.
        scope = current_scope.get()
        shard, attempt = await self._pool.acquire(reporter), 0
        try:
            # One pass of the event loop between composing the request and sending it:
            # runs started (or given their tool results) together then send in the next
            # pass, not in the one that composed them, which halves the longest pass a
            # burst of runs makes (loop lag p99 at 100 runs: 33.9 -> 23.1 ms,
            # benchmarks/bench_scale.py). A cancel here closes nothing yet.
            await asyncio.sleep(0)
            while True:
                sent = turn.sent
                decoder = self.decoder(reporter)
                reading = self._reading(decoder, sent)
                with in_scope(scope):  # its retry waits see the run's stops
                    response, attempt = await self._send(shard.http, body, asked.stream,
                                                         reporter, attempt)
                pieces = _pieces(response)  # closed below
                closed = False
                try:
                    with reporter:
                        if asked.stream:
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
                    body = self.body(replace(asked, messages=turn.sent))
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
