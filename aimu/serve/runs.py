"""The runs a server executes: one per session at a time, followed, stopped, resumed.

:class:`LocalRuns` runs each request as a :class:`~aimu.aio.RunHandle` in this process.
Every event a run emits is kept in order and numbered from 1 (its SSE id), ending with
one ``handle_finished``, so a follower that connects late or reconnects with the last
id it saw misses nothing and sees nothing twice; a follower going away never touches
the run. Each run opens its session from the store, writes every message durably as
the agent records it, and closes the session when it ends, so the next run on that
session may execute in another process sharing the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Coroutine
from typing import Any, Final, TypeAlias

from aimu.aio.agent import Agent
from aimu.aio.approvals import Approvals, PendingApproval
from aimu.aio.errors import SessionLockedError
from aimu.aio.events import Event, RunFinished
from aimu.aio.run_handle import RunHandle
from aimu.aio.store import Store, validate_session_name
from aimu.aio.transcript import Usage, zero_usage
from aimu.serve.errors import BadRequest, Conflict, NotFound
from aimu.serve.ids import check_run_id, event_number

__all__ = ["AgentFactory", "Batch", "LocalRuns", "RunRecord", "check_run_id", "event_json"]

#: Builds the agent for one run of ``session``, writing to that session in the store.
AgentFactory: TypeAlias = Callable[[str], Agent]
JSONEvent: TypeAlias = dict[str, Any]
#: Events in order, each with its id; empty: nothing happened for a while (keep-alive).
Batch: TypeAlias = list[tuple[str, JSONEvent]]

_RUN_ID_BYTES: Final = 18  # 144 bits: unguessable, so a run id is a capability
#: A follower with nothing to read hears a comment this often, so proxies keep it open.
KEEPALIVE_SECONDS: Final = 15.0
MAX_GRACE_SECONDS: Final = 3600.0
#: How long a decision waits for the session's lock while another decision holds it.
DECISION_WAIT_SECONDS: Final = 10.0
_FIRST_RETRY: Final = 0.005
_log = logging.getLogger("aimu.serve")


def no_cancel_error(event: JSONEvent) -> JSONEvent:
    """``event`` without an ``error`` if it reports a cancel: a stop somebody asked for
    (its ``reason`` says who) is not an error, though the run ended by CancelledError."""
    if event.get("status") == "cancelled" and event.get("error") is not None:
        event = {**event, "error": None}
    return event


def event_json(event: Event) -> JSONEvent:
    """An event as a JSON-ready dict (its ``type`` tag included)."""
    return dataclasses.asdict(event)


@dataclasses.dataclass(eq=False)
class RunRecord:
    """One run as the API reports it, and its numbered event log."""

    run_id: str
    session: str
    task: str | None
    """The message that started it, or None for a resume."""
    status: str = "pending"
    created_at: float = dataclasses.field(default_factory=time.time)
    finished_at: float | None = None
    reason: str | None = None
    reply: str | None = None
    error: str | None = None
    usage: Usage = dataclasses.field(default_factory=zero_usage)
    events: list[JSONEvent] = dataclasses.field(default_factory=list)
    ended: bool = False
    messages_from: int = 0
    """How many messages the session held before this run added any."""
    remote: bool = False
    """Executing in another process: reply, usage and events are not known here."""
    event_count: int | None = None
    resumed_run_id: str | None = None
    """The run that went on after the decisions, once they were all given."""
    handle: RunHandle[str] | None = dataclasses.field(default=None, repr=False)
    _waiters: list[asyncio.Future[None]] = dataclasses.field(default_factory=list, repr=False)

    def public(self) -> dict[str, Any]:
        """The JSON body of ``GET /runs/{id}``."""
        finished = self.finished_at
        return {
            "run_id": self.run_id,
            "session": self.session,
            "task": self.task,
            "status": self.status,
            "reason": self.reason,
            "reply": self.reply,
            "error": None if self.status == "cancelled" else self.error,
            "usage": None if self.remote else dict(self.usage),
            "created_at": self.created_at,
            "finished_at": finished,
            "duration": None if finished is None else max(0.0, finished - self.created_at),
            "events": self.event_count if self.remote else len(self.events),
            "pending": [],
        }

    def add(self, event: JSONEvent) -> None:
        self.events.append(event)
        self.wake()

    def wake(self) -> None:
        """Wake every follower waiting in :meth:`changed`."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    async def changed(self, seconds: float) -> bool:
        """Wait until an event is added; False if ``seconds`` passed first."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            done, _ = await asyncio.wait((waiter,), timeout=seconds)
        finally:
            if not waiter.done():
                waiter.cancel()
                self._waiters.remove(waiter)
        return bool(done)


def pending_json(pending: PendingApproval) -> dict[str, Any]:
    """A waiting tool call as JSON (``name`` is the tool's, as the page shows it)."""
    return {
        "call_id": pending.call_id,
        "name": pending.tool,
        "arguments": pending.arguments,
        "in_doubt": pending.in_doubt,
    }


def check_grace(grace: float) -> float:
    if not math.isfinite(grace) or not 0 <= grace <= MAX_GRACE_SECONDS:
        raise BadRequest(f"grace must be seconds from 0 to {MAX_GRACE_SECONDS:g}, got {grace!r}")
    return grace


class LocalRuns:
    """Runs executing in this process, controlled from this process.

    ``keep_finished`` finished runs stay readable (oldest forgotten first); their
    sessions stay in the store regardless.
    """

    def __init__(self, agents: AgentFactory, store: Store, *, keep_finished: int = 1000) -> None:
        self._agents = agents
        self.store = store
        self._keep_finished = keep_finished
        self._runs: OrderedDict[str, RunRecord] = OrderedDict()
        self._active: dict[str, str] = {}
        """session -> the id of its run in progress here."""
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()
        self._closed = False

    # -- starting ----------------------------------------------------------------

    def active_run(self, session: str) -> str | None:
        """The id of the run in progress on ``session`` in this process, if any."""
        return self._active.get(session)

    async def start(self, session: str, task: str | None) -> RunRecord:
        """Start ``task`` on ``session`` (None: resume where it stopped); return its record.

        ``Conflict`` if the session has a run in progress here or, for a resume, nothing
        to resume (no task yet, or its last run completed); ``SessionLockedError`` if a
        writer elsewhere holds the session.
        """
        self._check_startable(session)
        if task is None:
            info = await self.store.info(session)
            if info is not None and info.status == "completed":
                raise Conflict(
                    f"session {session!r} finished its last run (completed): nothing to "
                    f"resume; start a run with a task (POST /sessions/{session}/runs)"
                )
        agent = await self._open_agent(session)  # SessionLockedError: serve answers 409
        try:
            run = agent.resume() if task is None else agent.run(task)
        except ValueError as error:  # nothing to resume; calls still wait for a decision
            await agent.aclose()
            raise Conflict(f"session {session!r}: {error}") from error
        except BaseException:
            await agent.aclose()
            raise
        return await self._launch(agent, run, session, task)

    def _check_startable(self, session: str) -> None:
        self._check_open()
        validate_name(session)
        busy = self._active.get(session)
        if busy is not None:
            raise Conflict(f"session {session!r} has a run in progress ({busy}); stop it or wait")

    def _check_open(self) -> None:
        if self._closed:
            raise Conflict("the server is shutting down; send the request to another server")

    async def _open_agent(self, session: str) -> Agent:
        """The agent of ``session``, its store session open (its write lock taken);
        ``SessionLockedError`` if a writer holds it."""
        agent = self._agents(session)
        try:
            await agent.open()
        except BaseException:
            await agent.aclose()
            raise
        return agent

    async def _launch(
        self, agent: Agent, run: Coroutine[Any, Any, str], session: str, task: str | None
    ) -> RunRecord:
        """Run ``run`` of the open ``agent`` under a handle; the session is released at
        its end."""
        record = RunRecord("", session, task)
        record.messages_from = len(agent.model_client.messages)
        closing = _closing(agent, run, record)
        try:
            handle = self._start_handle(closing, record)
        except BaseException:  # never started: release the session here
            closing.close()
            run.close()
            await agent.aclose()
            raise
        record.handle = handle
        record.status = handle.status
        handle.scope.add_listener(lambda event: self._on_event(record, event))
        handle.add_done_callback(lambda done: self._finished(record, done))
        self._active[session] = record.run_id
        self._runs[record.run_id] = record
        self._forget_old()
        await self._started(handle)
        return record

    def _start_handle(self, run: Coroutine[Any, Any, str], record: RunRecord) -> RunHandle[str]:
        """Start ``run`` under a handle and set ``record.run_id``."""
        record.run_id = secrets.token_urlsafe(_RUN_ID_BYTES)
        return RunHandle.start(run, name=f"run {record.run_id}")

    async def _started(self, handle: RunHandle[str]) -> None:
        """Called once the run is recorded here, before its id is handed out."""

    def _on_event(self, record: RunRecord, event: Event) -> None:
        if record.status == "pending":
            record.status = "running"
        if isinstance(event, RunFinished):
            record.reply = event.reply
            record.usage = dict(event.usage)  # type: ignore[assignment]
            record.error = event.error
        record.add(no_cancel_error(event_json(event)))

    def _finished(self, record: RunRecord, handle: RunHandle[str]) -> None:
        record.status = handle.status
        record.reason = handle.reason
        record.finished_at = time.time()
        if self._active.get(record.session) == record.run_id:
            del self._active[record.session]
        record.ended = True
        record.add(
            no_cancel_error({
                "type": "handle_finished",
                "name": handle.name,
                "status": record.status,
                "reason": record.reason,
                "result": record.reply,
                "error": record.error,
            })
        )

    def _forget_old(self) -> None:
        excess = len(self._runs) - self._keep_finished - len(self._active)
        if excess <= 0:
            return
        for run_id in [r.run_id for r in self._runs.values() if r.ended][:excess]:
            del self._runs[run_id]

    # -- reading -------------------------------------------------------------------

    def get(self, run_id: str) -> RunRecord:
        record = self._runs.get(check_run_id(run_id))
        if record is None:
            raise NotFound(f"no run {run_id!r} on this server (finished long ago, or never)")
        return record

    async def public(self, run_id: str) -> dict[str, Any]:
        """The JSON body of ``GET /runs/{id}``."""
        return await self._public(self.get(run_id))

    async def _public(self, record: RunRecord) -> dict[str, Any]:
        body = record.public()
        body["pending"] = await self._waiting(record)
        return body

    async def session_run(self, session: str) -> RunRecord | None:
        """The run in progress on ``session``, if any."""
        run_id = self._active.get(session)
        return None if run_id is None else self._runs[run_id]

    async def session_runs(self) -> dict[str, str]:
        """session -> the id of its run in progress, for every session with one."""
        return dict(self._active)

    async def check_follow(self, run_id: str, after: str | None) -> None:
        """Raise now what following ``run_id`` after ``after`` would: unknown run, bad id."""
        self.check_after(run_id, after)

    def check_after(self, run_id: str, after: str | None) -> int:
        """Validate a follower's ``Last-Event-ID`` against ``run_id``'s log."""
        record = self.get(run_id)
        seen = event_number(after)
        if record.ended and seen > len(record.events):
            raise BadRequest(
                f"Last-Event-ID {after!r} is past the last event of run {run_id} "
                f"({len(record.events)})"
            )
        return seen

    async def follow(self, run_id: str, after: str | None) -> AsyncGenerator[Batch, None]:
        """The run's events after ``after`` (an id it sent), then its terminal event.

        Yields them in batches of ``(id, event)``, as many as are there (one write for a
        follower that fell behind); an empty batch is a keep-alive after a quiet while.
        Ends early, without the terminal event, when the server shuts down (the follower
        reconnects).
        """
        record = self.get(run_id)
        seen = self.check_after(run_id, after)
        while True:
            events = record.events
            if seen < len(events):
                end = len(events)
                yield [(str(i), events[i - 1]) for i in range(seen + 1, end + 1)]
                seen = end
                continue
            if record.ended or self._closing.is_set():
                return
            if not await record.changed(KEEPALIVE_SECONDS):
                yield []

    # -- control -------------------------------------------------------------------

    def _live(self, run_id: str, what: str) -> RunHandle[str]:
        record = self.get(run_id)
        if record.ended or record.handle is None:
            raise Conflict(f"run {run_id} already ended ({record.status}): nothing to {what}")
        return record.handle

    async def cancel(self, run_id: str, reason: str | None) -> dict[str, Any]:
        handle = self._live(run_id, "cancel")
        handle.cancel(reason or "cancelled over HTTP")
        return self.get(run_id).public()

    async def interrupt(self, run_id: str) -> dict[str, Any]:
        handle = self._live(run_id, "interrupt")
        if not handle.interrupt():
            raise Conflict(f"run {run_id} is being cancelled already: nothing to interrupt")
        return self.get(run_id).public()

    async def stop(self, run_id: str, grace: float) -> dict[str, Any]:
        """Interrupt now and cancel after ``grace`` seconds, in the background."""
        handle = self._live(run_id, "stop")
        self._spawn(handle.stop(check_grace(grace)))
        return self.get(run_id).public()

    async def send(self, run_id: str, text: str) -> dict[str, Any]:
        """Give ``text`` to the run: it joins as a user message at its next step boundary."""
        handle = self._live(run_id, "send to")
        if not handle.send(text):
            raise Conflict(
                f"run {run_id} is ending (being cancelled): the text was not sent; "
                "start a new run with it"
            )
        return self.get(run_id).public()

    async def decide(
        self, run_id: str, call_id: str, approve: bool, reason: str | None
    ) -> dict[str, Any]:
        """Record a decision on a call the paused run waits on; after the last one, resume.

        The decisions are kept in the session's state in the store, so any process
        sharing the store takes the next one. Each is recorded under the session's write
        lock: of two processes given the last two decisions at once, one records its
        decision and releases the lock, the other then finds every call decided and
        resumes the run, once (``resumed_run_id``).
        """
        self._check_open()
        record = await self._paused(run_id)
        agent = await self._open_for_decision(record, call_id)
        try:
            await self._apply_decision(agent, record, call_id, approve, reason)
            waiting = agent.pending_approvals
            run = None if waiting else agent.resume()
        except BaseException:
            await agent.aclose()
            raise
        if run is None:
            await agent.aclose()  # saves the decision in the session's state
            resumed = None
        else:
            resumed = (await self._launch(agent, run, record.session, None)).run_id
            record.resumed_run_id = resumed
        return {
            "run_id": run_id,
            "call_id": call_id,
            "approve": approve,
            "pending": [pending_json(p) for p in waiting],
            "resumed_run_id": resumed,
        }

    async def _paused(self, run_id: str) -> RunRecord:
        """The record of ``run_id`` if it paused (else ``Conflict``)."""
        record = self.get(run_id)
        if record.status != "paused" or not record.ended:
            raise Conflict(
                f"run {run_id} is {record.status}, not paused: no tool call awaits a decision"
            )
        return record

    async def _later_run(self, record: RunRecord) -> str | None:
        """The id of a run started on ``record``'s session after it, if any."""
        if record.resumed_run_id is not None:
            return record.resumed_run_id
        later = [
            r.run_id for r in self._runs.values()
            if r.session == record.session and r.created_at > record.created_at
        ]
        return later[-1] if later else None

    async def _open_for_decision(self, record: RunRecord, call_id: str) -> Agent:
        """The paused session's agent, open; waits while another decision holds the
        session's lock, ``Conflict`` once the session went on (the calls were decided)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DECISION_WAIT_SECONDS
        delay = _FIRST_RETRY
        while True:
            later = await self._later_run(record)
            if later is not None:
                raise Conflict(
                    f"tool call {call_id[:64]!r} of run {record.run_id} is decided already: "
                    f"the session went on with run {later}"
                )
            try:
                return await self._open_agent(record.session)
            except SessionLockedError as error:
                if loop.time() >= deadline:
                    _log.info("decision on session %r: %s", record.session, error)
                    raise Conflict(
                        f"session {record.session!r} stayed locked for "
                        f"{DECISION_WAIT_SECONDS:g} s: try again"
                    ) from None
            if delay == _FIRST_RETRY:
                _log.debug(
                    "decision on call %r of session %r waits for the session's lock",
                    call_id[:64], record.session,
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    async def _apply_decision(
        self, agent: Agent, record: RunRecord, call_id: str, approve: bool, reason: str | None
    ) -> None:
        """Decide ``call_id`` on the open ``agent``; NotFound / Conflict change nothing."""
        if call_id not in {p.call_id for p in agent.pending_approvals}:
            state = await self.store.load_state(record.session)
            decided = Approvals.load(state.get("approvals"), record.session).decisions
            if call_id in decided or not agent.pending_approvals:
                raise Conflict(
                    f"tool call {call_id[:64]!r} of run {record.run_id} is decided already "
                    f"(if the session did not go on: POST /sessions/{record.session}/resume)"
                )
            raise NotFound(f"run {record.run_id} waits on no tool call {call_id[:64]!r}")
        if approve:
            agent.approve(call_id)
        else:
            agent.deny(call_id, reason)

    async def paused_on(self, session: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The session's last run if it paused, and the calls it still waits on."""
        latest = await self._latest_run(session)
        if latest is None or latest.status != "paused":
            return None, []
        return latest.run_id, await self._waiting(latest)

    async def _latest_run(self, session: str) -> RunRecord | None:
        runs = [r for r in self._runs.values() if r.session == session]
        return runs[-1] if runs else None

    async def _waiting(self, record: RunRecord) -> list[dict[str, Any]]:
        """The calls the paused run still waits on, as the store's session state says."""
        if record.status != "paused" or await self._later_run(record) is not None:
            return []
        state = await self.store.load_state(record.session)
        try:
            approvals = Approvals.load(state.get("approvals"), record.session)
        except ValueError:
            return []
        return [pending_json(p) for p in approvals.waiting()]

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- shutting down ---------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """End every follower's stream now (they reconnect elsewhere); runs go on."""
        self._closing.set()
        for record in self._runs.values():
            record.wake()

    async def aclose(self) -> None:
        """Cancel the runs in progress (their transcripts are kept) and wait for them."""
        self._closed = True
        self.begin_shutdown()
        handles = [r.handle for r in self._runs.values() if r.handle is not None and not r.ended]
        for handle in handles:
            handle.cancel("the server is shutting down")
        for task in list(self._background):
            task.cancel()
        pending: list[Any] = [*self._background, *(_settled(h) for h in handles)]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)


def validate_name(session: str) -> str:
    """``session`` if valid, else ``BadRequest`` saying what a name may hold."""
    try:
        return validate_session_name(session)
    except ValueError as error:
        raise BadRequest(str(error)) from error


async def _closing(agent: Agent, run: Coroutine[Any, Any, str], record: RunRecord) -> str:
    """Run ``run``, then release the session (its write lock) whatever ended it."""
    try:
        return await run
    except Exception as error:
        if record.error is None:
            record.error = f"{type(error).__name__}: {error}"
        raise
    finally:
        await agent.aclose()


async def _settled(handle: RunHandle[str]) -> None:
    """Wait until ``handle`` ends, whatever ended it (its outcome is not ours to raise)."""
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def settle(_: object) -> None:
        if not ended.done():
            ended.set_result(None)

    handle.add_done_callback(settle)
    await ended
