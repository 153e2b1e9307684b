"""The worker side of a control: registers runs, publishes their events, obeys requests.

One :class:`Worker` per control, made when the first run is attached. Three tasks keep
it going: the pump (registration and event batches), the listener (a message on this
worker's channel says a run has a new request: the run re-reads its request stream,
which alone says what was asked) and the heartbeat (lease renewal, and a re-read of
every run's requests, so one whose message was missed is still found). A run waits for
its first registration before it starts, so a request sent before it started (a cancel
of a reserved run) is obeyed before it does anything. When Redis goes away the runs go
on; events wait in memory and every task retries with backoff, and on reconnection each
run is registered again and re-reads its requests.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Final

from redis.backoff import EqualJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aimu.aio._tasks import Background, cancel_and_wait
from aimu.aio.control import scripts
from aimu.aio.control.feed import Feed, Published
from aimu.aio.control.keys import check_run_id
from aimu.aio.event_json import encode_event, event_data
from aimu.aio.events import HandleFinished, RunFinished
from aimu.aio.steering import STEER_KINDS, Steer, steer

if TYPE_CHECKING:
    from aimu.aio._event_tap import EventTap
    from aimu.aio.control.link import Link
    from aimu.aio.run_handle import RunHandle

__all__ = ["REQUESTS", "Worker", "reraise_cancel", "stream_id"]

logger = logging.getLogger("aimu.control")

_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_BATCH = 256
_LINGER = 0.002
_BUFFER = 100_000
#: The retry waits while Redis is away: 25-50 ms at first, doubling up to 1-2 s.
_BACKOFF = EqualJitterBackoff(cap=2.0, base=0.025)


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``"ms-seq"``) as a tuple that compares in stream order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


#: The kinds of request a run takes from Redis (:mod:`aimu.aio.steering` applies them).
#: Each is applied once (the run's cursor skips what it saw), so a send joins the run
#: exactly once. Approvals are not here: a paused run has ended, and a decision goes to
#: its session through the store.
REQUESTS: Final = STEER_KINDS


class _Standing(enum.Enum):
    """Where an attached run stands in Redis."""

    NEW = "new"
    """Not registered yet: its first registration is on its way."""
    REGISTERED = "registered"
    AGAIN = "again"
    """Registered once, then forgotten or cut off (Redis restarted, reconnected)."""
    REJECTED = "rejected"
    """Not this worker's in Redis (held elsewhere, ended, unreachable when required):
    cancelled here, nothing more is published."""
    ENDED = "ended"
    """Its end is in Redis."""


class _AttachedRun:
    """One attached run: its unpublished events (its tap, numbered from 1 in this
    attempt: a batch re-sent is appended once), where it stands in Redis, and the feeds
    of its followers in this process."""

    __slots__ = (
        "admission",
        "cursor",
        "cursor_pending",
        "cursor_sent",
        "down",
        "feeds",
        "handle",
        "info",
        "ready",
        "required",
        "run_id",
        "session",
        "state",
        "tap",
        "usage",
        "why",
    )

    def __init__(
        self, run_id: str, handle: RunHandle[Any], info: str, required: bool, tap: EventTap
    ) -> None:
        self.run_id = run_id
        self.handle = handle
        self.tap = tap
        self.info = info
        self.required = required
        self.session = ""
        if info:
            session = json.loads(info).get("session")
            self.session = session if isinstance(session, str) else ""
        self.state = _Standing.NEW
        self.why = ""
        self.down = False
        """Refused because Redis could not be reached (a required run)."""
        self.admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Resolved after the first registration (whatever came of it): the run starts."""
        self.ready = asyncio.Event()
        """Set once Redis knows the run, or once it was rejected."""
        self.cursor = "0-0"
        """The last request applied; the next re-read starts after it."""
        self.cursor_sent = "0-0"
        """The last request the run's record in Redis says was applied."""
        self.cursor_pending = "0-0"
        self.usage = ""
        self.feeds: set[Feed] = set()
        """Each follower's in this process: handed every event as Redis appended it."""

    def detach_feeds(self) -> None:
        """Its followers here go on through Redis (the run is not published here now)."""
        for feed in list(self.feeds):
            feed.detach()

    @property
    def over(self) -> bool:
        """Nothing more is published for it: its end is written, or it was rejected."""
        return self.state in (_Standing.ENDED, _Standing.REJECTED)

    def admit(self) -> None:
        if not self.admission.done():
            self.admission.set_result(None)


