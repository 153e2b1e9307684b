"""Runs shared by several server processes through Redis (``aimu serve --redis``).

:class:`SharedRuns` executes the runs started here like :class:`LocalRuns`, and also
registers them with a :class:`~aimu.aio.RedisControl`; every process on the same Redis
(and the same store) then reports, follows, cancels, interrupts and stops any run, wherever
it executes. Event ids are the Redis stream's, the same in every process, so a follower
can reconnect to any of them with ``Last-Event-ID``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, Final

from aimu.aio.errors import ControlError, UnknownRunError
from aimu.aio.run_handle import RunHandle
from aimu.serve.errors import BadRequest, Conflict, NotFound, ServiceUnavailable
from aimu.serve.ids import check_run_id, stream_id
from aimu.serve.runs import (
    KEEPALIVE_SECONDS,
    AgentFactory,
    Batch,
    JSONEvent,
    LocalRuns,
    RunRecord,
    check_grace,
    no_cancel_error,
)

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl, RunInfo
    from aimu.aio.store import Store

__all__ = ["SharedRuns"]

_LIVE: Final = frozenset({"pending", "running"})


class SharedRuns(LocalRuns):
    """Local runs registered with ``control``; any run on the same Redis is reachable."""

    def __init__(self, agents: AgentFactory, store: Store, control: RedisControl) -> None:
        super().__init__(agents, store)
        self.control = control

    # -- starting ----------------------------------------------------------------

    def _start_handle(self, run: Coroutine[Any, Any, str], record: RunRecord) -> RunHandle[str]:
        tagged = self.control.with_info(
            session=record.session,
            task="" if record.task is None else record.task,
            resume="1" if record.task is None else "",
            messages_from=str(record.messages_from),
        )
        handle = RunHandle.start(run, control=tagged)
        assert handle.run_id is not None
        record.run_id = handle.run_id
        return handle

    async def _started(self, handle: RunHandle[str]) -> None:
        # Every process must find the run before its id is handed out.
        with self._control_errors("register the run"):
            await self.control.registered(handle)

    @contextlib.contextmanager
    def _control_errors(self, what: str, run_id: str | None = None) -> Any:
        try:
            yield
        except UnknownRunError:
            raise NotFound(f"no run {run_id!r} on any server sharing this Redis") from None
        except ControlError as error:
            raise ServiceUnavailable(f"cannot {what}: {error}") from None

    # -- reading -------------------------------------------------------------------

    async def _info(self, run_id: str) -> RunInfo:
        check_run_id(run_id)
        with self._control_errors("read the run", run_id):
            return await self.control.status(run_id)

    async def public(self, run_id: str) -> dict[str, Any]:
        if run_id in self._runs:
            return await self._public(self._runs[run_id])
        return await self._public(_record(await self._info(run_id)))

    async def session_run(self, session: str) -> RunRecord | None:
        here = await super().session_run(session)
        if here is not None:
            return here
        for info in await self._live_elsewhere():
            if info.info.get("session") == session:
                return _record(info)
        return None

    async def session_runs(self) -> dict[str, str]:
        running = {
            info.info["session"]: info.run_id
            for info in await self._live_elsewhere()
            if "session" in info.info
        }
        running.update(await super().session_runs())
        return running

    async def _live_elsewhere(self) -> list[RunInfo]:
        with self._control_errors("list the runs"):
            return [info for info in await self.control.runs() if info.status in _LIVE]

    async def check_follow(self, run_id: str, after: str | None) -> None:
        await self._at_end(run_id, after)

    async def _at_end(self, run_id: str, after: str | None) -> bool:
        """True if ``after`` is the last event of a finished run (nothing to follow);
        ``BadRequest`` if it is past that event (an id this run never sent)."""
        info = await self._info(run_id)
        start = stream_id(after)
        if start is None or not info.done:
            return False
        with self._control_errors("read the run's events", run_id):
            last = await self.control.last_event_id(run_id)
        if last is not None and _stream_order(start) <= _stream_order(last):
            return start == last
        raise BadRequest(f"Last-Event-ID {start!r} is past the last event of run {run_id}")

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events through Redis, wherever it runs; keep-alives while idle."""
        if after and await self._at_end(run_id, after):
            return
        events = self.control.events(run_id, stream_id(after))
        closing = asyncio.ensure_future(self._closing.wait())
        pending: asyncio.Task[Any] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(_next(events))
                done, _ = await asyncio.wait(
                    (pending, closing),
                    timeout=KEEPALIVE_SECONDS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if closing in done:
                    return  # the server shuts down: the follower reconnects elsewhere
                if pending not in done:
                    yield []
                    continue
                step, pending = pending, None
                try:
                    event = step.result()
                except ControlError as error:  # lost, expired: say so, then end
                    yield [("", {"type": "error", "error": str(error)})]
                    return
                if event is None:
                    return
                data: JSONEvent = json.loads(event.data)
                yield [(event.id, no_cancel_error(data))]
        finally:
            closing.cancel()
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, ControlError):
                    await pending
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()

    # -- control -------------------------------------------------------------------

    async def cancel(self, run_id: str, reason: str | None) -> dict[str, Any]:
        if self._here_and_live(run_id):
            return await super().cancel(run_id, reason)
        reason = reason or "cancelled over HTTP"
        await self._request(run_id, "cancel", lambda: self.control.cancel(run_id, reason))
        return await self.public(run_id)

    async def interrupt(self, run_id: str) -> dict[str, Any]:
        if self._here_and_live(run_id):
            return await super().interrupt(run_id)
        await self._request(run_id, "interrupt", lambda: self.control.interrupt(run_id))
        return await self.public(run_id)

    async def stop(self, run_id: str, grace: float) -> dict[str, Any]:
        if self._here_and_live(run_id):
            return await super().stop(run_id, grace)
        check_grace(grace)
        info = await self._info(run_id)
        if info.status not in _LIVE:
            raise Conflict(f"run {run_id} already ended ({info.status}): nothing to stop")
        self._spawn(self._stop_elsewhere(run_id, grace))
        return _public(info)

    async def _stop_elsewhere(self, run_id: str, grace: float) -> None:
        with contextlib.suppress(ControlError, TimeoutError):  # the run's end reports itself
            await self.control.stop(run_id, grace)

    async def send(self, run_id: str, text: str) -> dict[str, Any]:
        if run_id in self._runs:
            return await super().send(run_id, text)
        await self._request(run_id, "send to", lambda: self.control.send(run_id, text))
        return await self.public(run_id)

    async def _paused(self, run_id: str) -> RunRecord:
        """The paused run, whichever process ran it (its session is in the shared store)."""
        if run_id in self._runs:
            return await super()._paused(run_id)
        record = _record(await self._info(run_id))
        if record.status != "paused":
            raise Conflict(
                f"run {run_id} is {record.status}, not paused: no tool call awaits a decision"
            )
        return record

    async def _latest_run(self, session: str) -> RunRecord | None:
        with self._control_errors("list the runs"):
            runs = [i for i in await self.control.runs() if i.info.get("session") == session]
        if not runs:
            return await super()._latest_run(session)
        latest = max(runs, key=lambda info: info.created_at or 0.0)
        return self._runs.get(latest.run_id) or _record(latest)

    async def _later_run(self, record: RunRecord) -> str | None:
        here = await super()._later_run(record)
        if here is not None:
            return here
        with self._control_errors("list the runs"):
            runs = await self.control.runs()
        later = [
            info.run_id for info in runs
            if info.info.get("session") == record.session
            and info.run_id != record.run_id
            and (info.created_at or 0.0) > record.created_at
        ]
        return later[-1] if later else None

    def _here_and_live(self, run_id: str) -> bool:
        record = self._runs.get(run_id)
        return record is not None and not record.ended

    async def _request(
        self, run_id: str, what: str, request: Callable[[], Awaitable[bool]]
    ) -> None:
        """Send ``request()`` for ``run_id`` (made only once the id is checked)."""
        check_run_id(run_id)
        with self._control_errors(what, run_id):
            accepted = await request()
        if not accepted:
            info = await self._info(run_id)
            raise Conflict(f"run {run_id} already ended ({info.status}): nothing to {what}")


async def _next(events: AsyncIterator[Any]) -> Any:
    return await anext(events, None)


def _stream_order(event_id: str) -> tuple[int, int]:
    ms, _, seq = event_id.partition("-")
    return int(ms), int(seq)


def _record(info: RunInfo) -> RunRecord:
    """A record of a run executing elsewhere, from what Redis knows of it."""
    extra = info.info
    record = RunRecord(
        info.run_id,
        extra.get("session", ""),
        None if extra.get("resume") else extra.get("task"),
        status=info.status,
        created_at=info.created_at or 0.0,
        finished_at=info.ended_at,
        reason=info.reason,
        error=info.error,
    )
    record.messages_from = int(extra.get("messages_from") or 0)
    record.remote = True
    record.event_count = info.events
    return record


def _public(info: RunInfo) -> dict[str, Any]:
    return _record(info).public()
