"""The activities of an aimu run on Temporal: ``aimu.turn`` (and ``aimu.begin``, for the
workflows started before the turn counted the run's first messages itself).

``aimu.turn`` runs the agent loop under a :class:`~aimu.aio.RunHandle` in the worker's
event loop. It heartbeats on a timer (a cancel from Temporal arrives with a heartbeat's
answer and reaches the run as ``CancelledError``), reads the run's controls from the
workflow on another (both less often while many turns run on the worker), and signals
the run's events to the workflow in batches. With a :class:`~aimu.aio.RedisControl` the
run is also registered in Redis under its run id (its part resumed after a pause too, on
the reopened record), so a cancel, interrupt or stop from Redis lands at once.

A retried turn (its worker died) opens the session from the store: the transcript is
there up to the last recorded message and the tool journal decides the calls that were
in flight; the turn runs its task only if the task is not stored yet, else resumes. It
looks for the task after the messages the session held before the run: counted by the
run's first turn as it opens the session and kept in the run's record before the task
is stored (``aimu.begin`` counted them first, in a workflow started before that).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Coroutine, Sequence
from datetime import timedelta
from typing import Any, Final

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError, ApplicationErrorCategory

from aimu._hosting import AgentFactory, open_agent
from aimu.aio._event_tap import EventTap
from aimu.aio._tasks import Background, ended
from aimu.aio.agent import Agent
from aimu.aio.errors import ControlError, SessionLockedError, StoreError, UnknownRunError
from aimu.aio.event_json import event_data
from aimu.aio.events import Event, HandleFinished, RunFinished, RunStarted, StepFinished
from aimu.aio.run_handle import RunHandle
from aimu.aio.status import BY_CANCEL, RECOVERABLE, STOPPED
from aimu.aio.steering import steer
from aimu.aio.store import RunRecord, Store, validate_session_name
from aimu.aio.transcript import Message
from aimu.temporal._workflow import (
    BEGIN,
    CANCELLED,
    CONTROLS_QUERY,
    END_PAUSED,
    HANDED_OFF,
    HANDOFF,
    STALE,
    TURN,
    Control,
    TurnOrder,
    TurnOutcome,
)

__all__ = ["Activities"]

_log = logging.getLogger("aimu.temporal")
#: Events wait at most this long to be signalled to the workflow (one signal per batch);
#: the first after a quiet while goes at once, so a reply starts streaming without it.
_EVENT_BATCH_SECONDS: Final = 0.1
#: How long a cancelled turn asks the workflow for the caller's reason before it goes
#: without (the run is cancelled right after, with it or with a general one).
_REASON_SECONDS: Final = 1.0
#: Events one signal carries at most (a backlog after Temporal was away goes in several).
_BATCH_EVENTS: Final = 500
#: How long a batch of events is tried again while Temporal is away before it is given
#: up (each try is the client's own ~10 s of retries).
_SIGNAL_SECONDS: Final = 120.0
#: Reads of their controls (each a query the worker itself answers) the turns running on
#: one worker make per second at most, together; and heartbeats (each a call to
#: Temporal) they send. At ``--heartbeat 1`` 1,000 turns read 1,000 times a second.
CONTROL_READS: Final = 100.0
#: Batches of events the turns running on one worker signal a second at most, together
#: (each signal is a workflow task: at 40 short runs at once, one batch a run every
#: 0.4 s, as often as serve's followers of 40 runs read them, aimu.temporal._client.EVENT_QUERIES).
EVENT_SIGNALS: Final = 100.0
HEARTBEATS: Final = 200.0
#: How long a turn that hands its run off waits for Redis to show the run pending.
_REDIS_SECONDS: Final = 5.0
#: The reason a drain gives the turns it cancels once its time is up (or at a second
#: signal): their runs go on in a turn on another worker.
DRAINED: Final = "the worker shut down: the run goes on on another worker"
#: The reason an attempt of a turn is cancelled with when Temporal gave the turn to a
#: later attempt in this process (the earlier one timed out, its heartbeats late).
SUPERSEDED: Final = "a later attempt of the turn took it over"


class Activities:
    """The activities, bound to one worker's agents, store and (optional) Redis control."""

    def __init__(
        self,
        agents: AgentFactory,
        store: Store,
        *,
        control: Any = None,
        tick: float = 0.25,
    ) -> None:
        self.agents = agents
        self.store = store
        self.control = control
        """A RedisControl registering each run, or None."""
        self.tick = tick
        self._turns: dict[str, _Running] = {}
        """The run ids whose turn runs here, and its attempt."""
        self._draining = False
        self._hurried = False
        self._changed = asyncio.Event()

    def all(self) -> Sequence[Any]:
        return [self.begin, self.turn, self.end_paused]

    async def drain(self, grace: float) -> None:
        """Interrupt every turn here at its next step boundary (and one that starts from
        now on), wait up to ``grace`` seconds for them to end (less after :meth:`hurry`),
        cancel those still going, and return once each has ended. Each run goes on in a
        turn on another worker, from where this one stopped."""
        self._draining = True
        for running in list(self._turns.values()):
            running.drain(cancel=self._hurried)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace):
                await self._quiet(lambda: self._hurried)
        self.hurry()
        await self._quiet(lambda: False)

    def hurry(self) -> None:
        """Cancel the turns here now (a second signal), not at their step boundary."""
        self._draining = self._hurried = True
        for running in list(self._turns.values()):
            running.drain(cancel=True)
        self._changed.set()

    async def _quiet(self, enough: Any) -> None:
        """Wait until no turn runs here, or ``enough()``."""
        while self._turns and not enough():
            self._changed.clear()
            await self._changed.wait()

    async def _take_over(self, run_id: str) -> _Running:
        """Make this attempt the one running ``run_id`` here: an earlier attempt of the
        same turn still here (Temporal timed it out and gave the turn to this one) is
        cancelled, and its session released, before this one opens it."""
        earlier = self._turns.get(run_id)
        if earlier is not None:
            earlier.supersede()
            await _uncancellable(earlier.released.wait())
        running = self._turns[run_id] = _Running()
        if self._draining:
            running.drain(cancel=self._hurried)
        return running

    def _gone(self, run_id: str, running: _Running) -> None:
        running.released.set()
        if self._turns.get(run_id) is running:
            del self._turns[run_id]
        self._changed.set()

    @activity.defn(name=BEGIN)
    async def begin(self, session: str) -> int:
        """How many messages ``session`` holds before the run: where the run starts (a
        workflow from before its first turn found it; see ``RunRequest.begins_in_turn``)."""
        _check_session(session)
        return len(await self.store.load(session))

    @activity.defn(name=END_PAUSED)
    async def end_paused(
        self, run_id: str, session: str, reason: str, was: str = "paused"
    ) -> None:
        """Record in the store and in Redis that the paused run ``run_id`` was cancelled
        (``was``: the session's status the cancel replaces, ``interrupted`` for a run
        cancelled as its turn ended to continue as new)."""
        try:
            writer = await self.store.open_session(session)
        except SessionLockedError as error:  # a decision being recorded, often: retried
            raise ApplicationError(
                f"session {session!r} is open elsewhere: {error}", type="AimuLocked"
            ) from None
        try:
            info = await self.store.info(session)
            if info is not None and info.status == was:  # not if the session went on
                await writer.set_status("cancelled")
            record = await self.store.run(run_id)
            if record is not None and record.status == was:  # the run's record says so too
                await writer.record_run(dataclasses.replace(
                    record, status="cancelled", reason=reason, ended=time.time()
                ))
        finally:
            await writer.aclose()
        if self.control is not None:
            with contextlib.suppress(UnknownRunError):  # it was not registered in Redis
                await self.control.cancel_paused(run_id, reason)

    @activity.defn(name=TURN)
    async def turn(self, request: TurnOrder) -> TurnOutcome:
        """Run (or resume) the turn on this worker until it ends, pauses or is stopped."""
        info = activity.info()
        taken: list[_Running] = []
        # Heartbeats from the start, whatever waits (an earlier attempt letting the
        # session go, opening it, Redis, a read of the controls that a busy Temporal
        # answers late): a silent turn would be timed out and retried.
        beat = asyncio.ensure_future(self._beat(request, taken))
        try:
            taken.append(await self._take_over(request.run_id))
            return await self._turn(request, taken[0], info.attempt)
        finally:
            beat.cancel()
            await asyncio.wait([beat])

    async def _beat(self, request: TurnOrder, taken: list[_Running]) -> None:
        timeout = activity.info().heartbeat_timeout
        while True:
            # The first after beat_every() too: the heartbeat timeout counts from the
            # turn's start, and a turn that ends sooner costs Temporal no heartbeat.
            attempt = taken[0].attempt if taken else None
            redis = attempt is not None and attempt.registered
            await asyncio.sleep(self.beat_every(timeout, redis=redis))
            activity.heartbeat(_applied(request, taken))

    def beat_every(self, timeout: timedelta | None, *, redis: bool = False) -> float:
        """Seconds between two heartbeats of a turn: ``tick``, or more while many turns
        run here (HEARTBEATS a second at most, together), but three to a ``timeout``.
        A turn registered in Redis (``redis``) heartbeats three times a ``timeout`` only
        to show it is alive: its cancel comes through Redis, not a heartbeat's answer."""
        spread = len(self._turns) / HEARTBEATS
        if timeout is not None:
            third = timeout.total_seconds() / 3
            spread = third if redis else min(spread, third)
        return max(self.tick, spread)

    def signal_every(self) -> float:
        """Seconds a turn's events gather before they are signalled: _EVENT_BATCH_SECONDS,
        or more while many turns run here (EVENT_SIGNALS batches a second at most)."""
        return max(_EVENT_BATCH_SECONDS, len(self._turns) / EVENT_SIGNALS)

    def read_every(self) -> float:
        """Seconds between two reads of a turn's controls: ``tick``, or more while many
        turns run here (CONTROL_READS a second at most, together). With Redis control a
        cancel, interrupt or stop lands through Redis at once; a send waits for this."""
        return max(self.tick, len(self._turns) / CONTROL_READS)

    async def _turn(self, request: TurnOrder, running: _Running, attempt_number: int
                    ) -> TurnOutcome:
        try:
            _check_session(request.session)
            try:
                agent = await open_agent(self.agents, request.session)
            except SessionLockedError as error:
                # Another process's writer (a dying worker's turn, often) holds it: retried.
                raise ApplicationError(
                    f"session {request.session!r} is open elsewhere: {error}",
                    type="AimuLocked",
                ) from None
            attempt = running.attach(_TurnAttempt(self, agent, request, attempt_number))
            try:
                outcome = await attempt.execute()
            except BaseException:
                await _uncancellable(self._close(agent, attempt))
                raise
            # The turn has ended: its session is let go whatever comes, and a cancel that
            # comes meanwhile does not hide how it ended (the workflow sees the cancel).
            with contextlib.suppress(asyncio.CancelledError):
                await _uncancellable(self._close(agent, attempt))
            return outcome
        finally:
            self._gone(request.run_id, running)

    async def _close(self, agent: Agent, attempt: _TurnAttempt) -> None:
        await attempt.unbegun()
        await agent.aclose()
        if attempt.drained and attempt.handle is not None:
            await _mark_drained(self.store, attempt.request, attempt.handle)


