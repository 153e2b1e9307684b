"""The worker side of a control: registers runs, publishes their events, obeys requests.

One :class:`Worker` per control, made when the first run is attached. Three tasks keep
it going: the pump (registration and event batches), the listener (requests published
to this worker's channel) and the heartbeat (lease renewal, and a re-read of every
run's durable requests, so one whose message was missed is still found). When Redis
goes away the runs go on; events wait in memory and every task retries with backoff,
and on reconnection each run is registered again and re-reads its requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from aimu.aio.control import scripts
from aimu.aio.control.codec import encode_event
from aimu.aio.events import Event, HandleFinished, TextChunk, ThinkingChunk

if TYPE_CHECKING:
    from aimu.aio.control.redis_control import RedisControl
    from aimu.aio.run_handle import EventStream, RunHandle

__all__ = ["REQUESTS", "Worker", "stream_id"]

logger = logging.getLogger("aimu.control")

_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_BATCH = 256
_LINGER = 0.002
_BUFFER = 100_000
_BACKOFF_FIRST = 0.05
_BACKOFF_CAP = 2.0


def stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``"ms-seq"``) as a tuple that compares in stream order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _cancel(worker: Worker, handle: RunHandle[Any], data: dict[str, Any]) -> None:
    reason = data.get("reason")
    handle.cancel(reason if isinstance(reason, str) else None)


def _interrupt(worker: Worker, handle: RunHandle[Any], data: dict[str, Any]) -> None:
    handle.interrupt()


def _stop(worker: Worker, handle: RunHandle[Any], data: dict[str, Any]) -> None:
    grace = data.get("grace")
    worker.spawn(handle.stop(float(grace) if isinstance(grace, int | float) else 5.0))


def _send(worker: Worker, handle: RunHandle[Any], data: dict[str, Any]) -> None:
    text = data.get("text")
    if isinstance(text, str):
        handle.send(text)


#: What a request of each kind does to the run. A kind this table lacks (sent by a
#: newer aimu) is logged and skipped. Each request is applied once (the run's cursor
#: skips what it saw), so a send joins the run exactly once. Approvals are not here:
#: a paused run has ended, and a decision goes to its session through the store.
REQUESTS: dict[str, Callable[[Worker, RunHandle[Any], dict[str, Any]], None]] = {
    "cancel": _cancel,
    "interrupt": _interrupt,
    "stop": _stop,
    "send": _send,
}


class _Run:
    """One attached run: its unpublished events and where it stands in Redis."""

    __slots__ = (
        "cursor",
        "cursor_pending",
        "cursor_sent",
        "dropped",
        "ended",
        "final",
        "final_stream",
        "handle",
        "info",
        "next_number",
        "queue",
        "ready",
        "registered",
        "rejected",
        "rejected_why",
        "remove_listener",
        "run_id",
        "was_registered",
    )

    def __init__(self, run_id: str, handle: RunHandle[Any], info: str) -> None:
        self.run_id = run_id
        self.handle = handle
        self.info = info
        self.queue: deque[tuple[int, str, str]] = deque()
        self.next_number = 1
        self.registered = False
        self.was_registered = False
        self.rejected = False
        self.rejected_why = ""
        self.ready = asyncio.Event()
        """Set once Redis knows the run, or once it was rejected."""
        self.cursor = "0-0"
        """The last request applied; the next re-read starts after it."""
        self.cursor_sent = "0-0"
        """The last request the run's record in Redis says was applied."""
        self.cursor_pending = "0-0"
        self.final_stream: EventStream | None = None
        self.final: HandleFinished | None = None
        self.ended = False
        """The terminal batch was written."""
        self.dropped = 0
        self.remove_listener: Callable[[], None] | None = None


