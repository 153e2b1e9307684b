"""Tool approval: calls that wait for a person, and the decisions people give.

A tool declared ``@aio.tool(approval=True)``, or a call an agent's ``approve=`` policy
answers ``"ask"``, is not run: the run records the turn, runs the calls that need no
decision and pauses. :class:`Approvals` keeps the calls waiting and the decisions
given (``approve()`` / ``deny()``) as plain JSON, so a store keeps them across a restart.
This module alone reads and writes that stored form (:meth:`Approvals.from_state`,
:meth:`Approvals.state`); each waiting call names the run that asked, so a decision
meant for one run never decides another's call that happens to share its id.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from aimu.aio._ids import new_token
from aimu.aio.ends import PAUSED
from aimu.aio.errors import StaleDecisionError
from aimu.aio.transcript import ToolCall

__all__ = [
    "PAUSED",
    "ApprovalPolicy",
    "Approvals",
    "Decision",
    "PendingApproval",
    "bound",
    "denied_result",
]

_log = logging.getLogger("aimu.aio.approvals")

#: The key of a session's state under which its approvals are stored.
STATE_KEY: Final = "approvals"

#: Decides one call from its tool name and arguments: run it, refuse it, or ask.
ApprovalPolicy: TypeAlias = Callable[[str, dict[str, Any]], "bool | Literal['ask']"]


def denied_result(reason: str | None) -> str:
    """The result the model sees for a denied call."""
    return f"[denied: {reason}]" if reason else "[denied by a person]"


@dataclass(frozen=True, slots=True)
class PendingApproval:
    """A tool call that waits for ``approve(call_id)`` or ``deny(call_id)``."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    in_doubt: bool = False
    """It was running when the process stopped: approving it runs it again."""
    run_id: str | None = None
    """The registered run (``RunHandle.run_id``) that paused on it, if it had an id."""
    pause_id: str = ""
    """This pause of the call: a decision binds to it (see the module docstring)."""
    path: tuple[str, ...] = ()
    """Where it waits in an agent tree: the ids of the calls of agents called as tools
    (``agent.as_tool()``) that lead from the agent asked down to the one that waits;
    ``()`` for the agent's own call. Decide it at the top: the decision goes down."""
    external: bool = False
    """A call of an external tool (:func:`~aimu.aio.external_tool`): it waits for its
    result (``answer()``), not for a yes or no."""

    def as_json(self) -> dict[str, Any]:
        """The call as the runs API, ``aimu worker`` and the web page show it (``name``
        is the tool's; ``path`` only for a call down an agent tree)."""
        shown = {
            "call_id": self.call_id,
            "name": self.tool,
            "arguments": self.arguments,
            "in_doubt": self.in_doubt,
            "pause_id": self.pause_id,
            "external": self.external,
        }
        if self.path:
            shown["path"] = list(self.path)
        return shown


@dataclass(frozen=True, slots=True)
class Decision:
    approved: bool
    reason: str | None = None
    pause_id: str | None = None
    """The pause it was given for (None: whichever waits when it is recorded)."""
    result: str | None = None
    """The result of an external tool's call, given from outside (``answer()``)."""


def bound(
    call: str | PendingApproval, approved: bool, reason: str | None = None,
    result: str | None = None,
) -> tuple[str, Decision]:
    """The call id and the decision on ``call`` (its id: whichever pause waits when the
    decision is recorded; a PendingApproval: the pause it shows)."""
    if isinstance(call, PendingApproval):
        return call.call_id, Decision(approved, reason, call.pause_id, result)
    return call, Decision(approved, reason, None, result)


def new_pause_id() -> str:
    return new_token(12)


def fingerprint(call_id: str, tool: str, arguments: object) -> str:
    """The pause id of a call stored before pauses had ids: its name and arguments."""
    data = json.dumps([call_id, tool, arguments], sort_keys=True, default=str)
    return "f-" + hashlib.sha256(data.encode()).hexdigest()[:22]


