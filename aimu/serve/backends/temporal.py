"""Runs handed to Temporal workers (``aimu serve --temporal HOST:PORT --task-queue Q``).

:class:`TemporalBackend` is a :class:`~aimu.serve.backends.base.RunsBackend` that executes
nothing here: each run is a workflow that an ``aimu worker`` executes (see
:mod:`aimu.temporal`). A pump per run follows the workflow's events into this process's
:class:`~aimu.serve.backends.run_log.RunLog`, so followers, ``Last-Event-ID`` and the web page work
as with local runs. A run that pauses for approval ends here as ``paused``; decisions
are the workflow's signals, and once every call is decided the same workflow goes on,
reported as a new run (``resumed_run_id``) that follows it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from aimu.aio._ids import is_event_number
from aimu.aio._tasks import Background
from aimu.aio.agent import Agent
from aimu.aio.approvals import Approvals
from aimu.aio.errors import ControlError, UnknownRunError
from aimu.aio.steering import Steer, Steering
from aimu.serve.backends.base import Decided, RunView, Verdict, no_cancel_error
from aimu.serve.backends.run_log import LoggedRun, RunLog
from aimu.serve.errors import (
    BadRequest,
    Conflict,
    NotFound,
    ServiceUnavailable,
    unavailable,
)

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl
    from aimu.aio.store import Store
    from aimu.temporal import RunsClient

__all__ = ["TemporalBackend"]

_log = logging.getLogger("aimu.serve")
#: Seconds between attempts to follow a run whose events could not be read.
_RETRY_SECONDS: Final = 0.5
#: How long a run another server started may take to catch up here before it is shown.
_CATCH_UP_SECONDS: Final = 10.0
#: How long a decision waits for the workflow to say "paused" after its events did.
_PAUSE_LAG_SECONDS: Final = 10.0


class TemporalBackend(RunLog):
    """Runs that Temporal workers execute, followed here (call :meth:`connect` first)."""

    def __init__(
        self,
        temporal: str,
        task_queue: str,
        store: Store,
        *,
        redis: RedisControl | None = None,
    ) -> None:
        super().__init__()
        self.temporal = temporal
        self.task_queue = task_queue
        self._store = store
        self._redis = redis
        self._client: RunsClient | None = None
        self._workflow: dict[str, tuple[str, int]] = {}
        """run id -> (its workflow, the workflow's events before this run's first)."""
        self._pumps = Background()

    async def connect(self) -> None:
        """Connect to Temporal; ``ControlConnectionError`` naming the address if it does
        not answer."""
        if self._client is None:
            from aimu.temporal import RunsClient

            self._client = await RunsClient.connect(
                self.temporal, self.task_queue, redis=self._redis
            )

    @property
    def client(self) -> RunsClient:
        if self._client is None:
            raise ServiceUnavailable("the server is not connected to Temporal yet")
        return self._client

    # -- starting ------------------------------------------------------------------------

    async def start(self, session: str, task: str | None, agent: Agent | None) -> RunView:
        if agent is not None:  # the workers open the session, not this process
            await agent.aclose()
        self.check_free(session)
        stored = await self._store.load(session)
        if task is None and not any(m["role"] == "user" for m in stored):
            raise Conflict(f"session {session!r}: nothing to resume: it has no task yet")
        with self._errors("start the run"):
            run_id = await self.client.start(session, task)
        view = RunView(run_id, session, task, created_at=time.time())
        return self._follow(view, run_id, 0, len(stored))

    def _follow(self, view: RunView, workflow: str, offset: int, before: int) -> RunView:
        view.messages_from = before
        view.asks_as = workflow  # the turns pause under the workflow's id
        self._workflow[view.run_id] = (workflow, offset)
        record = self.add(view)
        self._pumps.spawn(self._pump(record, workflow, offset))
        return view

    async def _pump(self, record: LoggedRun, workflow: str, offset: int) -> None:
        """Copy the workflow's events into ``record`` until the run ends or pauses."""
        seen = offset
        while not record.ended:
            try:
                events = self.client.events(workflow, seen, watched=record.watched)
                async for number, event in events:
                    seen = number
                    self._take(record, event)
                    if record.ended:
                        return
                return
            except (ControlError, OSError) as error:
                _log.warning("run %s: events not read from Temporal: %s", record.view.run_id, error)
                await asyncio.sleep(_RETRY_SECONDS)

    def _take(self, record: LoggedRun, event: dict[str, Any]) -> None:
        view = record.view
        if view.status == "pending":
            view.status = "running"
        kind = event.get("type")
        if kind == "run_finished":
            view.reply, view.error = event.get("reply"), event.get("error")
            view.usage = event.get("usage") or view.usage
        record.add(no_cancel_error(event))
        if kind == "run_finished" and event.get("status") == "paused":
            record.end("paused", None)
        elif kind == "handle_finished":
            record.end(str(event.get("status")), event.get("reason"), add=False)

    # -- runs another server started ----------------------------------------------------

    async def _adopt(self, run_id: str) -> None:
        """Know ``run_id`` here if Temporal does (another server process started it):
        its record follows the workflow's events, as on the server that started it. A
        resumed run's id is its workflow's, ``-r`` and the workflow's events before it."""
        if run_id in self._workflow or self._client is None:
            return
        workflow, offset = run_id, 0
        state = await self._state_of(workflow)
        head, marker, tail = run_id.rpartition("-r")
        if state is None and marker and is_event_number(tail):
            workflow, offset = head, int(tail)
            state = await self._state_of(workflow)
        if state is None or state.get("session") is None or run_id in self._workflow:
            return
        view = RunView(run_id, state["session"], None if offset else state.get("task"),
                       created_at=state.get("created_at") or time.time())
        self._follow(view, workflow, offset, await self._begins(state, workflow))
        # Answer from what had happened when asked: the pump takes those events first.
        record, known = self.record(run_id), int(state.get("event_count") or 0) - offset
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_CATCH_UP_SECONDS):
                while len(record.events) < known and not record.ended:
                    await record.changed(_CATCH_UP_SECONDS)

    async def _begins(self, state: dict[str, Any], workflow: str) -> int:
        """Where the run of ``workflow`` (its ``state``) begins in its session: the
        workflow's word once its first turn said it; before, the run's record (the turn
        writes it before the task), or (no turn began yet) the session's length now."""
        begins = state.get("messages_from")
        if isinstance(begins, int):
            return begins
        record = await self._store.run(workflow)
        if record is not None and record.messages_from is not None:
            return record.messages_from
        return len(await self._store.load(state["session"]))

    async def _state_of(self, workflow: str) -> dict[str, Any] | None:
        try:
            return await self.client.status(workflow)
        except UnknownRunError:
            return None
        except ControlError as error:
            raise unavailable(f"read run {workflow}", error) from None

    async def view(self, run_id: str) -> RunView:
        await self._adopt(run_id)
        return await super().view(run_id)

    async def check_follow(self, run_id: str, after: str | None) -> None:
        await self._adopt(run_id)
        await super().check_follow(run_id, after)

    # -- control -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        from aimu.temporal import RequestRefused

        try:
            yield
        except RequestRefused as refused:
            if refused.kind == "not_found":
                raise NotFound(str(refused)) from None
            raise Conflict(str(refused)) from None
        except UnknownRunError as error:
            raise NotFound(str(error)) from None
        except ControlError as error:
            raise unavailable(what, error) from None

    async def request(self, run_id: str, request: Steer) -> None:
        await self._adopt(run_id)
        record = self.record(run_id)
        what = "send to" if request.kind == "send" else request.kind
        if record.ended:
            raise Conflict(f"run {run_id} already ended ({record.view.status}): nothing to {what}")
        workflow = self._workflow[run_id][0]
        with self._errors(f"{what} the run"):
            try:
                steering: Steering = self.client
                live = await steering.request(workflow, request)
            except ValueError as error:  # images past what Temporal's payloads carry
                raise BadRequest(str(error)) from None
        if not live:  # ended in Temporal before this server's record heard of it
            raise Conflict(f"run {run_id} already ended: nothing to {what}")

    async def decide(self, view: RunView, verdict: Verdict) -> Decided:
        """Record the decision in the run's workflow, bound to the pause the workflow
        recorded (the worker checks it against the store before anything runs); after the
        last one the workflow resumes the run on a worker, reported as a new run."""
        workflow, _ = self._workflow[view.run_id]
        call_id, pause_id = verdict.call_id, verdict.pause_id
        await self._check_stored(view, call_id, pause_id)
        await self._paused_in_workflow(workflow)
        with self._errors("record the decision"):
            if verdict.result is not None:
                waiting = await self.client.answer(
                    workflow, call_id, verdict.result, pause_id=pause_id
                )
            elif verdict.approve:
                waiting = await self.client.approve(workflow, call_id, pause_id=pause_id)
            else:
                waiting = await self.client.deny(
                    workflow, call_id, verdict.reason, pause_id=pause_id
                )
        if waiting is None:  # no worker answered: the workflow has the decision anyway
            waiting = []
        if waiting:
            return Decided(waiting, None)
        state = await self.client.status(workflow, after=1 << 30)
        count = int(state["event_count"])
        later = RunView(f"{workflow}-r{count}", view.session, None, created_at=time.time())
        stored = await self._store.load(view.session)
        self._follow(later, workflow, count, len(stored))
        return Decided([], later.run_id)

    async def _paused_in_workflow(self, workflow: str) -> None:
        """Until the workflow's own state leaves ``running`` (bounded): the worker's
        events say "paused" a workflow task before the workflow does, and a decision sent
        on that event was refused (409 "running, not paused"). A state that cannot be
        read is left to the decision's own check."""
        deadline = time.monotonic() + _PAUSE_LAG_SECONDS
        while time.monotonic() < deadline:
            try:
                state = await self.client.status(workflow, after=1 << 30)
            except (ControlError, UnknownRunError):
                return
            if state.get("status") != "running":
                return
            await asyncio.sleep(0.02)

    async def _check_stored(self, view: RunView, call_id: str, pause_id: str | None) -> None:
        """``Conflict`` if the store's session no longer waits on ``call_id`` for this run
        (replaced meanwhile): said at once, rather than by the run failing on a worker."""
        state = await self._store.load_state(view.session)
        try:
            pending = Approvals.from_state(state, view.session).pending.get(call_id)
        except ValueError:
            return  # unreadable: the worker's turn says so
        if pending is None:
            return  # not waiting (decided, or no such call): the workflow answers that
        if view.waits_on(pending) and pause_id in (None, pending.pause_id):
            return
        raise Conflict(
            f"tool call {call_id[:64]!r} of run {view.run_id} no longer waits: session "
            f"{view.session!r} paused again since on a call of the same id; nothing was "
            "decided, look at the session again"
        )

    # -- shutting down -------------------------------------------------------------------

    async def drain(self, grace: float) -> None:
        """Nothing to drain: the runs execute in the workers (``aimu worker --drain``)."""

    async def aclose(self) -> None:
        """Stop following; the runs go on in the workers."""
        self.begin_shutdown()
        await self._pumps.aclose()