class Worker:
    """The attached runs of one :class:`RedisControl` and the tasks that serve them."""

    def __init__(self, control: RedisControl) -> None:
        self._control = control
        self._client = control._client
        self._keys = control._keys
        self._scripts = control._scripts
        self.runs: dict[str, _Run] = {}
        self._kick = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._flushed = asyncio.Event()
        self._stopping = False
        self._down_since: float | None = None
        self._loop = asyncio.get_running_loop()
        self._main = [
            self._loop.create_task(self._pump(), name="aimu-control-pump"),
            self._loop.create_task(self._listen(), name="aimu-control-listener"),
            self._loop.create_task(self._beat(), name="aimu-control-heartbeat"),
        ]

    # -- attaching -------------------------------------------------------------------

    def attach(self, run_id: str, handle: RunHandle[Any], info: str) -> None:
        if run_id in self.runs and not self.runs[run_id].ended:
            handle.cancel(f"run id {run_id!r} is already running in this process")
            return
        run = _Run(run_id, handle, info)
        self.runs[run_id] = run
        run.remove_listener = handle.scope.add_listener(lambda event: self._on_event(run, event))
        handle.add_done_callback(lambda _: self._on_done(run))
        self._kick.set()

    def _on_event(self, run: _Run, event: Event) -> None:
        if run.rejected:
            return
        if len(run.queue) >= _BUFFER and isinstance(event, TextChunk | ThinkingChunk):
            run.dropped += 1  # Redis has been away long: keep every event but chunks
            return
        kind, data = encode_event(event)
        run.queue.append((run.next_number, kind, data))
        run.next_number += 1
        self._kick.set()

    def _on_done(self, run: _Run) -> None:
        if run.remove_listener is not None:
            run.remove_listener()
            run.remove_listener = None
        run.final_stream = run.handle.events()  # holds just the terminal event
        self._kick.set()

    async def registered(self, run_id: str) -> str | None:
        """Wait until Redis knows the run; None, or why it was refused. KeyError if unknown."""
        run = self.runs[run_id]
        await run.ready.wait()
        return run.rejected_why or None

    def spawn(self, work: Any) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- requests --------------------------------------------------------------------

    def _apply(self, run: _Run, entries: list[Any]) -> None:
        """Apply the requests in ``entries`` (``[[id, [k, v, ...]], ...]``) not yet seen."""
        for entry_id, flat in entries:
            if stream_id(entry_id) <= stream_id(run.cursor):
                continue
            run.cursor = entry_id
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            self._obey(run, fields.get("kind", ""), fields.get("data", "{}"))
        if run.cursor != run.cursor_sent:
            self._kick.set()

    def _obey(self, run: _Run, kind: str, text: str) -> None:
        if run.ended or run.handle.done:
            return
        action = REQUESTS.get(kind)
        if action is None:
            logger.warning("run %s: skipped a %r request this aimu does not know", run.run_id, kind)
            return
        try:
            data = json.loads(text)
        except ValueError:
            data = {}
        action(self, run.handle, data if isinstance(data, dict) else {})

    def _reject(self, run: _Run, why: str) -> None:
        """The run is not this worker's in Redis (claimed elsewhere): stop it here."""
        if not run.rejected:
            run.rejected = True
            run.rejected_why = why
            run.ready.set()
            run.queue.clear()
            logger.warning("run %s: %s; cancelling it in this worker", run.run_id, why)
            run.handle.cancel(why)
        run.ended = True
        if run.handle.done:
            self.runs.pop(run.run_id, None)

    # -- the pump --------------------------------------------------------------------

    async def _pump(self) -> None:
        failures = 0
        while not self._stopping:
            await self._kick.wait()
            if not any(r.final_stream or not r.registered for r in self.runs.values()):
                # Only events to send: let a few more gather (fewer, fuller batches).
                await asyncio.sleep(_LINGER)
            self._kick.clear()
            try:
                more = await self._flush()
            except (*_DOWN, RedisError) as error:
                _reraise_cancel()
                failures += 1
                self._note_down(error)
                await asyncio.sleep(_backoff(failures))
                self._kick.set()
                continue
            failures = 0
            self._note_up()
            if more:
                self._kick.set()
            else:
                self._flushed.set()

    async def _flush(self) -> bool:
        """Send what is pending for every run in one pipeline; True if more is left."""
        pipe = self._client.pipeline(transaction=False)
        plan: list[tuple[str, _Run, int]] = []
        for run in list(self.runs.values()):
            if run.rejected:
                if run.handle.done:
                    self.runs.pop(run.run_id, None)
                continue
            if run.final_stream is not None and run.final is None:
                await self._take_final(run)
            if not run.registered:
                await self._register(pipe, run)
                plan.append(("register", run, 0))
            if run.queue or run.cursor != run.cursor_sent:
                plan.append(await self._publish(pipe, run))
        if not plan:
            return False
        results = await _execute(pipe)
        more = False
        refused: RedisError | None = None
        for (step, run, last), result in zip(plan, results, strict=True):
            if isinstance(result, _DOWN):
                raise result
            if isinstance(result, RedisError):
                logger.warning("run %s: Redis refused the %s step: %s", run.run_id, step, result)
                refused = result
            elif step == "register":
                self._registered(run, result)
            else:
                more |= self._published(run, step, last, int(result))
        if refused is not None:
            raise refused  # the pump backs off before trying again
        return more or any(r.queue or r.final_stream for r in self.runs.values() if not r.rejected)

    async def _take_final(self, run: _Run) -> None:
        """Queue the run's terminal event (its handle has ended)."""
        assert run.final_stream is not None
        final = await anext(run.final_stream)
        assert isinstance(final, HandleFinished)
        run.final = final
        run.final_stream = None
        kind, data = encode_event(final)
        run.queue.append((run.next_number, kind, data))
        run.next_number += 1

    async def _register(self, pipe: Any, run: _Run) -> None:
        control, keys = self._control, self._keys
        await self._scripts.register(
            keys=[
                keys.run(run.run_id),
                keys.lease(run.run_id),
                keys.runs,
                keys.requests(run.run_id),
            ],
            args=[
                control.worker_id,
                int(control.lease * 1000),
                f"{time.time():.6f}",
                run.handle.name,
                run.info,
                run.run_id,
                "0" if run.was_registered else "1",
                keys.run(""),
                scripts.PRUNE,
            ],
            client=pipe,
        )

    async def _publish(self, pipe: Any, run: _Run) -> tuple[str, _Run, int]:
        """Queue the next batch of the run's events (and its end, when it is in it)."""
        control, keys = self._control, self._keys
        batch = [run.queue[i] for i in range(min(len(run.queue), _BATCH))]
        last = batch[-1][0] if batch else 0
        final = run.final if run.final is not None and last == run.next_number - 1 else None
        args: list[str | int] = [control.worker_id, control.max_events]
        if final is not None:
            ended_at = f"{time.time():.6f}"
            args += [final.status, final.reason or "", final.error or "", ended_at]
            args.append(max(1, round(control.retention)))  # EXPIRE takes whole seconds
        else:
            args += ["", "", "", "", 0]
        args.append(run.cursor if run.cursor != run.cursor_sent else "")
        for number, kind, data in batch:
            args += [number, kind, data]
        await self._scripts.publish(
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
        return ("final" if final is not None else "publish"), run, last

    def _registered(self, run: _Run, result: list[Any]) -> None:
        if result[0] != "ok":
            what = "is already held by worker" if result[0] == "busy" else "has already ended as"
            self._reject(run, f"run {run.run_id!r} {what} {result[1]}")
            return
        run.registered = run.was_registered = True
        run.ready.set()
        seen = result[1]
        if stream_id(seen) > stream_id(run.cursor):
            run.cursor = run.cursor_sent = seen
        self._apply(run, result[2])

    def _published(self, run: _Run, step: str, last: int, result: int) -> bool:
        if result == -2:
            run.registered = False  # Redis forgot the run: register it again, then resend
            return True
        if result < 0:
            self._reject(run, f"run {run.run_id!r} was taken over by another worker")
            return False
        while run.queue and run.queue[0][0] <= result:
            run.queue.popleft()
        if stream_id(run.cursor_pending) > stream_id(run.cursor_sent):
            run.cursor_sent = run.cursor_pending
        if step == "final" and result >= last:
            run.ended = True
            self.runs.pop(run.run_id, None)
            if run.dropped:
                logger.warning(
                    "run %s: %d text chunks were not published while Redis was away",
                    run.run_id,
                    run.dropped,
                )
        return bool(run.queue)

    # -- requests published to this worker ---------------------------------------------

    async def _listen(self) -> None:
        channel = self._keys.channel_base + self._control.worker_id
        failures = 0
        while not self._stopping:
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                # Subscribed: anything published from now on reaches us. What came while
                # we were away is in the request streams; registering again re-reads them.
                if failures:
                    for run in self.runs.values():
                        run.registered = False
                    self._kick.set()
                failures = 0
                while True:
                    message = await pubsub.get_message(timeout=None)
                    if message is not None:
                        self._on_message(message.get("data"))
            except (*_DOWN, RedisError) as error:
                _reraise_cancel()
                failures += 1
                self._note_down(error)
                await asyncio.sleep(_backoff(failures))
            finally:
                await asyncio.shield(pubsub.aclose())  # type: ignore[no-untyped-call]

    def _on_message(self, payload: object) -> None:
        try:
            message = json.loads(payload) if isinstance(payload, str) else None
            run = self.runs.get(message["run"]) if isinstance(message, dict) else None
        except (ValueError, KeyError, TypeError):
            return
        if run is None or not isinstance(message, dict):
            return
        self._apply(run, [[message["id"], ["kind", message["kind"], "data", message["data"]]]])

    # -- heartbeat -------------------------------------------------------------------

    async def _beat(self) -> None:
        interval = self._control.lease / 3
        while not self._stopping:
            await asyncio.sleep(interval)
            live = [run for run in self.runs.values() if run.registered and not run.ended]
            if not live:
                continue
            pipe = self._client.pipeline(transaction=False)
            keys = self._keys
            for run in live:
                await self._scripts.renew(
                    keys=[keys.run(run.run_id), keys.lease(run.run_id), keys.requests(run.run_id)],
                    args=[self._control.worker_id, int(self._control.lease * 1000), run.cursor],
                    client=pipe,
                )
            try:
                results = await _execute(pipe)
            except _DOWN as error:
                _reraise_cancel()
                self._note_down(error)
                continue
            for run, result in zip(live, results, strict=True):
                if isinstance(result, BaseException) or run.ended or result[0] == 3:
                    continue
                if result[0] == 0:
                    self._reject(run, f"run {run.run_id!r} was taken over by another worker")
                elif result[0] == 2:
                    run.registered = False  # Redis lost its record (restarted empty)
                    self._kick.set()
                else:
                    self._apply(run, result[1])

    # -- state -----------------------------------------------------------------------

    def _note_down(self, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            logger.warning(
                "lost Redis at %s (%s); runs go on, retrying with backoff",
                self._control.url,
                type(error).__name__,
            )

    def _note_up(self) -> None:
        if self._down_since is not None:
            logger.warning(
                "Redis at %s is back after %.1f s",
                self._control.url,
                time.monotonic() - self._down_since,
            )
            self._down_since = None

    async def flush(self) -> None:
        """Wait until every finished run is published to the end (Redis may be away)."""
        while any(r.handle.done and not r.rejected for r in self.runs.values()):
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
                self._control.url,
            )
        self._stopping = True
        live = [r.run_id for r in self.runs.values() if not r.handle.done]
        if live:
            logger.warning("closing while runs %s go on: they will be reported lost", live)
        await _cancel_all({*self._main, *self._tasks})


async def _cancel_all(tasks: set[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until they end, cancelling again any that go on.

    redis-py's reads can take a cancel as a lost connection and wait again (a pub/sub
    read after a Redis restart did): one cancel is not enough to be sure.
    """
    pending = {task for task in tasks if not task.done()}
    for _ in range(_CANCEL_ROUNDS):
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_CANCEL_WAIT)
    if pending:
        names = sorted(task.get_name() for task in pending)
        logger.warning("closing: tasks %s did not end when cancelled", names)
    for task in tasks - pending:
        if not task.cancelled():
            task.exception()  # retrieved: a task that failed is not reported again at exit


async def _execute(pipe: Any) -> list[Any]:
    """Run a pipeline; its connection goes back to the pool whatever happens."""
    try:
        return list(await pipe.execute(raise_on_error=False))
    finally:
        await pipe.reset()


_CANCEL_ROUNDS = 20
_CANCEL_WAIT = 0.5


def _reraise_cancel() -> None:
    """redis-py may report a cancel of its read as a connection error: never swallow it."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _backoff(failures: int) -> float:
    delay: float = min(_BACKOFF_CAP, _BACKOFF_FIRST * 2 ** (failures - 1))
    return delay * (0.5 + random.random() / 2)
