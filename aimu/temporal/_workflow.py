"""The Temporal workflow of one aimu run: a session's turn, from its task to its answer.

The workflow orchestrates and holds no aimu state of its own: it runs the agent loop
in the ``aimu.turn`` activity on any worker, whose first attempt fixes where the run's
messages begin (a history from before that replays the ``aimu.begin`` local activity
that counted them first). A paused turn (a tool call
waits for a person) waits *here*, durable and holding no worker, until every call is
decided; then another ``aimu.turn`` resumes it from the store. Controls (interrupt,
stop, send) are recorded here by signal or update and read by the activity; events
come back from the activity by signal, so any client follows the run through queries.

This module runs inside Temporal's workflow sandbox: it imports only the standard
library, ``temporalio``, how a run ends (``aimu.aio.ends``) and the rule for received
images (``aimu.aio.images``): constants and pure functions, passed through the sandbox
as all of aimu is; it does nothing that is not
deterministic on replay.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Final

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception
from temporalio.workflow import ActivityCancellationType

from aimu.aio.ends import FINAL, error_text
from aimu.aio.images import is_data_url
from aimu.aio.status import LIVE
from aimu.aio.steering import Steer

__all__ = [
    "BEGIN",
    "CANCELLED",
    "CONTROLS_QUERY",
    "END_PAUSED",
    "HANDED_OFF",
    "HANDOFF",
    "HISTORY_EVENTS",
    "MAX_SENT_IMAGE_CHARS",
    "NOT_RETRIED",
    "STALE",
    "STATE_QUERY",
    "TURN",
    "WORKFLOW",
    "CallDecision",
    "CarriedRun",
    "Control",
    "RunRequest",
    "RunWorkflow",
    "TurnOrder",
    "TurnOutcome",
]

WORKFLOW: Final = "aimu.run"
BEGIN: Final = "aimu.begin"
TURN: Final = "aimu.turn"
#: The patch (``workflow.patched``) under which a run resumed after its pause takes the
#: controls its paused turn did not: a history from before it replays as it ran.
CARRY_UNTAKEN: Final = "aimu-carry-untaken-controls"
#: The local activity that records a run cancelled while it was paused (no turn ran to).
END_PAUSED: Final = "aimu.end_paused"
STATE_QUERY: Final = "aimu.state"
CONTROLS_QUERY: Final = "aimu.controls"
#: The error type of a turn cancelled from outside Temporal (Redis): never retried.
CANCELLED: Final = "AimuRunCancelled"
#: The error type of a turn given decisions for a pause that no longer waits in the store.
STALE: Final = "AimuStaleDecision"
#: Errors a retry cannot fix: bad input, the run cancelled, a stale decision.
NOT_RETRIED: Final = ("AimuBadInput", CANCELLED, STALE)
#: The ``data:`` URL characters the images sent to a run during one turn (from its start
#: or a resume to its end or pause) may come to: sends not taken by a turn ride in the
#: next turn's activity input, and Temporal refuses a payload over 2 MB.
MAX_SENT_IMAGE_CHARS: Final = 1_000_000
#: Events one state query returns at most (a follower asks again for the rest).
EVENTS_PER_QUERY: Final = 500
#: The history length (events in Temporal's history, not aimu events) past which a run
#: continues as new, unless Temporal suggests it first (Temporal's hard limit is 51,200).
HISTORY_EVENTS: Final = 10_000
#: The control that asks the running turn to end at its next step boundary so that the
#: run continues as new (not a person's interrupt: the run goes on from there).
HANDOFF: Final = "handoff"
#: A turn's status when it ended for the run to go on in another turn: to continue as
#: new, or because its worker drains.
HANDED_OFF: Final = "handed_off"


@dataclass
class RunRequest:
    """What starts a run: the session, the task (None: resume the session)."""

    run_id: str
    session: str
    task: str | None
    heartbeat_timeout: float = 10.0
    """Seconds of a worker's silence before its turn is retried on another worker."""
    created_at: float = 0.0
    history_events: int = HISTORY_EVENTS
    """Continue as new once the history holds this many events (0: when Temporal says)."""
    carried: CarriedRun | None = None
    """Set when the run continued as new: where the execution before it stopped."""
    begins_in_turn: bool = False
    """The run's first turn finds where its messages begin (see :class:`TurnOrder`),
    with no ``aimu.begin`` before it: set by every client since; a history from before
    lacks it and replays as it ran. The run's ``messages_from`` is then None until that
    turn returns (one cancelled or failed returns nothing: the run's record in the
    store says it)."""