class _Running:
    """A turn running in this process: its attempt, and how this worker ends it early."""

    def __init__(self) -> None:
        self.attempt: _TurnAttempt | None = None
        self.released = asyncio.Event()
        """Set once the attempt let its session go."""
        self.ending: tuple[str, bool] | None = None
        """Set when this worker ends the turn: (the reason, cancel at once)."""

    def attach(self, attempt: _TurnAttempt) -> _TurnAttempt:
        self.attempt = attempt
        if self.ending is not None:
            attempt.end_here(*self.ending)
        return attempt

    def drain(self, *, cancel: bool) -> None:
        self._end(DRAINED, cancel)

    def supersede(self) -> None:
        self._end(SUPERSEDED, True)

    def _end(self, reason: str, cancel: bool) -> None:
        if self.ending is None or (cancel and not self.ending[1]):
            self.ending = (reason, cancel)
        if self.attempt is not None:
            self.attempt.end_here(*self.ending)


class _TurnAttempt:
    """One attempt of one turn: the run's handle, its event batches and control polls."""

    def __init__(self, owner: Activities, agent: Agent, request: TurnOrder, attempt: int):
        self.owner = owner
        self.agent = agent
        self.request = request
        self.attempt = attempt
        self.workflow: WorkflowHandle[Any, Any] = activity.client().get_workflow_handle(
            activity.info().workflow_id or request.run_id
        )
        self.final: RunFinished | None = None
        self.applied = request.controls_after
        self.handle: RunHandle[Any] | None = None
        self.background = Background()
        self.handoff = False
        """The workflow asked the turn to end at a step boundary (to continue as new)."""
        self.handed = False
        """The handoff's interrupt was given to the run (its tool round had ended)."""
        self.stopped = False
        """A person's interrupt or stop reached the turn: its end is theirs."""
        self.cancel_reason = "cancelled through Temporal"
        self.drained = False
        """The worker drains: the turn ends at its step boundary (or cancelled, when the
        drain's time is up) and the run goes on in a turn on another worker."""
        self.superseded = False
        """A later attempt of the turn took it over: this one's outcome is nobody's."""
        self.registered = False
        """The run is registered in Redis under its run id by this attempt."""
        self.here: tuple[str, bool] | None = None
        """Why and how this worker ends the turn (see :meth:`end_here`)."""
        self.messages_from: int | None = None
        """Where the run's messages begin, when this turn found it (:meth:`_begins`)."""

    def _step(self, event: Event) -> None:
        """A handoff asked for interrupts the run as its own tool round ends, just
        before its step boundary: its tools, and the agents they call, never see it (a
        person's interrupt, or a drain's, reaches them as in a local run)."""
        if (self.handoff and not self.handed and isinstance(event, StepFinished)
                and not event.path and self.handle is not None):
            self.handed = self.handle.interrupt()

    def end_here(self, reason: str, cancel: bool) -> None:
        """End the turn for this worker's own ``reason`` (a drain, a later attempt): at
        its next step boundary, or (``cancel``) now. Its run goes on elsewhere."""
        self.here = (reason, cancel)
        if reason == SUPERSEDED:
            self.superseded = True
        else:
            self.drained = True
        handle = self.handle
        if handle is None:
            return  # taken when the run starts
        if cancel:
            handle.cancel(reason)
        else:
            handle.interrupt()

    async def execute(self) -> TurnOutcome:
        handle = self.handle = await self._start()
        tap = handle.tap()
        # The run's first events gather too: a run that ends within signal_every() is
        # told to the workflow by its outcome alone (two workflow tasks, as a bare
        # workflow's), and a reply's first text came no later for it: it seldom comes
        # before the first batch would be due.
        tap.pace()
        flusher = asyncio.create_task(self._flush_batches(tap))
        handle.scope.add_listener(self._step)
        if self.here is not None:  # asked before the run started
            self.end_here(*self.here)
        for sent in self.request.sends:
            self._obey(handle, sent)
        self.background.spawn(self._tick())
        returns = False
        try:
            await ended(handle)
            returns = True
        except asyncio.CancelledError:
            # Temporal cancelled the activity: the run gets the cancel, settles, and the
            # activity ends cancelled (its transcript is in the store).
            details = activity.cancellation_details()
            if activity.is_worker_shutdown():
                reason = "the worker shut down; the run goes on on another worker"
            elif details is not None and details.timed_out:
                reason = "the turn timed out in Temporal"
            else:
                reason = await self._cancel_reason()
            handle.cancel(reason)
            await _uncancellable(ended(handle))
            raise
        finally:
            await self.background.aclose()  # the ticker, and a stop's wait
            await _uncancellable(flusher)  # every batch but the run's last
            if not returns:
                await _uncancellable(self._send_batch(tap))
        return await self._returned(handle, tap)

    async def _returned(self, handle: RunHandle[Any], tap: EventTap) -> TurnOutcome:
        """The turn's outcome, with the run's last events in it: one signal (and one
        workflow task) fewer a run than signalling them. Signalled instead when the
        turn fails (an outcome that is raised carries nothing) or they are many."""
        last = [event_data(event) for event in tap.peek() if self._signalled(event)]
        try:
            outcome = await self._outcome(handle)  # after _signalled: it reads self.final
        except BaseException:
            await _uncancellable(self._send_batch(tap))
            raise
        outcome.messages_from = self.messages_from
        if len(last) > _BATCH_EVENTS:
            await _uncancellable(self._send_batch(tap))
            return outcome
        tap.take()
        return dataclasses.replace(outcome, events=last)

    async def _begins(self) -> int:
        """Where the run's messages begin, for its first turn when no ``aimu.begin``
        counted them: the first attempt counts them (it holds the session's lock) and, to
        run a task, records the count in the run's record before the task is stored; a
        later attempt reads it there (none: the first stored nothing of the run)."""
        request, agent = self.request, self.agent
        if self.attempt > 1:
            record = await self.owner.store.run(request.run_id)
            if (record is not None and record.session == request.session
                    and record.messages_from is not None):
                return record.messages_from
        count = len(agent.messages)
        writer = agent.session_writer
        if request.task is not None and writer is not None:
            # Stored before the task is: the run rewrites this record as it starts (the
            # same id; the same count, or one more if it places a system message first).
            await writer.record_run(RunRecord(
                id=request.run_id, session=request.session, agent=agent.name,
                started=time.time(), status="running", messages_from=count,
            ))
        return count

    async def unbegun(self) -> None:
        """A run stopped or failed before its record was written as it began (cancelled
        as it opened, its instructions raised) left the record :meth:`_begins` wrote
        saying ``running``: it says how the run ended instead. Not for a turn that goes
        on elsewhere (superseded, drained): the turn that takes over writes it."""
        request, handle = self.request, self.handle
        writer = self.agent.session_writer
        if (self.messages_from is None or request.task is None or writer is None
                or handle is None or self.superseded or self.drained
                or handle.status not in STOPPED):
            return
        with contextlib.suppress(StoreError):  # the record then says running, as if it died
            record = await self.owner.store.run(request.run_id)
            if record is not None and record.status == "running":
                await writer.record_run(dataclasses.replace(
                    record, status=handle.status, ended=time.time(),
                    reason=handle.reason or "the run ended before it began",
                ))

    async def _start(self) -> RunHandle[Any]:
        request, agent = self.request, self.agent
        begins = request.messages_from
        if begins is None:
            begins = self.messages_from = await self._begins()
        if request.task is not None and not _stored(agent.messages, begins, request.task):
            run = agent.run(request.task)
        else:
            waiting = {p.call_id: p for p in agent.pending_approvals}
            for decision in request.decisions:
                pending = waiting.get(decision.call_id)
                if pending is None:
                    continue  # decided by an earlier attempt of this turn
                if decision.pause_id not in (None, pending.pause_id):
                    raise ApplicationError(
                        f"run {request.run_id}: session {request.session!r} no longer waits "
                        f"on the tool call {decision.call_id[:64]!r} the run paused on (it "
                        f"was replaced: {pending.tool} asked again since); the decision was "
                        "not applied and nothing ran", type=STALE, non_retryable=True,
                    )
                if decision.result is not None:
                    agent.answer(decision.call_id, decision.result)
                elif decision.approve:
                    agent.approve(decision.call_id)
                else:
                    agent.deny(decision.call_id, decision.reason)
            try:
                run = agent.resume()
            except ValueError as error:
                raise ApplicationError(
                    f"session {request.session!r}: {error}", type="AimuBadInput",
                    non_retryable=True,
                ) from None
        name = f"run {request.run_id}"
        control = await self._control()
        self.registered = control is not None
        if control is None:  # its id still names the run its pauses belong to
            return RunHandle.start(run, name=name, run_id=request.run_id)
        return RunHandle.start(run, name=name, run_id=request.run_id, control=control)

    async def _control(self) -> Any:
        """The Redis control to register this attempt with, if there is one to use."""
        control = self.owner.control
        if control is None:
            return None
        if self.request.segment == 0 and self.attempt == 1:
            return control
        run_id = self.request.run_id
        try:
            # The resumed part after a pause: the record says paused until it is reopened
            # (by this attempt, or by an earlier one that died before it registered);
            # the turn after one handed off: pending (or as that one ended, if it died).
            if self.request.segment != 0 and (
                await control.reopen(run_id)
                or (self.request.continued and await _reopened(control, run_id))
            ):
                return control
            if self.attempt == 1:
                return None  # not paused in Redis: nothing of this run to take over
            # A retry: the dead worker's registration must be lost to be taken over.
            if await control.claim(run_id) is not None:
                return control
        except ControlError as error:
            _log.warning("run %s: Redis control not used: %s", run_id, error)
        return None

    def _signalled(self, event: Event) -> bool:
        """True if ``event`` goes to the workflow (notes the run's own end)."""
        if isinstance(event, RunFinished) and self._own(event):
            self.final = event
            # Handed off: not an end, the run goes on in the workflow's next execution.
            return not self._handed_off(event.status)
        if isinstance(event, RunStarted) and self._own(event) and self.request.continued:
            return False  # the run goes on: it started in the execution before
        return not isinstance(event, HandleFinished)  # the workflow knows how it ended

    def _own(self, event: RunStarted | RunFinished) -> bool:
        """``event`` is of the turn's own run (not of an agent it runs as a tool)."""
        return not event.path and event.source == self.agent.name

    async def _flush_batches(self, tap: EventTap) -> None:
        """Signal the events to the workflow, gathered for :meth:`Activities.signal_every`
        (after a quiet while, at once); the run's end and those
        after it are left for :meth:`_returned`. Never cancelled (a batch half-signalled
        would be lost): the run's end ends it."""
        while await tap.ready(_BATCH_EVENTS, every=self.owner.signal_every()):
            if not await self._send_batch(tap, whole=False):
                return

    def _before_end(self, events: list[Event]) -> list[Event]:
        """``events`` up to the run's own end (all of them if it is not among them)."""
        for index, event in enumerate(events):
            if isinstance(event, RunFinished) and self._own(event):
                return events[:index]
        return events

    async def _send_batch(self, tap: EventTap, *, whole: bool = True) -> bool:
        """Signal the events held, in order, each batch taken once signalled (not
        ``whole``: one batch, of those before the run's own end); Temporal away, keep
        trying (the events that come meanwhile join) for _SIGNAL_SECONDS. False once the
        run's end is the next event held (or the tap has ended): the turn's outcome
        carries the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SIGNAL_SECONDS
        delay = 0.1
        while events := tap.peek(_BATCH_EVENTS):
            if not whole:
                events = self._before_end(events)
                if not events:
                    return False
            batch = [event_data(event) for event in events if self._signalled(event)]
            try:
                if batch:
                    await self.workflow.signal("aimu.events", batch)
            except Exception as error:  # followers miss them; the run and store do not
                if loop.time() > deadline:
                    lost = [e for e in tap.take() if self._signalled(e)]
                    _log.warning("run %s: %d events not delivered: %s",
                                 self.request.run_id, len(lost), error)
                    return not tap.ended
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
                continue
            tap.advance(len(events))
            if not whole:
                return True  # the next batch when it is due: the run may end before
        return not tap.ended

    async def _tick(self) -> None:
        """Take the controls the workflow accepted, every :meth:`Activities.read_every`
        from the turn's start: a run that ends sooner reads none (each read is a query
        the dev server hands a worker: one a run was a tenth of a short run's cost)."""
        handle = self.handle
        assert handle is not None
        while True:
            await asyncio.sleep(self.owner.read_every())
            try:
                controls: list[Control] = await self.workflow.query(
                    CONTROLS_QUERY, self.applied, result_type=list[Control]
                )
            except Exception as error:
                _log.debug("run %s: controls not read: %s", self.request.run_id, error)
                controls = []
            for control in controls:
                if not self._obey(handle, control):
                    break  # the run is ending: the workflow gives it to a resumed turn
                self.applied = max(self.applied, control.seq)

    async def _cancel_reason(self) -> str:
        """The reason the caller gave the workflow's cancel (asked of it, briefly)."""
        try:
            async with asyncio.timeout(_REASON_SECONDS):
                controls: list[Control] = await self.workflow.query(
                    CONTROLS_QUERY, 1 << 62, result_type=list[Control],
                    rpc_timeout=timedelta(seconds=_REASON_SECONDS),
                )
        except Exception as error:
            _log.debug("run %s: cancel reason not read: %s", self.request.run_id, error)
            return self.cancel_reason
        return next((c.text for c in controls if c.kind == "cancel" and c.text),
                    self.cancel_reason)

    def _handed_off(self, status: str) -> bool:
        """The turn ended for the run to go on in another turn (to continue as new, or
        as this worker drains), not for a person."""
        if self.stopped:
            return False
        if status == "interrupted":
            return self.handed or self.drained
        handle = self.handle
        return (status == "cancelled" and self.drained and handle is not None
                and handle.reason == DRAINED)

    def _obey(self, handle: RunHandle[Any], control: Control) -> bool:
        """Apply ``control`` to the run; False for one the ending run did not take. One
        that does not check out (the workflow checks what it takes, but its history may
        come from an older aimu) is logged and dropped, never read as a path on this
        worker's disk, never a failed activity."""
        if control.kind == HANDOFF:
            self.handoff = True  # the run stops at the end of its tool round (see _step)
            return True
        try:
            request = control.steer()
            if request.reason is not None:  # a cancel: its reason is the caller's
                self.cancel_reason = request.reason or self.cancel_reason
                request = dataclasses.replace(request, reason=self.cancel_reason)
            if steer(handle, request, self._spawn):
                if not request.must_be_taken:
                    self.stopped = True  # by a caller: not a handoff
                return True
        except (TypeError, ValueError) as error:
            _log.warning("a request that does not check out was dropped: %s", error)
            return True
        # Not taken: the run ended (or is being cancelled) as it came. A run that paused
        # gives it to the turn resumed after the decisions (the workflow's CARRY_UNTAKEN).
        _log.info("run %s: a %s arrived as the run ended", self.request.run_id, request.kind)
        return False

    def _spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        self.background.spawn(work)

    async def _outcome(self, handle: RunHandle[Any]) -> TurnOutcome:
        final = self.final
        status = handle.status
        if self.superseded:  # Temporal took the turn from this attempt: nobody reads this
            raise ApplicationError(SUPERSEDED, type="AimuSuperseded")
        if self._handed_off(status):
            return await self._handoff_outcome(status)
        if status in BY_CANCEL:
            # Stopped from outside Temporal (Redis, or a stop's grace ran out): cancel the
            # workflow too, so it ends cancelled and is not retried.
            reason = handle.reason or "cancelled"
            with contextlib.suppress(Exception):
                await self.workflow.cancel(reason=reason)
            raise ApplicationError(  # benign: logged at DEBUG, not as a failure
                reason, type=CANCELLED, non_retryable=True,
                category=ApplicationErrorCategory.BENIGN,
            )
        if final is None:  # the run failed before it began (the store, the session)
            return TurnOutcome(
                "failed", error=f"the run ended {status} before it began", applied=self.applied
            )
        ended = final.status if status != "failed" else "failed"
        return TurnOutcome(
            status=HANDED_OFF if self._handed_off(ended) else ended,
            reply=final.reply,
            error=final.error,
            usage={"input_tokens": final.usage["input_tokens"],
                   "output_tokens": final.usage["output_tokens"]},
            pending=[p.as_json() for p in self.agent.pending_approvals],
            applied=self.applied,
        )


    async def _handoff_outcome(self, status: str) -> TurnOutcome:
        """The turn ended (``status``) for the run to go on in another turn: in Redis
        too it is pending (its end here is not the run's) until that turn registers."""
        control = self.owner.control
        if self.registered and control is not None:
            try:
                async with asyncio.timeout(_REDIS_SECONDS):
                    await control.flush()  # its end here is written first
                    await control.reopen(self.request.run_id, was=status)
            except (ControlError, TimeoutError) as error:
                _log.warning("run %s: not shown pending in Redis: %s",
                             self.request.run_id, error or "timed out")
        final = self.final
        usage = {} if final is None else {"input_tokens": final.usage["input_tokens"],
                                          "output_tokens": final.usage["output_tokens"]}
        return TurnOutcome(HANDED_OFF, usage=usage, applied=self.applied, ended=status)