def stale_decision(session: str, call_id: str, shown: str, pending: PendingApproval | None
                   ) -> StaleDecisionError:
    """The error for a decision given for pause ``shown`` of ``call_id`` that no longer
    waits (``pending``: what waits under that call id now, if anything)."""
    now = "nothing waits under that id now" if pending is None else (
        f"what waits under that id now is another pause ({pending.tool} "
        f"{json.dumps(pending.arguments, default=str)[:120]})"
    )
    return StaleDecisionError(
        f"{session}: the decision on call {call_id!r:.80} was given for pause {shown!r:.40}, "
        f"which no longer waits: {now}; nothing was decided, look at the waiting calls again",
        call_id=call_id,
    )


class Approvals:
    """The calls of one session that wait for a person, and the decisions given."""

    __slots__ = ("decisions", "pending")

    def __init__(self) -> None:
        self.pending: dict[str, PendingApproval] = {}
        self.decisions: dict[str, Decision] = {}

    def waiting(self, run_id: str | None = None) -> list[PendingApproval]:
        """The pending calls with no decision yet, in the order they were asked; given
        ``run_id``, only those that run paused on (or that name no run)."""
        return [
            p for call_id, p in self.pending.items()
            if call_id not in self.decisions and (run_id is None or p.run_id in (None, run_id))
        ]

    def ask(
        self, call: ToolCall, *, in_doubt: bool = False, run_id: str | None = None,
        external: bool = False,
    ) -> None:
        """Make ``call`` wait for a person (``external``: for its result), as a new pause
        (the same one if it waits so already)."""
        function = call["function"]
        name, arguments = function["name"], function["arguments"]
        old = self.pending.get(call["id"])
        same = old is not None and (
            old.tool, old.arguments, old.in_doubt, old.run_id, old.external
        ) == (name, arguments, in_doubt, run_id, external)
        self.pending[call["id"]] = PendingApproval(
            call["id"], name, arguments, in_doubt, run_id,
            old.pause_id if same and old is not None else new_pause_id(), external=external,
        )

    def decide(self, call_id: str, decision: Decision, session: str) -> None:
        """Record a decision, bound to the pause that waits now; ValueError naming the
        call when none is waiting for it, StaleDecisionError when ``decision`` was given
        for another pause of it (both change nothing)."""
        pending = self.pending.get(call_id)
        shown = decision.pause_id
        if shown is not None and (pending is None or pending.pause_id != shown):
            raise stale_decision(session, call_id, shown, pending)
        if call_id in self.decisions:
            raise ValueError(f"{session}: call {call_id!r:.80} was already decided")
        if pending is None:
            waiting = ", ".join(repr(p.call_id) for p in self.waiting()) or "none"
            raise ValueError(
                f"{session}: no call {call_id!r:.80} waits for approval (waiting: {waiting})"
            )
        _check_kind(session, pending, decision)
        self.decisions[call_id] = Decision(
            decision.approved, decision.reason, pending.pause_id, decision.result
        )

    def take(self, call_id: str) -> Decision | None:
        """The decision for ``call_id`` (None: none needed, or none for the pause that
        waits), forgetting the call."""
        pending = self.pending.pop(call_id, None)
        decision = self.decisions.pop(call_id, None)
        if decision is not None and pending is not None and not _binds(decision, pending):
            return None
        return decision

    def adopt(self, given: Approvals, session: str) -> StaleDecisionError | None:
        """Take the decisions of ``given`` (memory, decided while the session was not
        open) that hold for the pauses waiting here (just loaded); the error for the
        first one whose pause no longer waits (it is dropped), or None."""
        stale = None
        for call_id, decision in given.decisions.items():
            pending = self.pending.get(call_id)
            if pending is None or call_id in self.decisions:
                continue  # answered, or decided, since: nothing waits for it
            if _binds(decision, pending):
                self.decisions[call_id] = decision
            elif stale is None:
                stale = stale_decision(session, call_id, decision.pause_id or "", pending)
        return stale

    def check_decided(self, session: str) -> None:
        waiting = self.waiting()
        if waiting:
            names = ", ".join(f"{p.call_id!r} ({p.tool})" for p in waiting)
            raise ValueError(
                f"{session}: calls wait for a decision: {names}; approve() or deny() each, "
                "then resume()"
            )

    def keep_only(self, calls: Mapping[str, object]) -> None:
        """Forget the calls not in ``calls`` (answered since these approvals were saved)."""
        self.pending = {k: v for k, v in self.pending.items() if k in calls}
        self.decisions = {k: v for k, v in self.decisions.items() if k in calls}

    def clear(self) -> None:
        self.pending.clear()
        self.decisions.clear()

    def dump(self) -> dict[str, Any]:
        """Plain JSON data for a store or a workflow's state."""
        return {
            "pending": [
                {"call_id": p.call_id, "tool": p.tool, "arguments": p.arguments,
                 "in_doubt": p.in_doubt, "run_id": p.run_id, "pause_id": p.pause_id,
                 **({"external": True} if p.external else {})}
                for p in self.pending.values()
            ],
            "decisions": {
                call_id: {"approved": d.approved, "reason": d.reason, "pause_id": d.pause_id,
                          **({"result": d.result} if d.result is not None else {})}
                for call_id, d in self.decisions.items()
            },
        }

    @classmethod
    def load(cls, data: object, where: str) -> Approvals:
        """The approvals in :meth:`dump` data (None: none); ValueError naming ``where``."""
        approvals = cls()
        if data is None:
            return approvals
        try:
            if not isinstance(data, Mapping):
                raise TypeError(f"a dict, not {type(data).__name__}")
            for item in data.get("pending") or []:
                run_id, pause_id = item.get("run_id"), item.get("pause_id")
                call_id, tool, arguments = str(item["call_id"]), str(item["tool"]), dict(
                    item["arguments"]
                )
                approvals.pending[call_id] = PendingApproval(
                    call_id, tool, arguments, bool(item.get("in_doubt", False)),
                    None if run_id is None else str(run_id),
                    fingerprint(call_id, tool, arguments) if not pause_id else str(pause_id),
                    external=bool(item.get("external", False)),
                )
            for call_id, item in (data.get("decisions") or {}).items():
                reason, pause_id, result = item.get("reason"), item.get("pause_id"), item.get(
                    "result"
                )
                approvals.decisions[str(call_id)] = Decision(
                    bool(item["approved"]), None if reason is None else str(reason),
                    None if pause_id is None else str(pause_id),
                    None if result is None else str(result),
                )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{where}: unreadable approvals ({error!r:.100})") from error
        for call_id, decision in list(approvals.decisions.items()):
            pending = approvals.pending.get(call_id)
            if pending is not None and not _binds(decision, pending):
                _log.warning("%s: a decision on call %r was given for a pause that no longer "
                             "waits: dropped", where, call_id[:80])
                del approvals.decisions[call_id]
        return approvals

    @classmethod
    def from_state(cls, state: Mapping[str, Any], where: str) -> Approvals:
        """The approvals in a session's stored state (a store's ``load_state``)."""
        return cls.load(state.get(STATE_KEY), where)

    def state(self) -> dict[str, Any]:
        """The session state that stores these approvals (for ``save_state``)."""
        return {STATE_KEY: self.dump()}


def _check_kind(session: str, pending: PendingApproval, decision: Decision) -> None:
    """ValueError if ``decision`` does not fit ``pending``: an external tool's call takes
    a result or a denial, any other call an approval or a denial."""
    if pending.external and decision.approved and decision.result is None:
        raise ValueError(
            f"{session}: call {pending.call_id!r:.80} is of the external tool "
            f"{pending.tool!r}, which runs elsewhere: give its result with answer() (or "
            "deny() it)"
        )
    if not pending.external and decision.result is not None:
        raise ValueError(
            f"{session}: call {pending.call_id!r:.80} ({pending.tool}) waits for approval, "
            "not for a result: approve() or deny() it"
        )


def _binds(decision: Decision, pending: PendingApproval) -> bool:
    """True if ``decision`` was given for the pause of ``pending`` (or for no pause in
    particular: stored before pauses had ids)."""
    return decision.pause_id is None or decision.pause_id == pending.pause_id