@dataclass
class CallDecision:
    """A person's decision on a tool call the paused run waits on."""

    call_id: str
    approve: bool
    reason: str | None = None
    pause_id: str | None = None
    """The pause it was given for; the turn runs nothing if another pause waits."""
    result: str | None = None
    """The result of an external tool's call (given from outside; ``approve`` true)."""


@dataclass
class Control:
    """A request for the running turn, numbered from 1 in the order it was accepted: a
    :class:`~aimu.aio.steering.Steer` (:meth:`of`, :meth:`steer`), or the workflow's own
    ``handoff`` (end at the next step boundary to continue as new). A cancel through
    Temporal is numbered 0.

    Its fields are the shape histories hold (every aimu's: a cancel's reason in
    ``text``), kept so that a run's history, its continued-as-new input and a turn
    reading its controls outlive an upgrade."""

    seq: int
    kind: str
    text: str | None = None
    grace: float | None = None
    images: list[str] = field(default_factory=list)
    """A send's images, as ``data:`` URLs."""
    input_id: str | None = None
    """The id a send's message is kept under in the session's store (``send_kept``)."""

    @classmethod
    def of(cls, seq: int, request: Steer) -> Control:
        """``request`` numbered ``seq`` (its reason or text as ``text``: a request has
        one of them at most)."""
        text = request.reason if request.reason is not None else request.text or None
        return cls(seq, request.kind, text, request.grace, list(request.images),
                   request.input_id)

    def steer(self) -> Steer:
        """The request this control records (ValueError for a ``handoff``, or a control
        that does not check out)."""
        return Steer.from_json({
            "kind": self.kind, "text": self.text, "grace": self.grace, "images": self.images,
            "aimu_sent": self.input_id,
        })


@dataclass
class TurnOrder:
    """What one ``aimu.turn`` activity does: run ``task`` (or resume) on ``session``."""

    run_id: str
    session: str
    task: str | None
    messages_from: int | None
    """Messages stored before the run: a retried turn finds its task after them. None
    for the run's first turn when no ``aimu.begin`` counted them: the turn counts them
    as it opens the session and stores the count in the run's record before the task
    (a retried turn reads it there), and says it in its outcome."""
    segment: int = 0
    """0 for the first turn of the run, then one more for each resume after a pause."""
    decisions: list[CallDecision] = field(default_factory=list)
    sends: list[Control] = field(default_factory=list)
    """Controls the turn takes as it starts: sends accepted after the turn before it had
    ended, and (after a pause) the stops, interrupts and sends it did not take."""
    controls_after: int = 0
    """Controls up to this number were dealt with by an earlier turn."""
    continued: bool = False
    """The turn goes on from one that ended for the run to continue as new."""


@dataclass
class CarriedRun:
    """What a run that continues as new takes from the execution before it: the turn to
    run next, and the numbering of its events and controls (their earlier ones stay in
    the history of the execution before, which :data:`STATE_QUERY` answers for too)."""

    turn: TurnOrder
    messages_from: int | None
    events_before: int
    controls_before: int
    controls: list[Control] = field(default_factory=list)
    """The controls the execution before had not given to a turn yet."""
    usage: dict[str, int] = field(default_factory=dict)
    executions: int = 1
    """The executions of the run before this one."""


@dataclass
class TurnOutcome:
    """How a turn ended, as the activity saw it."""

    status: str
    reply: str | None = None
    error: str | None = None
    reason: str | None = None
    usage: dict[str, int] = field(default_factory=dict)
    pending: list[dict[str, Any]] = field(default_factory=list)
    """The calls a paused run waits on (call id, tool, arguments, in doubt)."""
    applied: int = 0
    """The number of the last control the turn took."""
    ended: str | None = None
    """A handed-off turn's own end (``interrupted``, or ``cancelled`` by a drain)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The run's last events, after those signalled (``aimu.events``)."""
    messages_from: int | None = None
    """Where the run's messages begin in its session, when the turn found it (its
    order's ``messages_from`` was None)."""