def _applied(request: TurnOrder, taken: list[_Running]) -> int:
    """The number of the last control the turn took (its heartbeat's details)."""
    attempt = taken[0].attempt if taken else None
    return request.controls_after if attempt is None else attempt.applied


async def _reopened(control: Any, run_id: str) -> bool:
    """Make the run pending in Redis for the turn after one that handed it off: True if
    it is (already, or now from how that turn ended there)."""
    status = (await control.status(run_id)).status
    return bool(status == "pending" or (
        status in RECOVERABLE and await control.reopen(run_id, was=status)
    ))


async def _mark_drained(store: Store, request: TurnOrder, handle: RunHandle[Any]) -> None:
    """Mark the record of the run a drain stopped to be recovered (the workflow goes on
    with it on another worker, whose turn records it ``running`` again)."""
    if handle.status not in RECOVERABLE:
        return  # it ended on its own meanwhile
    try:
        writer = await store.open_session(request.session)
    except (SessionLockedError, StoreError):
        return  # the session goes on elsewhere already
    try:
        record = await store.run(request.run_id)
        if record is not None and record.status == handle.status:
            await writer.record_run(dataclasses.replace(record, recover=True))
    except StoreError as error:
        _log.warning("run %s: not marked to be recovered: %s", request.run_id, error)
    finally:
        await writer.aclose()


def _check_session(session: str) -> None:
    """A session name that does not check out fails the run at once (no retry fixes it)."""
    try:
        validate_session_name(session)
    except (TypeError, ValueError) as error:
        raise ApplicationError(str(error), type="AimuBadInput", non_retryable=True) from None


def _stored(messages: list[Message], messages_from: int, task: str) -> bool:
    """True if ``task`` was recorded after message ``messages_from`` (an earlier attempt)."""
    return any(
        m["role"] == "user" and m.get("content") == task for m in messages[messages_from:]
    )


async def _uncancellable(work: Any) -> None:
    """Finish ``work`` even if this task is cancelled again meanwhile, then re-raise that."""
    task = asyncio.ensure_future(work)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
