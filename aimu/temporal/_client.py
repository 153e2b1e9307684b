"""RunsClient: start aimu runs on Temporal workers and steer them by run id, from anywhere.

A run is one Temporal workflow whose id is the run id. Every request is recorded in
Temporal before the call returns (a signal, an update or a cancel request), so it
reaches the run whichever worker executes it, now or after a retry. With a
:class:`~aimu.aio.RedisControl` on the same Redis as the workers, a cancel also goes
through Redis and lands in milliseconds; Temporal's cancel follows it either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Final

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from aimu.aio._ids import new_run_id
from aimu.aio.ends import FINAL
from aimu.aio.errors import ControlError, UnknownRunError
from aimu.aio.steering import Steer
from aimu.temporal._connect import connect
from aimu.temporal._workflow import (
    HISTORY_EVENTS,
    MAX_SENT_IMAGE_CHARS,
    STATE_QUERY,
    WORKFLOW,
    CallDecision,
    RunRequest,
)

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl

__all__ = ["RequestRefused", "RunsClient"]

_CLOSED: Final = {
    WorkflowExecutionStatus.COMPLETED: "completed",
    WorkflowExecutionStatus.CANCELED: "cancelled",
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.TERMINATED: "cancelled",
    WorkflowExecutionStatus.TIMED_OUT: "timed_out",
}
#: How long a query waits for a worker to answer before the client goes without.
QUERY_SECONDS: Final = 3.0
#: How long Temporal may take to start a run before the start counts as failed (an
#: overloaded server: the caller is told to try again).
START_SECONDS: Final = 10.0
#: Starts one client has in flight at Temporal at once; the others wait their turn before
#: their START_SECONDS begin (1,000 at once through aimu serve on a loaded machine: 725
#: were not answered within 10 s and were refused 503).
STARTS: Final = 32
#: How often :meth:`RunsClient.events` asks for new events: while the run is starting or
#: its events came in the last ``POLL_QUIET_SECONDS``, then at most (a run that stays
#: quiet, or paused, is asked less and less often, down to the second figure).
POLL_SECONDS: Final = (0.1, 1.0)
POLL_QUIET_SECONDS: Final = 3.0
#: The event reads (queries a worker answers) one client's followers make per second at
#: most, together: with many runs followed, each is asked less often than POLL_SECONDS.
EVENT_QUERIES: Final = 100.0


class RequestRefused(ControlError):
    """The run refused the request (it is not paused, the call is decided, it ended)."""

    def __init__(self, message: str, *, url: str, kind: str) -> None:
        super().__init__(message, url=url)
        self.kind = kind
        """``conflict`` (the run's state does not allow it) or ``not_found``."""


class RunsClient:
    """Start, follow and stop aimu runs executed by :class:`AgentWorker` processes.

    ``await RunsClient.connect("127.0.0.1:7233", task_queue="agents")``; every method
    takes the run id :meth:`start` returned. ``redis`` (a RedisControl on the workers'
    Redis and prefix) makes cancels land at once. A run continues as new in Temporal
    (same run id) once its history holds ``history_events`` events, or when Temporal
    suggests it (0: only then).
    """

    def __init__(
        self,
        client: Client,
        task_queue: str,
        *,
        address: str = "temporal",
        redis: RedisControl | None = None,
        heartbeat_timeout: float = 10.0,
        history_events: int = HISTORY_EVENTS,
    ) -> None:
        if history_events < 0:
            raise ValueError(f"RunsClient(history_events={history_events!r}): give 0 or more")
        self.client = client
        self.task_queue = task_queue
        self.address = address
        self.redis = redis
        self.heartbeat_timeout = heartbeat_timeout
        self.history_events = history_events
        self._following = 0  # the runs :meth:`events` follows now
        self._starting = asyncio.Semaphore(STARTS)

    @classmethod
    async def connect(
        cls,
        temporal: str,
        task_queue: str,
        *,
        namespace: str = "default",
        redis: RedisControl | None = None,
        heartbeat_timeout: float = 10.0,
        history_events: int = HISTORY_EVENTS,
    ) -> RunsClient:
        """Connect to Temporal at ``temporal`` (``HOST:PORT``); ``ControlConnectionError``
        naming the address at once when it does not answer."""
        client = await connect(temporal, namespace)
        return cls(client, task_queue, address=temporal, redis=redis,
                   heartbeat_timeout=heartbeat_timeout, history_events=history_events)

    # -- starting ------------------------------------------------------------------------

    async def start(self, session: str, task: str | None, *, run_id: str | None = None) -> str:
        """Start ``task`` on ``session`` (None: resume where the session stopped); its id."""
        run_id = run_id or new_run_id()
        if self.redis is not None:  # a cancel before any worker takes the run is kept
            await self.redis.reserve(run_id, session=session)
        request = RunRequest(run_id, session, task, self.heartbeat_timeout, time.time(),
                             self.history_events, begins_in_turn=True)
        try:
            async with self._starting:
                await self.client.start_workflow(
                    WORKFLOW, request, id=run_id, task_queue=self.task_queue,
                    rpc_timeout=timedelta(seconds=START_SECONDS),
                )
        except RPCError as error:
            # Temporal did not start it, or (timed out, overloaded) may have: a run the
            # caller was told did not start is cancelled, lest it run unseen.
            if error.status != RPCStatusCode.INVALID_ARGUMENT:
                await self._cancel_unstarted(run_id)
            raise ControlError(
                f"Temporal at {self.address} did not start run {run_id!r}: "
                f"{error.message or error.status}", url=self.address,
            ) from None
        return run_id

    async def _cancel_unstarted(self, run_id: str) -> None:
        with contextlib.suppress(ControlError, RPCError, TimeoutError):
            async with asyncio.timeout(QUERY_SECONDS):
                await self.cancel(run_id, "its start failed: the caller was told so")

    async def resume(self, run_id: str) -> str:
        """Start a run that resumes the session of ``run_id`` where it stopped; its id."""
        state = await self.status(run_id)
        return await self.start(state["session"], None)

    # -- steering ------------------------------------------------------------------------

    def _handle(self, run_id: str) -> WorkflowHandle[Any, Any]:
        return self.client.get_workflow_handle(run_id)

    async def cancel(self, run_id: str, reason: str | None = None) -> bool:
        """Cancel the run wherever it is (its ``finally`` runs, its transcript is kept);
        False if it had ended already."""
        return await self.request(run_id, Steer("cancel", reason=reason))

    async def interrupt(self, run_id: str) -> bool:
        """Ask the run to stop at its next step boundary; False if it had ended."""
        return await self.request(run_id, Steer("interrupt"))

    async def stop(self, run_id: str, grace: float = 5.0) -> dict[str, Any]:
        """Interrupt now, cancel ``grace`` seconds later if still running; its final state."""
        if await self.request_stop(run_id, grace):
            return await self.wait(run_id)
        return await self.status(run_id)

    async def request_stop(self, run_id: str, grace: float = 5.0) -> bool:
        """Ask for :meth:`stop` without waiting for the run's end; False if it had ended."""
        return await self.request(run_id, Steer("stop", grace=grace))

    async def send(self, run_id: str, text: str, *, images: Sequence[object] = ()) -> None:
        """Give ``text`` (and ``images``: bytes, paths or ``data:`` URLs, checked here as
        ``run(images=)`` checks them) to the running run: they join at the next step
        boundary, once. ``RequestRefused`` if the run is not running, or if the images sent
        in its turn would come to more than :data:`MAX_SENT_IMAGE_CHARS` (1 MB as ``data:``
        URLs: they travel in Temporal's payloads); ValueError for a send past it alone."""
        await self.request(run_id, Steer.sending(text, images))

    async def request(self, run_id: str, request: Steer) -> bool:
        """Deliver ``request`` (see :mod:`aimu.aio.steering`) to the run; False if it had
        ended. A stop is asked for and not waited for; a send the run refuses raises
        ``RequestRefused`` (ValueError for images past what Temporal carries).

        Temporal's own cancel carries a cancel (with Redis first, where the run is
        registered there: it lands at once); a send goes as an update (the workflow
        answers whether it took it), an interrupt or a stop as the ``aimu.steer``
        signal (recorded with no worker up) and through Redis too."""
        request.check()  # TypeError/ValueError: nothing sent
        if request.kind == "cancel":
            return await self._cancel(run_id, request.reason or "cancelled")
        if request.must_be_taken:
            await self._send(run_id, request)
            return True
        if not await self._open(run_id):
            return False
        recorded = await self._rpc(
            run_id, self._handle(run_id).signal("aimu.steer", request.to_json())
        )
        await self._redis_too(run_id, request)
        return recorded

    async def _cancel(self, run_id: str, reason: str) -> bool:
        if self.redis is not None:  # lands first; Temporal's cancel makes it final
            await self._redis_cancel(run_id, reason)
        if not await self._open(run_id):
            return False
        return await self._rpc(run_id, self._handle(run_id).cancel(reason=reason))

    async def _open(self, run_id: str) -> bool:
        """True while the run's workflow is open; UnknownRunError if there is none."""
        try:
            described = await self._handle(run_id).describe()
        except RPCError as error:
            raise self._rpc_error(run_id, error) from None
        return described.status in (None, WorkflowExecutionStatus.RUNNING)

    async def _redis_cancel(self, run_id: str, reason: str) -> None:
        """Cancel through Redis, written before anything else (as a task of its own it
        waited a turn of a busy loop: 68 of 360 ms p50, 100 runs cancelled over HTTP at
        once); a Redis that does not answer delays Temporal's cancel QUERY_SECONDS at most."""
        assert self.redis is not None
        # Temporal's cancel reaches the run anyway.
        with contextlib.suppress(ControlError, TimeoutError):
            async with asyncio.timeout(QUERY_SECONDS):
                await self.redis.cancel(run_id, reason)

    async def _redis_too(self, run_id: str, request: Steer) -> None:
        """Deliver a request the workflow recorded through Redis too, so the running turn
        takes it at once rather than at its next read of its controls (an interrupt or a
        stop: taking one twice changes nothing)."""
        if self.redis is not None:
            with contextlib.suppress(ControlError):
                await self.redis.request(run_id, request)

    async def _send(self, run_id: str, request: Steer) -> None:
        size = sum(map(len, request.images))
        if size > MAX_SENT_IMAGE_CHARS:
            raise ValueError(
                f"the images are {size / 1e6:.1f} MB as data: URLs, more than the "
                f"{MAX_SENT_IMAGE_CHARS / 1e6:.0f} MB a run on Temporal may be sent in one "
                "turn (they travel in Temporal's payloads): send smaller images"
            )
        kept = () if request.input_id is None else (request.input_id,)  # as an older aimu
        await self._update(run_id, "aimu.send", request.text, list(request.images), *kept)

    async def approve(
        self, run_id: str, call_id: str, *, pause_id: str | None = None
    ) -> list[dict[str, Any]] | None:
        """Let the waiting call run; after the last decision the run resumes on a worker.
        The calls still waiting (None: no worker answered to say). ``pause_id`` (from the
        run's ``pending``): the pause the person was shown; ``RequestRefused`` if another
        waits. Either way the worker runs the call only if the store's session still
        waits on the pause the run recorded (else the run fails, and nothing runs)."""
        return await self._decide(run_id, CallDecision(call_id, True, None, pause_id))

    async def deny(
        self, run_id: str, call_id: str, reason: str | None = None, *,
        pause_id: str | None = None,
    ) -> list[dict[str, Any]] | None:
        """Refuse the waiting call (the model reads ``reason``); the calls still waiting."""
        return await self._decide(run_id, CallDecision(call_id, False, reason, pause_id))

    async def answer(
        self, run_id: str, call_id: str, result: str, *, pause_id: str | None = None
    ) -> list[dict[str, Any]] | None:
        """Give the result of an external tool's waiting call; the calls still waiting."""
        return await self._decide(run_id, CallDecision(call_id, True, None, pause_id, result))

    async def _decide(self, run_id: str, decision: CallDecision) -> list[dict[str, Any]] | None:
        """Check the decision against the run when a worker answers (RequestRefused if
        it waits on no such call), then record it: a signal, durable with no worker up."""
        waiting: list[dict[str, Any]] | None = None
        try:
            state = await self._handle(run_id).query(
                STATE_QUERY, 1 << 30, rpc_timeout=timedelta(seconds=QUERY_SECONDS)
            )
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise self._rpc_error(run_id, error) from None
            state = None  # no worker answers: the workflow checks it when one comes
        except WorkflowQueryFailedError:
            state = None
        if state is not None:
            if state["status"] != "paused":
                raise RequestRefused(
                    f"run {run_id} is {state['status']}, not paused: no tool call awaits a "
                    "decision", url=self.address, kind="conflict",
                )
            pending = {p["call_id"]: p.get("pause_id") for p in state["pending"]}
            if decision.call_id not in pending:
                raise RequestRefused(
                    f"run {run_id} waits on no tool call {decision.call_id[:64]!r}",
                    url=self.address, kind="not_found",
                )
            if decision.pause_id not in (None, pending[decision.call_id]):
                raise RequestRefused(
                    f"run {run_id}: tool call {decision.call_id[:64]!r} was asked again "
                    "since the pause shown: nothing was decided", url=self.address,
                    kind="conflict",
                )
            waiting = [p for p in state["pending"] if p["call_id"] != decision.call_id]
        await self._rpc(run_id, self._handle(run_id).signal("aimu.decide", decision))
        return waiting

    async def _update(self, run_id: str, name: str, *args: Any) -> Any:
        try:
            return await self._handle(run_id).execute_update(name, args=args)
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError):
                kind = "not_found" if cause.type == "AimuNotFound" else "conflict"
                raise RequestRefused(cause.message, url=self.address, kind=kind) from None
            raise
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND and await self._exists(run_id):
                raise RequestRefused(
                    f"run {run_id} has ended: the text was not sent; start a new run with it",
                    url=self.address, kind="conflict",
                ) from None
            raise self._rpc_error(run_id, error) from None

    async def _rpc(self, run_id: str, call: Any) -> bool:
        """Await ``call``; False if the run has ended, UnknownRunError if there is none."""
        try:
            await call
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND and await self._exists(run_id):
                return False
            raise self._rpc_error(run_id, error) from None
        return True

    async def _exists(self, run_id: str) -> bool:
        try:
            await self._handle(run_id).describe()
        except RPCError:
            return False
        return True

    def _rpc_error(self, run_id: str, error: RPCError) -> ControlError:
        if error.status == RPCStatusCode.NOT_FOUND:
            return UnknownRunError(
                f"no run {run_id!r} in Temporal at {self.address}: it never started there "
                "or its history was deleted", url=self.address,
            )
        return ControlError(
            f"Temporal at {self.address} failed a request for run {run_id!r}: {error.message}",
            url=self.address,
        )

    # -- reading -------------------------------------------------------------------------

    async def status(self, run_id: str, *, after: int = 0) -> dict[str, Any]:
        """The run: status, reply, error, usage, pending calls, and its events after the
        first ``after``. UnknownRunError if there is no such run."""
        handle = self._handle(run_id)
        try:
            state: dict[str, Any] = await handle.query(STATE_QUERY, after)
            if after < int(state.get("events_from") or 0):
                state["events"] = await self._earlier_events(run_id, state, after)
            return state
        except WorkflowQueryFailedError as error:
            raise ControlError(
                f"run {run_id!r} could not be read: {error}", url=self.address
            ) from None
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise self._rpc_error(run_id, error) from None
            # No worker answers queries (all stopped): what Temporal itself knows.
            try:
                described = await handle.describe()
            except RPCError:
                raise self._rpc_error(run_id, error) from None
            status = "pending" if described.status is None else _CLOSED.get(
                described.status, "pending"
            )
            return {"run_id": run_id, "status": status, "events": [], "pending": [],
                    "event_count": None}

    async def _earlier_events(
        self, run_id: str, state: dict[str, Any], after: int
    ) -> list[dict[str, Any]]:
        """The run's events after ``after`` that executions before ``state``'s hold (it
        continued as new): read from their histories, where a worker replays them."""
        until = int(state["events_from"])
        while after < int(state.get("events_from") or 0) and state.get("previous_run"):
            earlier = self.client.get_workflow_handle(run_id, run_id=state["previous_run"])
            state = await earlier.query(STATE_QUERY, after)
        return list(state["events"][: max(0, until - after)])

    async def wait(self, run_id: str, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        """Wait until the run ends (a paused run waits for decisions); its final state."""
        async with asyncio.timeout(timeout):
            try:
                state: dict[str, Any] = await self._handle(run_id).result()
            except RPCError as error:
                raise self._rpc_error(run_id, error) from None
            except Exception:  # cancelled or failed: the workflow's state says which
                return await self.status(run_id, after=1 << 30)
        return state  # the workflow returns its final state: no query needed

    def poll_every(self) -> float:
        """Seconds between two reads of a streaming run's events: POLL_SECONDS[0], or
        more while this client follows many runs (EVENT_QUERIES a second at most)."""
        return max(POLL_SECONDS[0], self._following / EVENT_QUERIES)

    async def events(
        self, run_id: str, after: int = 0, *, watched: Callable[[], bool] | None = None
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        """The run's events numbered from 1, after ``after``, to its ``handle_finished``.
        Asked for every ``POLL_SECONDS[0]`` while the run starts or streams; given
        ``watched``, only while it says someone waits for them (each ask is a query a
        worker answers), else less and less often."""
        seen = after
        delay = POLL_SECONDS[0]
        loop = asyncio.get_running_loop()
        lively = loop.time()  # the last time events came (or the start): ask often after it
        self._following += 1
        try:
            while True:
                state = await self.status(run_id, after=seen)
                for event in state["events"]:
                    seen += 1
                    yield seen, event
                    if event.get("type") == "handle_finished":
                        return
                if state["status"] in FINAL and state["event_count"] is None:
                    return
                if state["events"]:
                    lively = loop.time()
                fast = self.poll_every()
                if (state["status"] != "paused" and loop.time() - lively < POLL_QUIET_SECONDS
                        and (watched is None or watched())):
                    delay = fast
                else:
                    delay = max(fast, min(delay * 1.5, POLL_SECONDS[1]))
                await asyncio.sleep(delay)
        finally:
            self._following -= 1
