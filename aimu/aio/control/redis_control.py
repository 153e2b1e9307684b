"""RedisControl: find, stop and follow runs from any process that reaches the same Redis.

A worker registers a run with ``RunHandle.start(coro, control=control)``; any process
then calls ``cancel``, ``interrupt``, ``stop``, ``status``, ``wait``, ``runs`` and
``events`` by run id. Requests are recorded in Redis before they are published, so a
worker that missed the message still finds them, and a run reserved but not started
obeys them when it starts. A lease per run, renewed by heartbeat, tells a live run
from one whose worker died (``lost``); ``claim`` hands a lost run to exactly one
other worker, which resumes it from its store.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from typing import TYPE_CHECKING, Any, Final, NoReturn

from aimu._extras import missing_extra
from aimu.aio._echo import echo
from aimu.aio._numbers import finite
from aimu.aio.control import scripts
from aimu.aio.control.keys import (
    Keys,
    check_after,
    check_prefix,
    check_run_id,
    new_run_id,
    redact,
)
from aimu.aio.errors import ControlConnectionError, ControlError, UnknownRunError
from aimu.aio.status import ENDED, ControlStatus
from aimu.aio.steering import Steer

try:
    from redis.asyncio.retry import Retry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import AuthenticationError, RedisError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as error:  # pragma: no cover - depends on the environment
    raise missing_extra("aio.RedisControl", "redis", error) from error

from aimu.aio.control.following import FOLLOW_COUNT, Following
from aimu.aio.control.info import RunEvent, RunInfo, control_status, run_info
from aimu.aio.control.link import Link, Scripts, pooled
from aimu.aio.control.worker import Worker, reraise_cancel, stream_id

if TYPE_CHECKING:
    from aimu.aio.run_handle import RunHandle

__all__ = ["ControlStatus", "RedisControl", "RunEvent", "RunInfo"]

_SCHEMES: Final = ("redis", "rediss", "unix")
_FOLLOW_BLOCK_MS = 1000
#: A follower's read that timed out is tried again (the cursor makes it exact) this many
#: times in a row: a busy process takes a reply late (its loop lags behind Redis).
_READ_RETRIES = 2
#: Connections one control may hold for reads that wait (Redis' own default
#: ``maxclients``): each follower of a run's events holds one while it waits (XREAD
#: BLOCK). redis-py 8 caps a pool at 100 by default, and past that every command failed
#: "Too many connections" (aimu serve --redis: 197 of 300 runs refused, 503).
MAX_CONNECTIONS = 10_000
#: Connections one control uses for commands; a command waits for a free one. One pool
#: that grew with the commands in flight opened a connection for each of 1,000 starts
#: at once, and a starved process timed out connecting them (issue 35: 55-241 of 1,000
#: starts failed, "Timeout connecting to server"). Too few, and commands queue for a
#: connection a turn of a busy loop each: 200 cancels at once through 32 waited ~270 ms.
COMMAND_CONNECTIONS = 128
#: Connections one control opens at once; the others wait their turn before their
#: connect timeout starts (1,000 followers connecting at once in a process starved of
#: CPU: connects took 0.1-1 s each at 200 on a loaded machine, past 5 s at 1,000).
CONNECTING = 32
#: Connections of the control's worker (its pump, its lease renewals, its re-reads of
#: requests): its own, so a lease is renewed in time whatever commands queue meanwhile.
WORKER_CONNECTIONS = 3
_CLAIM_WINDOW = 30.0
_REAPPEAR_POLL = 0.02


class RedisControl(Following):
    """Control of runs across processes and hosts through one Redis, under ``prefix``.

    ``url``: ``redis://[:password@]host:port/db``, ``rediss://`` for TLS, or
    ``unix://``; its password never appears in a log, repr or error. ``lease``: seconds
    a worker's silence takes before its runs are ``lost``. Finished runs, their events
    and requests expire ``retention`` seconds after they end; a run keeps its last
    ``max_events`` events (about). Use ``async with RedisControl(url) as control:``.
    """

    def __init__(
        self,
        url: str,
        prefix: str = "aimu",
        *,
        lease: float = 10.0,
        retention: float = 86_400.0,
        max_events: int = 10_000,
        timeout: float = 5.0,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"RedisControl needs a redis:// URL string, got {type(url).__name__}")
        self.url = redact(url)
        """The URL with its password hidden: the only form that is shown."""
        scheme = url.partition("://")[0].lower() if "://" in url else ""
        if scheme not in _SCHEMES:
            raise ValueError(
                f"not a Redis URL: {self.url!r}; use redis://host:port/db, rediss:// for "
                "TLS, or unix:///path/to/redis.sock"
            )
        self.prefix = check_prefix(prefix)
        for name, value in (("lease", lease), ("retention", retention), ("timeout", timeout)):
            if not finite(value) or value <= 0:
                raise ValueError(f"RedisControl({name}={echo(value)}): give a positive number")
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise ValueError(f"RedisControl(max_events={max_events!r}): give a positive int")
        self.lease = float(lease)
        self.retention = float(retention)
        self.max_events = max_events
        self.timeout = float(timeout)
        #: This process's name in Redis: host, pid and a random tag.
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        options = {
            "decode_responses": True,
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # One quick retry: a pooled connection found dead after a Redis restart.
            "retry": Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
            "client_name": f"aimu-{self.worker_id}",
        }
        connecting = asyncio.Semaphore(CONNECTING)
        try:
            self._client = pooled(url, COMMAND_CONNECTIONS, options, connecting)
            """Commands: each waits for one of a few connections (opened once, reused)."""
            self._reads = pooled(url, MAX_CONNECTIONS, options, connecting, blocking=False)
            """Reads that wait (a follower's XREAD BLOCK, the worker's pub/sub): each holds
            a connection of its own while it waits."""
            own = pooled(url, WORKER_CONNECTIONS, options, connecting)
        except ValueError:
            raise ValueError(f"cannot use Redis URL {self.url!r}: it is malformed") from None
        self._keys = Keys(self.prefix)
        self._scripts = Scripts(self._client)
        self._link = Link(
            own, self._reads, self._keys, self._scripts, self.worker_id, self.url,
            self.lease, self.retention, self.max_events, self.timeout,
        )
        self._worker: Worker | None = None
        self._closed = False
        self._made: set[str] = set()
        """Ids made by run_id(None) and not yet attached."""

    def __repr__(self) -> str:
        runs = 0 if self._worker is None else len(self._worker.runs)
        return f"<RedisControl {self.url} prefix={self.prefix!r} attached={runs}>"

    # -- lifecycle -------------------------------------------------------------------

    async def connect(self) -> None:
        """Check that Redis answers; ControlConnectionError naming the URL if not."""
        with self._errors("connect"):
            await self._client.ping()

    async def __aenter__(self) -> RedisControl:
        try:
            await self.connect()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def flush(self) -> None:
        """Wait until the runs attached here that have ended are in Redis to their end.

        Their events are published in the background; while Redis is away this waits
        for it to come back (wrap it in ``asyncio.timeout`` to bound that).
        """
        if self._worker is not None:
            await self._worker.flush()

    async def aclose(self, *, timeout: float = 5.0) -> None:  # noqa: ASYNC109
        """Publish what finished runs still hold, then close the connections."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            await self._worker.aclose(timeout)
        await self._client.aclose()
        await self._reads.aclose()
        await self._link.client.aclose()

    @contextlib.contextmanager
    def _errors(self, what: str, run_id: str | None = None) -> Iterator[None]:
        if self._closed:
            raise RuntimeError(f"RedisControl for {self.url} is closed: {what} needs an open one")
        try:
            yield
        except AuthenticationError:
            raise ControlConnectionError(
                f"Redis at {self.url} refused the credentials ({what}); check the password "
                "in the URL",
                url=self.url,
            ) from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            raise ControlConnectionError(
                f"cannot reach Redis at {self.url} ({what}"
                f"{'' if run_id is None else f' of run {run_id!r}'}): "
                f"{_describe(error)}; is it running, and is this a Redis server?",
                url=self.url,
            ) from None
        except RedisError as error:
            raise ControlError(
                f"Redis at {self.url} failed {what}: {_describe(error)}", url=self.url
            ) from None

    # -- the worker side -------------------------------------------------------------

    def run_id(self, wanted: str | None) -> str:
        """``wanted`` checked, or a new unguessable id (``RunHandle.start`` calls this)."""
        if self._closed:
            raise RuntimeError(f"RedisControl for {self.url} is closed: cannot register runs")
        if wanted is not None:
            return check_run_id(wanted, self.prefix)
        made = new_run_id()
        self._made.add(made)  # nobody can have sent it a request yet: no need to wait
        return made

    def attach(self, handle: RunHandle[Any]) -> asyncio.Future[None]:
        """Register ``handle`` (started with ``control=``): publish it and obey requests.

        A run under an id given to ``RunHandle.start`` (a reserved or claimed one) starts
        once Redis answered its registration (with the requests sent for it before, so a
        cancel of a reserved run means it never starts), or once Redis could not be
        reached (it starts anyway, and is registered when Redis is back). A run under an
        id made here starts at once: no request can name it yet.
        """
        return self._attach(handle, "", required=False)

    def with_info(self, **info: str) -> _Tagged:
        """This control, registering runs with ``info`` (strings) kept beside them.

        ``RunHandle.start(agent.run(task), control=control.with_info(session="s1"))``:
        the claimer of a lost run reads ``info["session"]`` to resume it.
        """
        for key, value in info.items():
            if not isinstance(value, str):
                raise TypeError(f"with_info({key}=...) takes strings, got {type(value).__name__}")
        return _Tagged(self, _info_json(info, "with_info"), required=False)

    def required(self, **info: str) -> _Tagged:
        """Like :meth:`with_info`, but a run starts only once Redis knows it: if Redis
        cannot be reached it never starts (it ends cancelled) and :meth:`registered`
        raises ControlConnectionError. For a caller that must answer "started" truly."""
        return _Tagged(self, _info_json(info, "required"), required=True)

    def _attach(self, handle: RunHandle[Any], info: str, *, required: bool) -> asyncio.Future[None]:
        run_id = handle.run_id
        assert run_id is not None
        if self._worker is None:
            self._worker = Worker(self._link)
        made = run_id in self._made
        self._made.discard(run_id)
        return self._worker.attach(run_id, handle, info, required=required, wait=not made)

    async def registered(self, handle: RunHandle[Any]) -> str:
        """Wait until Redis knows ``handle``'s run (so every process can find it); its id.

        ``RunHandle.start`` registers in the background, and while Redis is away the
        run goes on unregistered: await this before handing the run id out.
        ControlError if Redis refused the run (its id is held by another worker).
        """
        run_id = handle.run_id
        worker = self._worker
        if run_id is None or worker is None or run_id not in worker.runs:
            if run_id is not None and handle.done and worker is not None:
                return run_id  # published and forgotten already
            raise ValueError(f"{handle!r} was not started with control= of this RedisControl")
        refused = await worker.registered(run_id)
        if refused is not None:
            why, down = refused
            if down:
                raise ControlConnectionError(why, url=self.url)
            raise ControlError(f"Redis at {self.url} refused run {run_id!r}: {why}", url=self.url)
        return run_id

    async def claim(self, run_id: str) -> RunInfo | None:
        """Take over a ``lost`` run; its RunInfo if this control won it, else None.

        Of any number of claimers exactly one wins. The winner must start the run again
        (``RunHandle.start(agent.resume(), run_id=run_id, control=control)``) within 30 s
        (or ``lease``, if longer), else it is lost again. UnknownRunError if no such run.
        """
        check_run_id(run_id, self.prefix)
        with self._errors("claim", run_id):
            result = await self._scripts.claim(
                keys=[self._keys.run(run_id), self._keys.lease(run_id)],
                args=[self.worker_id, int(max(self.lease, _CLAIM_WINDOW) * 1000)],
            )
        answer = scripts.reply(result)
        if answer.tag == "unknown":
            self._unknown(run_id)
        if answer.tag != "ok":
            return None
        return await self.status(run_id)

    async def reopen(self, run_id: str, *, was: str = "paused") -> bool:
        """Make a ``paused`` run pending again, so the part that resumes it after the
        decisions registers under the same id (``RunHandle.start(agent.resume(),
        run_id=run_id, control=control)``) and obeys requests sent from then on (kept
        meanwhile). ``was``: the status the run must have instead of ``paused`` (a part
        that ended so for the run to go on in another, as a Temporal turn handed off).
        False if the run's status is not that; UnknownRunError if there is no such run."""
        return await self._paused(run_id, "pending", None, was)

    async def cancel_paused(self, run_id: str, reason: str | None = None) -> bool:
        """Record that a ``paused`` run was cancelled while it waited for decisions (no
        worker ran it, so none can publish its end). False if it is not paused."""
        return await self._paused(run_id, "cancelled", reason or "cancelled")

    async def _paused(
        self, run_id: str, status: str, reason: str | None, was: str = "paused"
    ) -> bool:
        check_run_id(run_id, self.prefix)
        with self._errors("update the paused run", run_id):
            result = await self._scripts.paused(
                keys=[self._keys.run(run_id)],
                args=[status, reason or "", f"{time.time():.6f}", was],
            )
        answer = scripts.reply(result)
        if answer.tag == "unknown":
            self._unknown(run_id)
        return answer.tag == "ok"

    # -- the controller side ---------------------------------------------------------

    async def reserve(self, run_id: str | None = None, **info: str) -> str:
        """Record a run that a worker will start later; its id.

        Requests for it (a cancel) are kept and obeyed when it starts. A reservation
        no worker starts expires after ``retention``. ValueError if the id exists.
        """
        run_id = self.run_id(run_id)
        text = _info_json(info, "reserve")
        keys = self._keys
        with self._errors("reserve", run_id):
            made = await self._scripts.reserve(
                keys=[keys.run(run_id), keys.runs, keys.session(info.get("session", ""))],
                args=[f"{time.time():.6f}", text, self._link.retention_s, run_id, keys.base],
            )
        if scripts.reply(made).tag != "ok":
            raise ValueError(f"run id {run_id!r} is already in use under prefix {self.prefix!r}")
        return run_id

    async def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel the run wherever it runs; False if it had already finished.

        Recorded in Redis before it is published: a worker that is reconnecting, or a
        reserved run that has not started, gets it too. Repeating it is harmless.
        """
        return await self.request(run_id, Steer("cancel", reason=reason))

    async def interrupt(self, run_id: str) -> bool:
        """Ask the run to stop at its next step boundary; False if it had finished."""
        return await self.request(run_id, Steer("interrupt"))

    async def send(
        self, run_id: str, text: str, *, images: Sequence[object] = (),
        input_id: str | None = None,
    ) -> bool:
        """Give ``text`` (and ``images``: bytes, paths or ``data:`` URLs, checked here
        as ``run(images=)`` checks them) to the run wherever it runs: it joins as a user
        message at the next step boundary, once. Recorded before it is published, like a
        cancel; the images travel inline in the request (20 MB each at most).

        True once the run took it (or, for a run not started yet or lost, once it is
        stored for the run that starts or resumes); False if the run ended first, and
        then the text is in no run. ControlError if a live worker did not answer within
        ``lease`` seconds (the text is stored and may still join). ``input_id``: the
        id the text is kept under in the run's session store (``steering.send_kept``),
        with which the run joins it."""
        return await self.request(run_id, Steer.sending(text, images, input_id))

    async def stop(
        self,
        run_id: str,
        grace: float = 5.0,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> RunInfo:
        """Interrupt, cancel ``grace`` s later if still running; return the final RunInfo.

        Waits up to ``timeout`` (default: ``grace`` plus ``lease``) for the run to end,
        then raises TimeoutError; a run whose worker died comes back ``lost``.
        """
        request = Steer("stop", grace=grace)
        _check_timeout("stop", timeout)
        await self.request(run_id, request)
        return await self.wait(run_id, timeout=grace + self.lease if timeout is None else timeout)

    async def request(self, run_id: str, request: Steer, *, taken: bool = False) -> bool:
        """Deliver ``request`` (see :mod:`aimu.aio.steering`) to the run wherever it runs;
        False if it had finished. A stop is recorded and not waited for here.

        ``taken``: a cancel, interrupt or stop is answered True only once the run took
        it (or, with no live worker, once it is stored for the run that starts or
        resumes), as a send always is; ControlError if Redis goes away first. So an
        "accepted" holds even if Redis then restarts empty (it forgets what it stored)."""
        check_run_id(run_id, self.prefix)
        request.check()  # TypeError/ValueError: nothing recorded
        answer = await self._record_request(run_id, request)
        if answer.tag == "unknown" and await self._reappeared(run_id):
            answer = await self._record_request(run_id, request)
        if answer.tag == "unknown":
            self._unknown(run_id)
        if answer.tag != "ok":
            return False
        if not (taken or request.must_be_taken):
            return True
        return await self._taken(run_id, answer.values[0], request)

    async def _record_request(self, run_id: str, request: Steer) -> scripts.ScriptReply:
        """Add ``request`` to the run's request stream (as its ``kind`` and the JSON of
        the rest of :meth:`Steer.to_json`, the form every aimu's worker reads)."""
        keys = self._keys
        data = request.to_json()
        kind = data.pop("kind")
        with self._errors(kind, run_id):
            result = await self._scripts.request(
                keys=[keys.run(run_id), keys.requests(run_id)],
                args=[kind, json.dumps(data), keys.channel_base, run_id],
            )
        return scripts.reply(result)

    async def _reappeared(self, run_id: str) -> bool:
        """Whether an unknown run's record came back: just after Redis restarted empty,
        a live run is unknown until its worker registers it again (within its lease)."""
        with self._errors("status", run_id):
            uptime = float((await self._client.info("server")).get("uptime_in_seconds", 1e9))
            window = 2 * self.lease - uptime
            if window <= 0:
                return False
            loop = asyncio.get_running_loop()
            deadline = loop.time() + window
            key = self._keys.run(run_id)
            while not await self._client.exists(key):
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(_REAPPEAR_POLL)
        return True

    async def _taken(self, run_id: str, request_id: str, request: Steer) -> bool:
        """Wait until the run took request ``request_id`` (True) or ended without it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.lease + self.timeout
        delay = 0.002
        keys = self._keys
        kind, what = request.kind, request.what
        while True:
            with self._errors(kind, run_id):
                async with self._client.pipeline(transaction=True) as pipe:
                    pipe.hmget(keys.run(run_id), ["status", "requests_seen"])
                    pipe.exists(keys.lease(run_id))
                    (status, seen), leased = await pipe.execute()
            if status is None:
                raise ControlError(
                    f"run {run_id!r}: its record vanished while a {kind} waited for it "
                    f"(Redis restarted empty?): {what} may not have reached the run",
                    url=self.url,
                )
            if _passed(seen, request_id):
                return True
            if status == "pending" or (status == "running" and not leased):
                return True  # stored: the run obeys it when it starts or resumes
            if status != "running":
                return False  # it ended before taking the text
            if loop.time() >= deadline:
                raise ControlError(
                    f"run {run_id!r}: its worker did not take {what} within "
                    f"{self.lease + self.timeout:g} s; it is stored and may still land",
                    url=self.url,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _unknown(self, run_id: str) -> NoReturn:
        raise UnknownRunError(
            f"no run {run_id!r} under prefix {self.prefix!r} at {self.url}: it never "
            "started here, its record expired, or it belongs to another prefix",
            url=self.url,
        )

    async def status(self, run_id: str) -> RunInfo:
        """The run as Redis knows it; UnknownRunError if there is no such run."""
        check_run_id(run_id, self.prefix)
        with self._errors("status", run_id):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.hgetall(self._keys.run(run_id))
                pipe.exists(self._keys.lease(run_id))
                fields, leased = await pipe.execute()
        if not fields:
            self._unknown(run_id)
        return run_info(run_id, fields, bool(leased))

    def _running_here(self, run_id: str) -> bool:
        """True if ``run_id`` runs in this process (attached to this control, not ended)."""
        run = None if self._worker is None else self._worker.runs.get(run_id)
        return run is not None and not run.handle.done

    async def _read(
        self, run_id: str, key: str, cursor: str, block: int | None
    ) -> list[Any]:
        """The run's events after ``cursor``, waiting up to ``block`` ms for one."""
        reply = await self._retried(run_id, lambda: self._reads.xread(
            {key: cursor}, count=FOLLOW_COUNT, block=block
        ))
        return reply[0][1] if reply else []

    async def _range(self, run_id: str, key: str, cursor: str) -> list[Any]:
        """The run's events after ``cursor`` (the first ``FOLLOW_COUNT``), at once."""
        return list(await self._retried(run_id, lambda: self._client.xrange(
            key, f"({cursor}", "+", count=FOLLOW_COUNT
        )))

    async def _retried(self, run_id: str, read: Callable[[], Awaitable[Any]]) -> Any:
        """``read()`` of the run's events, again if it timed out (up to ``_READ_RETRIES``
        times in a row: a busy process takes a reply late; the cursor makes it exact)."""
        retries = _READ_RETRIES
        while True:
            with self._errors("events", run_id):
                try:
                    return await read()
                except RedisTimeoutError:
                    reraise_cancel()
                    if not retries:
                        raise
                    retries -= 1

    async def _standing(self, run_id: str) -> tuple[str, str | None]:
        """The run's status and worker, as :meth:`status` reads them but for less (a
        follower asks this every few seconds while its run is quiet)."""
        keys = self._keys
        with self._errors("events", run_id):
            status, worker, leased = await self._scripts.standing(
                keys=[keys.run(run_id), keys.lease(run_id)]
            )
        if not status:
            self._unknown(run_id)
        return control_status(status, bool(leased)), worker or None

    async def latest(self, sessions: Iterable[str]) -> dict[str, RunInfo]:
        """The latest run of each of ``sessions`` (``info["session"]``) that has one.

        Costs two round trips whatever the number of runs kept: each session names its
        latest run in Redis (the runs list is not scanned).
        """
        names = list(dict.fromkeys(sessions))
        if not names:
            return {}
        keys = self._keys
        with self._errors("latest"):
            ids: list[Any] = await self._client.mget([keys.session(n) for n in names])
            found = [(n, i) for n, i in zip(names, ids, strict=True) if i]
            if not found:
                return {}
            async with self._client.pipeline(transaction=False) as pipe:
                for _, run_id in found:
                    pipe.hgetall(keys.run(run_id))
                    pipe.exists(keys.lease(run_id))
                replies = await pipe.execute()
        latest: dict[str, RunInfo] = {}
        for i, (name, run_id) in enumerate(found):
            fields, leased = replies[2 * i], replies[2 * i + 1]
            if fields:
                latest[name] = run_info(run_id, fields, bool(leased))
        return latest

    async def last_event_id(self, run_id: str) -> str | None:
        """The id of the run's latest event still kept (None: none kept)."""
        check_run_id(run_id, self.prefix)
        with self._errors("events", run_id):
            last: Any = await self._client.xrevrange(self._keys.events(run_id), count=1)
        return str(last[0][0]) if last else None

    async def runs(self) -> list[RunInfo]:
        """Every run known under the prefix, oldest first (finished ones until they expire)."""
        keys = self._keys
        with self._errors("runs"):
            ids: list[str] = [str(i) for i in await self._client.zrange(keys.runs, 0, -1)]
            if not ids:
                return []
            async with self._client.pipeline(transaction=False) as pipe:
                for run_id in ids:
                    pipe.hgetall(keys.run(run_id))
                    pipe.exists(keys.lease(run_id))
                replies = await pipe.execute()
            found: list[RunInfo] = []
            gone: list[str] = []
            for i, run_id in enumerate(ids):
                fields, leased = replies[2 * i], replies[2 * i + 1]
                if fields:
                    found.append(run_info(run_id, fields, bool(leased)))
                else:
                    gone.append(run_id)
            if gone:
                await self._client.zrem(keys.runs, *gone)
        return found

    async def wait(
        self,
        run_id: str,
        timeout: float | None = None,  # noqa: ASYNC109 - the documented API takes a timeout
    ) -> RunInfo:
        """Wait until the run is finished or lost; TimeoutError after ``timeout`` s."""
        check_run_id(run_id, self.prefix)
        _check_timeout("wait", timeout)
        key = self._keys.events(run_id)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # The status and the last event at one instant: a run that ends later appends
        # its end after the cursor, which wakes the read below at once.
        with self._errors("wait", run_id):
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.xrevrange(key, count=1)
                pipe.hgetall(self._keys.run(run_id))
                pipe.exists(self._keys.lease(run_id))
                last, fields, leased = await pipe.execute()
        if not fields:
            self._unknown(run_id)
        info = run_info(run_id, fields, bool(leased))
        cursor: str = last[0][0] if last else "0-0"
        while info.status not in ENDED and info.status != "lost":
            block = _FOLLOW_BLOCK_MS
            if deadline is not None:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(
                        f"run {run_id!r} is still {info.status} after {timeout:g} s "
                        f"(worker {info.worker})"
                    )
                block = max(1, int(min(block, left * 1000)))  # no int of a huge float
            with self._errors("wait", run_id):
                reply: Any = await self._reads.xread(
                    {key: cursor}, count=FOLLOW_COUNT, block=block
                )
            if reply:
                cursor = reply[0][1][-1][0]
            info = await self.status(run_id)
        return info

    def events(self, run_id: str, after: str | None = None) -> AsyncIterator[RunEvent]:
        """The run's events from the start (or after event ``after``), then its end.

        Ends after the terminal ``HandleFinished``. Each event comes exactly once; to
        pick up after a disconnection pass the last ``RunEvent.id`` seen as ``after``.
        Raises RunLostError if the worker died (its run lost for ``lease`` seconds more:
        a busy worker renews late; claim it to resume), ControlError if events were
        trimmed (``max_events``) or expired before they were read.

        A run attached to this control is followed from its worker, which hands on each
        event as Redis appended it (Redis is read only for those published before): the
        same events and ids, without a read of Redis per event.
        """
        check_run_id(run_id, self.prefix)
        if after is not None:
            check_after(after)
        return self._follow(run_id, after)

