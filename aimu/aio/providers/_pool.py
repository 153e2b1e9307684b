"""The connection pool of a model client and its forks: httpx clients ("shards") of a few
connections each, per event loop, and the bound on requests in flight."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import ssl
from collections.abc import AsyncGenerator

import httpx

from aimu.aio.errors import ModelConnectionError
from aimu.aio.providers._backend import _Native
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._retry import log

__all__ = [
    "DEFAULT_CONCURRENCY",
    "KEEP_ALIVE",
    "MAX_CONNECTING",
    "SHARD_SIZE",
    "Pool",
    "ssl_context",
]
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
        pool._network_backend = _Native(self)
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
