"""Runs handed to Temporal workers (``aimu serve --temporal HOST:PORT --task-queue Q``).

:class:`TemporalRuns` answers the same runs API as :class:`LocalRuns`, but executes
nothing here: each run is a workflow that an ``aimu worker`` executes (see
:mod:`aimu.temporal`). A pump per run follows the workflow's events into the run's
record, so followers, ``Last-Event-ID`` and the web page work as with local runs. A run
that pauses for approval ends here as ``paused``; once every call is decided the same
workflow goes on, reported as a new run (``resumed_run_id``) that follows it from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any, Final

from aimu.aio.errors import ControlError, UnknownRunError
from aimu.serve.errors import Conflict, NotFound, ServiceUnavailable
from aimu.serve.runs import AgentFactory, LocalRuns, RunRecord, check_grace

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl
    from aimu.aio.store import Store
    from aimu.temporal import RunsClient

__all__ = ["TemporalRuns"]

_log = logging.getLogger("aimu.serve")
#: Seconds between attempts to follow a run whose events could not be read.
_RETRY_SECONDS: Final = 0.5


class TemporalRuns(LocalRuns):
    """The runs API over runs that Temporal workers execute (call :meth:`connect` first)."""

    def __init__(
        self,
        agents: AgentFactory,
        store: Store,
        temporal: str,
        task_queue: str,
        *,
        redis: RedisControl | None = None,
    ) -> None:
        super().__init__(agents, store)
        self.temporal = temporal
        self.task_queue = task_queue
        self._redis = redis
        self._client: RunsClient | None = None
        self._workflow: dict[str, tuple[str, int]] = {}
        """run id -> (its workflow, the workflow's events before this run's first)."""
        self._pumps: set[asyncio.Task[None]] = set()

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

    async def start(self, session: str, task: str | None) -> RunRecord:
        self._check_startable(session)
        stored = await self.store.load(session)
        if task is None and not any(m["role"] == "user" for m in stored):
            raise Conflict(f"session {session!r}: nothing to resume: it has no task yet")
        with self._errors("start the run"):
            run_id = await self.client.start(session, task)
        return self._follow(RunRecord(run_id, session, task), run_id, 0, len(stored))

    def _follow(self, record: RunRecord, workflow: str, offset: int, before: int) -> RunRecord:
        record.messages_from = before
        self._workflow[record.run_id] = (workflow, offset)
        self._active[record.session] = record.run_id
        self._runs[record.run_id] = record
        self._forget_old()
        pump = asyncio.get_running_loop().create_task(self._pump(record, workflow, offset))
        self._pumps.add(pump)
        pump.add_done_callback(self._pumps.discard)
        return record

    async def _pump(self, record: RunRecord, workflow: str, offset: int) -> None:
        """Copy the workflow's events into ``record`` until the run ends or pauses."""
        seen = offset
        while not record.ended:
            try:
                async for number, event in self.client.events(workflow, seen):
                    seen = number
                    self._take(record, event)
                    if record.ended:
                        return
                return
            except (ControlError, OSError) as error:
                _log.warning("run %s: events not read from Temporal: %s", record.run_id, error)
                await asyncio.sleep(_RETRY_SECONDS)

    def _take(self, record: RunRecord, event: dict[str, Any]) -> None:
        if record.status == "pending":
            record.status = "running"
        kind = event.get("type")
        if kind == "run_finished":
            record.reply, record.error = event.get("reply"), event.get("error")
            record.usage = event.get("usage") or record.usage
        record.add(event)
        if kind == "run_finished" and event.get("status") == "paused":
            self._end(record, "paused", None)
        elif kind == "handle_finished":
            record.reason = event.get("reason")
            self._end(record, str(event.get("status")), None, add=False)

    def _end(self, record: RunRecord, status: str, reason: str | None, add: bool = True) -> None:
        record.status = status
        record.finished_at = time.time()
        if self._active.get(record.session) == record.run_id:
            del self._active[record.session]
        if add:
            record.add({"type": "handle_finished", "name": f"run {record.run_id}",
                        "status": status, "reason": reason, "result": record.reply,
                        "error": record.error})
        record.ended = True
        record.wake()

    # -- control -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _errors(self, what: str) -> Any:
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
            raise ServiceUnavailable(f"cannot {what}: {error}") from None

    def _running(self, run_id: str, what: str) -> str:
        record = self.get(run_id)
        if record.ended:
            raise Conflict(f"run {run_id} already ended ({record.status}): nothing to {what}")
        return self._workflow[run_id][0]

    async def cancel(self, run_id: str, reason: str | None) -> dict[str, Any]:
        workflow = self._running(run_id, "cancel")
        with self._errors("cancel the run"):
            await self.client.cancel(workflow, reason or "cancelled over HTTP")
        return self.get(run_id).public()

    async def interrupt(self, run_id: str) -> dict[str, Any]:
        workflow = self._running(run_id, "interrupt")
        with self._errors("interrupt the run"):
            await self.client.interrupt(workflow)
        return self.get(run_id).public()

    async def stop(self, run_id: str, grace: float) -> dict[str, Any]:
        workflow = self._running(run_id, "stop")
        with self._errors("stop the run"):
            await self.client.request_stop(workflow, check_grace(grace))
        return self.get(run_id).public()

    async def send(self, run_id: str, text: str) -> dict[str, Any]:
        workflow = self._running(run_id, "send to")
        with self._errors("send to the run"):
            await self.client.send(workflow, text)
        return self.get(run_id).public()

    async def decide(
        self, run_id: str, call_id: str, approve: bool, reason: str | None
    ) -> dict[str, Any]:
        """Record the decision in the run's workflow; after the last one the workflow
        resumes the run on a worker, reported as a new run following it."""
        self._check_open()
        record = await self._paused(run_id)
        workflow, _ = self._workflow[run_id]
        with self._errors("record the decision"):
            if approve:
                waiting = await self.client.approve(workflow, call_id)
            else:
                waiting = await self.client.deny(workflow, call_id, reason)
        resumed = None
        if waiting is None:  # no worker answered: the workflow has the decision anyway
            waiting = []
        if not waiting:
            state = await self.client.status(workflow, after=1 << 30)
            later = RunRecord(f"{workflow}-{state['event_count']}", record.session, None)
            stored = await self.store.load(record.session)
            self._follow(later, workflow, int(state["event_count"]), len(stored))
            resumed = record.resumed_run_id = later.run_id
        return {
            "run_id": run_id,
            "call_id": call_id,
            "approve": approve,
            "pending": waiting,
            "resumed_run_id": resumed,
        }

    # -- shutting down -------------------------------------------------------------------

    async def aclose(self) -> None:
        """Stop following; the runs go on in the workers."""
        self._closed = True
        self.begin_shutdown()
        pumps = list(self._pumps)
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, *self._background, return_exceptions=True)