class Worker:
    """The attached runs of one control and the tasks that serve them."""

    def __init__(self, link: Link) -> None:
        self._link = link
        self.runs: dict[str, _AttachedRun] = {}
        self._kick = asyncio.Event()
        self._tasks = Background()
        self._flushed = asyncio.Event()
        self._stopping = False
        self._down_since: float | None = None
        self._woken: dict[str, _AttachedRun] = {}
        """Runs whose request stream has news (a message said so), to re-read."""
        self._rereading: asyncio.Task[None] | None = None
        self._loop = asyncio.get_running_loop()
        self._main = [
            self._loop.create_task(self._pump(), name="aimu-control-pump"),
            self._loop.create_task(self._listen(), name="aimu-control-listener"),
            self._loop.create_task(self._beat(), name="aimu-control-heartbeat"),
        ]

    # -- attaching -------------------------------------------------------------------

    def attach(
        self,
        run_id: str,
        handle: RunHandle[Any],
        info: str,
        *,
        required: bool = False,
        wait: bool = True,
    ) -> asyncio.Future[None]:
        """Serve ``handle``'s run; the future it waits for before it starts (resolved at
        once unless ``wait`` or ``required``: it waits for its first registration)."""
        if run_id in self.runs and not self.runs[run_id].over:
            handle.cancel(f"run id {run_id!r} is already running in this process")
            return _admitted()
        # Redis away long, the tap keeps every event but text chunks past _BUFFER.
        run = _AttachedRun(run_id, handle, info, required,
                           handle.tap(maxsize=_BUFFER, notify=self._kick.set))
        if not (wait or required):
            run.admit()
        self.runs[run_id] = run
        handle.add_done_callback(lambda _: run.admit())
        self._kick.set()
        return run.admission

    async def registered(self, run_id: str) -> tuple[str, bool] | None:
        """Wait until Redis knows the run; None, or why it was refused and whether
        Redis was unreachable. KeyError if the run is not attached here."""
        run = self.runs[run_id]
        await run.ready.wait()
        return (run.why, run.down) if run.why else None

    def subscribe(self, run_id: str) -> Feed | None:
        """A feed of the run's events as this worker publishes them; None if it does not
        publish the run (not attached, rejected, ended, or being registered again)."""
        run = self.runs.get(run_id)
        if run is None or self._stopping or run.state not in (_Standing.NEW, _Standing.REGISTERED):
            return None
        return Feed(run.feeds)

    def _catch_up(self) -> None:
        """A batch may have been appended without its answer reaching us: every feed
        re-reads Redis before it hands on more (and, Redis away, fails as a read does)."""
        for run in self.runs.values():
            for feed in run.feeds:
                feed.catch_up()

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        self._tasks.spawn(work)

    # -- requests --------------------------------------------------------------------

    def _apply(self, run: _AttachedRun, entries: list[Any]) -> None:
        """Apply the requests in ``entries`` (``[[id, [k, v, ...]], ...]``) not yet seen.

        One the run cannot take any more (it is ending) stays unapplied, and so do the
        ones after it: the run's end records the last one applied, so the sender of a
        request the run never took is told so (``send()`` answers False).
        """
        for entry_id, flat in entries:
            if stream_id(entry_id) <= stream_id(run.cursor):
                continue
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            if not self._obey(run, fields.get("kind", ""), fields.get("data", "{}")):
                break
            run.cursor = entry_id
        if run.cursor != run.cursor_sent:
            self._kick.set()

    def _obey(self, run: _AttachedRun, kind: str, text: str) -> bool:
        """Apply one request; False if the run cannot take it any more."""
        if run.over or run.handle.done:
            return False
        if kind not in REQUESTS:
            logger.warning("run %s: skipped a %r request this aimu does not know", run.run_id, kind)
            return True
        try:
            data = json.loads(text)
            request = Steer.from_json({**(data if isinstance(data, dict) else {}), "kind": kind})
            # Only text the ending run did not take stays unapplied (its sender is told).
            return steer(run.handle, request, self.spawn) or not request.must_be_taken
        except (TypeError, ValueError) as error:  # another writer's: dropped, as applied
            logger.warning("run %s: skipped a %s request that does not check out: %s",
                           run.run_id, kind, error)
            return True

    def _reject(self, run: _AttachedRun, why: str, *, down: bool = False) -> None:
        """The run is not this worker's in Redis (or Redis is away and the run required
        it): stop it here; it never starts if it had not yet."""
        if run.state is not _Standing.REJECTED:
            run.state = _Standing.REJECTED
            run.why = why
            run.down = down
            run.tap.close()
            run.detach_feeds()
            logger.warning("run %s: %s; cancelling it in this worker", run.run_id, why)
            run.handle.cancel(why)
            run.ready.set()
            run.admit()
        if run.handle.done:
            self.runs.pop(run.run_id, None)

    # -- the pump --------------------------------------------------------------------

    async def _pump(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                await self._kick.wait()
                if all(not r.tap.ended and r.state is _Standing.REGISTERED
                       for r in self.runs.values()):
                    # Only events to send: let a few more gather (fewer, fuller batches).
                    await asyncio.sleep(_LINGER)
                self._kick.clear()
                try:
                    more = await self._flush()
                except (*_DOWN, RedisError) as error:
                    reraise_cancel()
                    failures += 1
                    self._note_down(error)
                    self._first_try_failed(error)
                    await asyncio.sleep(_BACKOFF.compute(failures))
                    self._kick.set()
                    continue
                reraise_cancel()  # a cancel redis-py took for a lost connection and retried
                failures = 0
                self._note_up()
                if more:
                    self._kick.set()
                else:
                    self._flushed.set()
        except asyncio.CancelledError:
            if not self._stopping:
                await self._flush_at_exit()
            raise

    async def _flush_at_exit(self) -> None:
        """The loop is closing with the control still open (it was never closed): warn,
        and publish the ends of the runs that finished, so none is left ``running``."""
        ending = [r for r in self.runs.values() if r.handle.done and not r.over]
        if not ending:
            return
        logger.warning(
            "RedisControl for %s was not closed before its event loop: publishing the end "
            "of %d runs now; use `async with RedisControl(...)` or `await control.aclose()`",
            self._link.url,
            len(ending),
        )
        try:
            async with asyncio.timeout(self._link.timeout):
                while any(r.handle.done and not r.over for r in self.runs.values()):
                    await self._flush()
                    await asyncio.sleep(0)  # the handles' done callbacks run in between
        except (TimeoutError, *_DOWN, RedisError, asyncio.CancelledError):
            logger.warning(
                "runs %s: their end did not reach Redis at %s before the loop closed",
                [r.run_id for r in self.runs.values() if not r.over],
                self._link.url,
            )

    def _first_try_failed(self, error: BaseException) -> None:
        """Redis could not be reached for a run's first registration: a required run is
        refused (it never starts); any other starts, and is registered when Redis is back."""
        for run in list(self.runs.values()):
            if run.state is not _Standing.NEW or run.admission.done():
                continue
            if run.required:
                self._reject(
                    run,
                    f"Redis at {self._link.url} cannot be reached ({type(error).__name__}): "
                    "the run was not started",
                    down=True,
                )
            else:
                run.admit()

    async def _flush(self) -> bool:
        """Send what is pending for every run in one pipeline; True if more is left."""
        pipe = self._link.client.pipeline(transaction=False)
        plan: list[tuple[str, _AttachedRun, list[tuple[str, str]]]] = []
        for run in list(self.runs.values()):
            if run.state is _Standing.REJECTED:
                if run.handle.done:
                    self.runs.pop(run.run_id, None)
                continue
            if run.state in (_Standing.NEW, _Standing.AGAIN):
                await self._register(pipe, run)
                plan.append(("register", run, []))
            if run.tap.held or run.cursor != run.cursor_sent:
                plan.append(await self._publish(pipe, run))
        if not plan:
            return False
        results = await _execute(pipe)
        more = False
        refused: RedisError | None = None
        for (step, run, sent), result in zip(plan, results, strict=True):
            if isinstance(result, _DOWN):
                raise result
            if isinstance(result, RedisError):
                logger.warning("run %s: Redis refused the %s step: %s", run.run_id, step, result)
                refused = result
            elif step == "register":
                self._registered(run, scripts.reply(result))
            else:
                more |= self._published(run, step, sent, scripts.reply(result))
        if refused is not None:
            raise refused  # the pump backs off before trying again
        return more or any(
            r.tap.held for r in self.runs.values() if r.state is not _Standing.REJECTED
        )

    async def _register(self, pipe: Any, run: _AttachedRun) -> None:
        link, keys = self._link, self._link.keys
        await link.scripts.register(
            keys=[
                keys.run(run.run_id),
                keys.lease(run.run_id),
                keys.runs,
                keys.requests(run.run_id),
                keys.session(run.session),
                keys.prune,
            ],
            args=[
                link.worker_id,
                link.lease_ms,
                f"{time.time():.6f}",
                run.handle.name,
                run.info,
                run.run_id,
                "1" if run.state is _Standing.NEW else "0",
                keys.base,
                scripts.PRUNE,
                link.retention_s,
            ],
            client=pipe,
        )

    async def _publish(
        self, pipe: Any, run: _AttachedRun
    ) -> tuple[str, _AttachedRun, list[tuple[str, str]]]:
        """Queue the next batch of the run's events (and its end, when it is in it); the
        step, and the batch's events encoded (numbered from ``run.tap.taken + 1``)."""
        link, keys = self._link, self._link.keys
        batch = run.tap.peek(_BATCH)
        sent = [encode_event(event) for event in batch]
        final = batch[-1] if batch and isinstance(batch[-1], HandleFinished) else None
        for event in batch:
            if isinstance(event, RunFinished):
                run.usage = json.dumps(dict(event.usage))
        args: list[str | int] = [link.worker_id, link.max_events]
        if final is not None:
            args += [final.status, final.reason or "", final.error or "", f"{time.time():.6f}"]
        else:
            args += ["", "", "", ""]
        args.append(link.retention_s)
        args.append(run.cursor if run.cursor != run.cursor_sent else "")
        if final is not None:
            args += [json.dumps(event_data(final)["result"]), run.usage]
        else:
            args += ["", ""]
        for number, (kind, data) in enumerate(sent, run.tap.taken + 1):
            args += [number, kind, data]
        await link.scripts.publish(
            keys=[
                keys.run(run.run_id),
                keys.events(run.run_id),
                keys.lease(run.run_id),
                keys.requests(run.run_id),
            ],
            args=args,
            client=pipe,
        )
        run.cursor_pending = run.cursor
        return ("final" if final is not None else "publish"), run, sent

    def _registered(self, run: _AttachedRun, result: scripts.ScriptReply) -> None:
        if result.tag != "ok":
            what = "is already held by worker" if result.tag == "busy" else "has already ended as"
            self._reject(run, f"run {run.run_id!r} {what} {result.values[0]}")
            return
        run.state = _Standing.REGISTERED
        seen, pending = result.values
        if stream_id(seen) > stream_id(run.cursor):
            run.cursor = run.cursor_sent = seen
        self._apply(run, pending)
        run.ready.set()
        run.admit()  # after the requests sent before it started: a cancel lands first

    def _published(
        self, run: _AttachedRun, step: str, sent: list[tuple[str, str]],
        result: scripts.ScriptReply,
    ) -> bool:
        if result.tag == "gone":
            run.state = _Standing.AGAIN  # Redis forgot the run: register it again, then resend
            run.detach_feeds()  # its stream starts again: followers judge that through Redis
            return True
        if result.tag != "ok":
            self._reject(run, f"run {run.run_id!r} was taken over by another worker")
            return False
        appended, added = result.values
        first = run.tap.taken + 1
        last = first + len(sent) - 1 if sent else 0
        if run.feeds and added:
            published = [
                Published(added[i + 2], int(added[i + 1]), *sent[int(added[i]) - first])
                for i in range(0, len(added), 3)
            ]
            for feed in list(run.feeds):
                feed.put(published)
        run.tap.advance(appended - run.tap.taken)
        if stream_id(run.cursor_pending) > stream_id(run.cursor_sent):
            run.cursor_sent = run.cursor_pending
        if step == "final" and appended >= last:
            run.state = _Standing.ENDED
            self.runs.pop(run.run_id, None)
            if run.tap.dropped:
                logger.warning(
                    "run %s: %d text chunks were not published while Redis was away",
                    run.run_id,
                    run.tap.dropped,
                )
        return bool(run.tap.held)

    # -- requests published to this worker ---------------------------------------------

    async def _listen(self) -> None:
        link = self._link
        channel = link.keys.channel_base + link.worker_id
        failures = 0
        while not self._stopping:
            pubsub = link.reads.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                # Subscribed: anything published from now on reaches us. What came while
                # we were away is in the request streams; registering again re-reads them.
                if failures:
                    for run in self.runs.values():
                        if run.state is _Standing.REGISTERED:
                            run.state = _Standing.AGAIN
                    self._kick.set()
                failures = 0
                while True:
                    message = await pubsub.get_message(timeout=None)
                    reraise_cancel()
                    if message is not None:
                        self._on_message(message.get("data"))
            except (*_DOWN, RedisError) as error:
                reraise_cancel()
                failures += 1
                self._note_down(error)
                await asyncio.sleep(_BACKOFF.compute(failures))
            finally:
                await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2

    def _on_message(self, payload: object) -> None:
        """A run has a new request: re-read its request stream (the message is only a
        wake-up, so a malformed or forged one changes nothing but a re-read)."""
        try:
            message = json.loads(payload) if isinstance(payload, str | bytes) else None
            run_id = message.get("run") if isinstance(message, dict) else None
            run = self.runs.get(check_run_id(run_id, self._link.keys.prefix))
        except (ValueError, TypeError):
            logger.warning("skipped a malformed message on this worker's channel: %.100r", payload)
            return
        if run is not None and not run.over:
            self._woken[run.run_id] = run
            if self._rereading is None or self._rereading.done():
                self._rereading = self._tasks.spawn(self._reread())

    async def _reread(self) -> None:
        """Apply the requests in the streams of the runs woken, after the last one each
        applied: the runs woken meanwhile in one pipeline (a cancel-all of 1,000 runs
        read each stream on a connection of its own: 1,000 opened at once)."""
        while self._woken:
            runs, self._woken = list(self._woken.values()), {}
            pipe = self._link.client.pipeline(transaction=False)
            for run in runs:
                pipe.xrange(self._link.keys.requests(run.run_id), f"({run.cursor}", "+")
            try:
                replies = await _execute(pipe)
            except (*_DOWN, RedisError):
                reraise_cancel()
                continue  # the heartbeat re-reads them
            reraise_cancel()
            for run, entries in zip(runs, replies, strict=True):
                if not isinstance(entries, BaseException) and not run.over:
                    self._apply(run, [[entry_id, _flat(fields)] for entry_id, fields in entries])

    # -- heartbeat -------------------------------------------------------------------

    async def _beat(self) -> None:
        link, keys = self._link, self._link.keys
        interval = link.lease / 3
        due = self._loop.time()
        while not self._stopping:
            # Every third of a lease from the last one due, not from when the last
            # renewal answered: a renewal that took long does not push the next later.
            due = max(due + interval, self._loop.time())
            await asyncio.sleep(due - self._loop.time())
            live = [run for run in self.runs.values() if run.state is _Standing.REGISTERED]
            if not live:
                continue
            pipe = link.client.pipeline(transaction=False)
            for run in live:
                await link.scripts.renew(
                    keys=[
                        keys.run(run.run_id),
                        keys.lease(run.run_id),
                        keys.requests(run.run_id),
                        keys.events(run.run_id),
                        keys.session(run.session),
                    ],
                    args=[link.worker_id, link.lease_ms, run.cursor, link.retention_s, run.run_id],
                    client=pipe,
                )
            try:
                results = await _execute(pipe)
            except _DOWN as error:
                reraise_cancel()
                self._note_down(error)
                continue
            reraise_cancel()
            for run, result in zip(live, results, strict=True):
                if isinstance(result, BaseException) or run.state is not _Standing.REGISTERED:
                    continue
                answer = scripts.reply(result)
                if answer.tag == "not_ours":
                    self._reject(run, f"run {run.run_id!r} was taken over by another worker")
                elif answer.tag == "gone":
                    run.state = _Standing.AGAIN  # Redis lost its record (restarted empty)
                    run.detach_feeds()
                    self._kick.set()
                elif answer.tag == "ok":
                    self._apply(run, answer.values[0])

    # -- state -----------------------------------------------------------------------

    def _note_down(self, error: BaseException) -> None:
        self._catch_up()  # each local follower reads Redis, and fails as a follower there does
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "lost Redis at %s (%s); runs go on, retrying with backoff",
                self._link.url,
                type(error).__name__,
            )

    def _note_up(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "Redis at %s is back after %.1f s",
                self._link.url,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    async def flush(self) -> None:
        """Wait until every finished run is published to the end (Redis may be away)."""
        while any(r.handle.done and r.state is not _Standing.REJECTED for r in self.runs.values()):
            self._flushed.clear()
            self._kick.set()
            await self._flushed.wait()

    async def aclose(self, timeout: float) -> None:  # noqa: ASYNC109
        """Publish what finished runs still hold (up to ``timeout`` s), then stop.

        Runs still going are left running, no longer controlled: their lease expires.
        """
        try:
            async with asyncio.timeout(timeout):
                await self.flush()
        except TimeoutError:
            logger.warning(
                "closing with %d runs not fully published to Redis at %s",
                len(self.runs),
                self._link.url,
            )
        self._stopping = True
        for run in self.runs.values():
            run.detach_feeds()
        live = [r.run_id for r in self.runs.values() if not r.handle.done]
        if live:
            logger.warning("closing while runs %s go on: they will be reported lost", live)
        # redis-py's reads can take a cancel as a lost connection and wait again (a
        # pub/sub read after a Redis restart did): one cancel is not enough to be sure.
        await cancel_and_wait({*self._main, *self._tasks.tasks}, rounds=_CANCEL_ROUNDS,
                              wait=_CANCEL_WAIT)


def _admitted() -> asyncio.Future[None]:
    admission: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    admission.set_result(None)
    return admission


async def _execute(pipe: Any) -> list[Any]:
    """Run a pipeline; its connection goes back to the pool whatever happens."""
    try:
        return list(await pipe.execute(raise_on_error=False))
    finally:
        await pipe.reset()


def _flat(fields: dict[str, str]) -> list[str]:
    """A stream entry's fields as XRANGE answers them inside a script: ``[k, v, ...]``."""
    return [item for pair in fields.items() for item in pair]


_CANCEL_ROUNDS = 20
_CANCEL_WAIT = 0.5


def reraise_cancel() -> None:
    """redis-py may report a cancel of its read as a connection error, or retry the
    command and answer normally: never swallow it (a task cancelled stays cancelled)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