class _Tagged:
    """A RedisControl that registers runs with extra info (``control.with_info(...)``)."""

    __slots__ = ("_control", "_info", "_required")

    def __init__(self, control: RedisControl, info: str, *, required: bool) -> None:
        self._control = control
        self._info = info
        self._required = required

    def run_id(self, wanted: str | None) -> str:
        return self._control.run_id(wanted)

    def attach(self, handle: RunHandle[Any]) -> asyncio.Future[None]:
        return self._control._attach(handle, self._info, required=self._required)


def _info_json(info: dict[str, str], what: str) -> str:
    for key, value in info.items():
        if not isinstance(value, str):
            raise TypeError(f"{what}({key}=...) takes strings, got {type(value).__name__}")
    return json.dumps(info, sort_keys=True) if info else ""


def _passed(seen: str | None, request_id: str) -> bool:
    """Whether the cursor ``seen`` (the last request applied) is at or past ``request_id``."""
    try:
        return seen is not None and stream_id(seen) >= stream_id(request_id)
    except ValueError:
        return False


def _check_timeout(method: str, timeout: object) -> None:
    """A ``timeout=`` is None or a finite number of seconds, 0 or more; else ValueError."""
    if timeout is not None and (not finite(timeout) or timeout < 0):
        raise ValueError(f"{method}(timeout={echo(timeout)}): give a finite number of seconds")


def _describe(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) < 300 else text[:300] + "..."