def report_unread(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The workflow loop's report of an error nobody read, but for one that was read in
    effect: a turn that failed ``CANCELLED`` (its run cancelled through Redis; the turn
    asked Temporal to cancel the workflow first) whose failure came in the same
    activation as that cancel. Temporal's SDK then raises the cancel where the turn is
    awaited and leaves the failure in the activity's future, unread; both say the same
    stop, and the run ends cancelled. Every other report goes on as it would."""
    error = context.get("exception")
    if (
        isinstance(error, ActivityError)
        and isinstance(error.cause, ApplicationError)
        and error.cause.type == CANCELLED
        and "never retrieved" in str(context.get("message", ""))
    ):
        return
    loop.default_exception_handler(context)


@workflow.defn(name=WORKFLOW)
class RunWorkflow:
    """One aimu run on Temporal (see the module docstring)."""

    def __init__(self) -> None:
        self._request: RunRequest | None = None
        self._status = "pending"
        self._reason: str | None = None
        self._reply: str | None = None
        self._error: str | None = None
        self._usage: dict[str, int] = {"input_tokens": 0, "output_tokens": 0}
        self._messages_from: int | None = None
        self._pending: list[dict[str, Any]] = []
        self._decisions: dict[str, CallDecision] = {}
        self._controls: list[Control] = []
        self._controls_before = 0  # controls numbered before this execution's first
        self._events: list[dict[str, Any]] = []
        self._events_before = 0  # events the executions before this one hold
        self._executions = 0
        self._handing_off = False
        self._finished_at: float | None = None
        self._cancel_reason: str | None = None
        self._unsent: list[str] = []
        self._turn_from = 0  # the controls before this number went to an earlier turn

    # -- the run ---------------------------------------------------------------------

    @workflow.run
    async def run(self, request: RunRequest) -> dict[str, Any]:
        self._request = request
        asyncio.get_running_loop().set_exception_handler(report_unread)
        try:
            turn = self._carry(request.carried)
            if turn is None and request.begins_in_turn:
                turn = TurnOrder(request.run_id, request.session, request.task, None)
            elif turn is None:  # a history from before begins_in_turn: as it ran
                self._messages_from = await workflow.execute_local_activity(
                    BEGIN,
                    request.session,
                    result_type=int,
                    start_to_close_timeout=timedelta(seconds=60),
                    retry_policy=RetryPolicy(
                        maximum_interval=timedelta(seconds=5),
                        non_retryable_error_types=list(NOT_RETRIED),
                    ),
                )
                turn = TurnOrder(request.run_id, request.session, request.task,
                                   self._messages_from)
            await self._turns(request, turn)
        except GeneratorExit:
            # The worker evicted this workflow from its cache (it is replayed elsewhere):
            # nothing ended, and no workflow call may run outside its event loop now.
            raise
        except workflow.ContinueAsNewError:
            raise
        except BaseException as error:
            self._ended_by(error)
            raise
        return self._state(self._event_count())

    def _carry(self, carried: CarriedRun | None) -> TurnOrder | None:
        """Take over from the execution before this one (None: this is the first)."""
        if carried is None:
            return None
        self._status = "running"
        self._messages_from = carried.messages_from
        self._events_before = carried.events_before
        self._controls_before = carried.controls_before
        self._controls = list(carried.controls)
        self._usage = dict(carried.usage)
        self._executions = carried.executions
        return carried.turn

    async def _turns(self, request: RunRequest, turn: TurnOrder) -> None:
        while True:
            if workflow.cancellation_reason() is not None:
                # Cancelled as the last turn ended (it went to that turn, which ended
                # without it, and is not delivered again): no turn starts after it.
                raise asyncio.CancelledError(workflow.cancellation_reason())
            self._status = "running"
            outcome = await self._turn(turn, request.heartbeat_timeout)
            self._take(outcome)
            messages_from = self._messages_from
            if outcome.status == HANDED_OFF:
                turn = TurnOrder(request.run_id, request.session, None, messages_from,
                                   turn.segment + 1, controls_after=outcome.applied,
                                   continued=True)
                if workflow.cancellation_reason() is None:
                    self._continue_as_new(request, turn)
                    continue  # a drained worker's turn: the next goes on in this execution
                # A cancel came as the turn ended: no turn starts after it.
                await self._end_paused(request, outcome.ended or "interrupted")
                raise asyncio.CancelledError(workflow.cancellation_reason())
            if outcome.status == "paused":
                decisions = await self._decided(request, outcome)
                # A stop, interrupt or send that came as the turn was pausing (or while
                # the run waited) was accepted: the resumed turn takes it as it starts.
                untaken = (self._controls_from(outcome.applied)
                           if workflow.patched(CARRY_UNTAKEN) else [])
                turn.sends = [c for c in untaken if c.kind != HANDOFF]
            else:
                decisions = []
                sends = [c for c in self._controls_from(outcome.applied) if c.kind == "send"]
                if outcome.status != "completed" or not sends:
                    # the run was stopped: said, not lost in silence
                    self._unsent = [c.text or "" for c in sends]
                    self._finish(outcome.status)
                    return
                turn.sends = sends
            turn = TurnOrder(
                request.run_id,
                request.session,
                None,
                messages_from,
                turn.segment + 1,
                decisions,
                turn.sends,
                self._control_count(),
            )
            self._continue_as_new(request, turn)

    async def _decided(self, request: RunRequest, outcome: TurnOutcome) -> list[CallDecision]:
        """Wait paused until every call the run waits on is decided (or the run is
        cancelled: its pause recorded cancelled); the decisions."""
        self._pending = outcome.pending
        self._status = "paused"
        try:
            # A cancel that came as the turn was pausing went to the turn, which ended
            # paused without it: it is not delivered again, so look.
            await workflow.wait_condition(
                lambda: self._all_decided() or workflow.cancellation_reason() is not None
            )
            if workflow.cancellation_reason() is not None:
                raise asyncio.CancelledError(workflow.cancellation_reason())
        except asyncio.CancelledError:
            await self._end_paused(request)
            raise
        decisions = [_bound(self._decisions[p["call_id"]], p) for p in self._pending]
        self._pending, self._decisions = [], {}
        return decisions

    def _continue_as_new(self, request: RunRequest, turn: TurnOrder) -> None:
        """Go on in a new execution with ``turn`` if this one's history is long enough,
        and no cancel waits (that ends the run here, with its reason)."""
        if not self._history_full() or workflow.cancellation_reason() is not None:
            return
        after = turn.controls_after
        carried = CarriedRun(
            turn,
            turn.messages_from,
            self._event_count(),
            after,
            [c for c in self._controls_from(after) if c.kind != HANDOFF],
            dict(self._usage),
            self._executions + 1,
        )
        request = replace(request, carried=carried)
        workflow.continue_as_new(request)

    def _history_full(self) -> bool:
        info = workflow.info()
        limit = self._request.history_events if self._request is not None else 0
        return info.is_continue_as_new_suggested() or (
            limit > 0 and info.get_current_history_length() >= limit
        )

    def _controls_from(self, seq: int) -> list[Control]:
        """The controls numbered above ``seq``."""
        return self._controls[max(0, seq - self._controls_before) :]

    def _control_count(self) -> int:
        return self._controls_before + len(self._controls)

    def _event_count(self) -> int:
        return self._events_before + len(self._events)

    async def _turn(self, turn: TurnOrder, heartbeat_timeout: float) -> TurnOutcome:
        self._turn_from = turn.controls_after
        try:
            outcome: TurnOutcome = await workflow.execute_activity(
                TURN,
                turn,
                result_type=TurnOutcome,
                start_to_close_timeout=timedelta(days=7),
                heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=200),
                    maximum_interval=timedelta(seconds=5),
                    non_retryable_error_types=list(NOT_RETRIED),
                ),
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            )
            return outcome
        except ActivityError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type == STALE:
                self._error = cause.message  # said as it is, not as an activity's failure
            if isinstance(cause, ApplicationError) and cause.type == CANCELLED:
                # Cancelled through Redis: the activity asked Temporal to cancel this
                # workflow before it failed, so that request arrives (or has).
                self._cancel_reason = cause.message
                await workflow.wait_condition(lambda: workflow.cancellation_reason() is not None)
                raise asyncio.CancelledError(cause.message) from None
            raise

    async def _end_paused(self, request: RunRequest, was: str = "paused") -> None:
        """Cancelled while paused (or as a turn ended to continue as new, ``was``
        ``interrupted``): no turn runs to record it, so the store's session and the Redis
        record (a paused one) are set cancelled here."""
        reason = workflow.cancellation_reason() or "cancelled"
        await workflow.execute_local_activity(
            END_PAUSED,
            args=[request.run_id, request.session, reason, *([was] if was != "paused" else [])],
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=5),
                                     maximum_attempts=20),
        )

    def _all_decided(self) -> bool:
        return all(p["call_id"] in self._decisions for p in self._pending)

    def _take(self, outcome: TurnOutcome) -> None:
        if self._messages_from is None:  # the run's first turn found it
            self._messages_from = outcome.messages_from
        self._events.extend(outcome.events)
        self._reply, self._error = outcome.reply, outcome.error
        self._reason = outcome.reason
        for key, value in outcome.usage.items():
            self._usage[key] = self._usage.get(key, 0) + value

    def _ended_by(self, error: BaseException) -> None:
        if self._status in FINAL:
            return
        if isinstance(error, asyncio.CancelledError) or is_cancelled_exception(error):
            self._reason = (
                self._cancel_reason or workflow.cancellation_reason() or "cancelled"
            )
            self._finish("cancelled")
        else:
            self._error = self._error or error_text(error)
            self._finish("failed")

    def _finish(self, status: str) -> None:
        self._status = status
        self._finished_at = workflow.time()
        self._events.append(
            {
                "type": "handle_finished",
                "name": f"run {workflow.info().workflow_id}",
                "status": status,
                "reason": self._reason,
                "result": self._reply,
                "error": self._error,
            }
        )

    # -- what clients read --------------------------------------------------------------

    def _state(self, after: int) -> dict[str, Any]:
        """The run, with this execution's events after the first ``after`` of the run
        (those before ``events_from`` are the executions' before: ask ``previous_run``)."""
        request = self._request
        local = max(0, after - self._events_before)
        return {
            "run_id": workflow.info().workflow_id,
            "session": None if request is None else request.session,
            "task": None if request is None else request.task,
            "status": self._status,
            "reason": self._reason,
            "reply": self._reply,
            "error": self._error,
            "usage": dict(self._usage),
            "created_at": None if request is None else request.created_at,
            "finished_at": self._finished_at,
            "messages_from": self._messages_from,
            "pending": [p for p in self._pending if p["call_id"] not in self._decisions],
            "unsent": list(self._unsent),
            "event_count": self._event_count(),
            "events": self._events[local : local + EVENTS_PER_QUERY],
            "events_from": self._events_before,
            "previous_run": workflow.info().continued_run_id if self._events_before else None,
            "executions": self._executions + 1,
        }

    @workflow.query(name=STATE_QUERY)
    def state(self, after: int) -> dict[str, Any]:
        """The run as the API reports it, with its events after the first ``after``."""
        return self._state(max(0, after))

    @workflow.query(name=CONTROLS_QUERY)
    def controls(self, after: int) -> list[Control]:
        """The controls after number ``after``, for the running turn to take; last, a
        ``cancel`` numbered 0 with the caller's reason once the run is being cancelled."""
        controls = self._controls_from(after)
        reason = workflow.cancellation_reason()
        if reason is not None:
            controls = [*controls, Control.of(0, Steer("cancel", reason=reason))]
        return controls

    # -- what the activity and clients send ---------------------------------------------

    @workflow.signal(name="aimu.events")
    def events(self, batch: list[dict[str, Any]]) -> None:
        """The running turn's next events, in order."""
        if self._status == "pending":
            self._status = "running"
        self._events.extend(batch)
        if self._status == "running" and not self._handing_off and self._history_full():
            # The running turn ends at its next step boundary; the run goes on from there
            # in a new execution (see _turns).
            self._handing_off = True
            self._record(None)

    @workflow.signal(name="aimu.steer")
    def steer(self, request: dict[str, Any]) -> None:
        """Record a request (:meth:`Steer.to_json`'s form) for the running turn: an
        interrupt or a stop (a no-op once the run has ended). One that does not check
        out is dropped (a signal that raised would fail the workflow's task)."""
        try:
            self._record(Steer.from_json(request))
        except (TypeError, ValueError) as error:
            workflow.logger.warning("a request that does not check out was dropped: %s", error)

    @workflow.signal(name="aimu.interrupt")
    def interrupt(self) -> None:
        """An older client's interrupt (``aimu.steer`` since)."""
        self.steer({"kind": "interrupt"})

    @workflow.signal(name="aimu.stop")
    def stop(self, grace: float) -> None:
        """An older client's stop (``aimu.steer`` since)."""
        self.steer({"kind": "stop", "grace": grace})

    def _record(self, request: Steer | None) -> int:
        """Number ``request`` (None: a handoff) after the others; its number."""
        seq = self._control_count() + 1
        control = Control(seq, HANDOFF) if request is None else Control.of(seq, request)
        self._controls.append(control)
        return seq

    @workflow.update(name="aimu.send")
    def send(
        self, text: str, images: list[str] | None = None, input_id: str | None = None
    ) -> int:
        """Give ``text`` (and ``images``, ``data:`` URLs checked by the client) to the run;
        they join at the next step boundary. Its number."""
        return self._record(Steer("send", text=text, images=tuple(images or ()),
                                  input_id=input_id))

    @send.validator
    def _check_send(
        self, text: str, images: list[str] | None = None, input_id: str | None = None
    ) -> None:
        try:  # the handler makes it: one that raised would fail the workflow's task
            Steer("send", text=text, images=tuple(images or ()), input_id=input_id)
        except (TypeError, ValueError) as error:
            raise ApplicationError(str(error), type="AimuBadInput") from None
        if self._status not in LIVE:
            raise ApplicationError(
                f"run {workflow.info().workflow_id} is {self._status}: the text was not sent; "
                "start a new run with it",
                type="AimuBadInput",
            )
        if not all(is_data_url(url) for url in images or ()):
            raise ApplicationError(  # a path would be read from a worker's disk
                "a send's images must be data: URLs (RunsClient.send converts bytes and "
                "paths)",
                type="AimuBadInput",
            )
        size = sum(map(len, images or ()))
        if size:
            size += sum(len(url) for c in self._controls_from(self._turn_from)
                        for url in c.images)
        if size > MAX_SENT_IMAGE_CHARS:
            raise ApplicationError(
                f"with the images sent before, this turn's come to {size / 1e6:.1f} MB as "
                f"data: URLs, more than the {MAX_SENT_IMAGE_CHARS / 1e6:.0f} MB a run on "
                "Temporal may be sent in one turn (they travel in Temporal's payloads): "
                "send smaller images",
                type="AimuBadInput",
            )

    @workflow.signal(name="aimu.decide")
    def decide(self, decision: CallDecision) -> None:
        """Record a decision on a call the paused run waits on (a signal: it is recorded
        with no worker up; one on a call the run does not wait on changes nothing)."""
        waiting = {p["call_id"]: p.get("pause_id") for p in self._pending}
        if self._status != "paused" or decision.call_id not in waiting:
            return
        if decision.pause_id is None or decision.pause_id == waiting[decision.call_id]:
            self._decisions.setdefault(decision.call_id, decision)


def _bound(decision: CallDecision, pending: dict[str, Any]) -> CallDecision:
    """``decision`` bound to the pause the run recorded for its call (an older aimu's
    pending calls have no pause id: then to whichever waits)."""
    pause_id = pending.get("pause_id")
    if decision.pause_id is not None or not isinstance(pause_id, str):
        return decision
    return CallDecision(decision.call_id, decision.approve, decision.reason, pause_id,
                    decision.result)
