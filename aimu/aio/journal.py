"""The tool journal's rule: which calls a crash left *in doubt*, and what becomes of them.

With a store, the agent journals each tool call's start (``record_tool_start``, durable)
just before the tool runs; the call's result is its tool message, recorded when it
finishes. So a call of the stored transcript's last assistant turn that has a journal
entry and no result was running when the process stopped: its side effect may or may
not have happened. When the session is loaded again each such call follows its tool's
policy: ``idempotent=True`` runs it again (its result then starts with
:data:`RERUN_NOTE`), ``approval=True`` waits for a person's decision, an agent called as a tool
(``agent.as_tool()``) continues its own session where it stopped, any other tool is
not run again and gets :data:`IN_DOUBT_RESULT`.
A dangling call without a journal entry never started: it is settled "cancelled", as
after any stop.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from aimu.aio.store import ToolStart
from aimu.aio.tools import Tool
from aimu.aio.transcript import CANCELLED_RESULT, Message, ToolCall, answer_open_calls

__all__ = ["IN_DOUBT_RESULT", "RERUN_NOTE", "InDoubt", "resolve_in_doubt"]

log = logging.getLogger("aimu.aio.journal")

#: The result of a call that was running when the process stopped and is not run again.
IN_DOUBT_RESULT = (
    "[outcome unknown: the process stopped while this tool ran; it was not run again, "
    "so its effect may or may not have happened]"
)

#: The first line of the result of an in-doubt call that was run again (idempotent tool).
RERUN_NOTE = (
    "[in doubt: the process stopped while this call ran; the tool is idempotent, so it "
    "was run again]"
)


@dataclass(slots=True)
class InDoubt:
    """What loading found in doubt: the calls to run again, those that wait for a person,
    and those answered unknown."""

    rerun: list[ToolCall] = field(default_factory=list)
    asked: list[ToolCall] = field(default_factory=list)
    unknown: list[ToolCall] = field(default_factory=list)
    resumed: list[ToolCall] = field(default_factory=list)

    def log(self, where: str) -> None:
        """One WARNING on ``aimu.aio.journal`` when a crash left calls in doubt at ``where``."""
        groups = [
            ("run again on resume", self.rerun),
            ("wait for a person", self.asked),
            ("answered outcome unknown", self.unknown),
        ]
        said = [f"{what}: {_names(calls)}" for what, calls in groups if calls]
        if self.resumed:  # paused inside, or cut by a crash: its own session knows
            log.info("%s: calls of agents called as tools are open, continued inside on "
                     "resume: %s", where, _names(self.resumed))
        if said:
            log.warning(
                "%s: tool calls were running when the process stopped; %s", where, "; ".join(said)
            )


def _names(calls: list[ToolCall]) -> str:
    return ", ".join(f"{call['function']['name']} ({call['id']})" for call in calls)


def resolve_in_doubt(
    messages: list[Message],
    starts: Iterable[ToolStart],
    tools: Mapping[str, Tool],
    waiting: Collection[str] = (),
    approved: Collection[str] = (),
) -> InDoubt:
    """Settle ``messages`` in place after a stop, the journal ``starts`` deciding.

    Every dangling call gets a result except the calls in ``waiting`` (they wait for a
    person's decision already) and the in-doubt calls of idempotent or approval tools,
    which stay dangling and are returned. An in-doubt call in ``approved`` (a person
    approved it, then the process stopped while it ran) waits for a person again unless
    its tool is idempotent. A call id the journal holds counts as started even if an
    earlier turn reused the id: when unsure, in doubt.
    """
    journaled = {start.call_id for start in starts}
    last_turn = max(
        (i for i, message in enumerate(messages) if message["role"] == "assistant"), default=-1
    )
    found = InDoubt()

    def result(index: int, call: ToolCall) -> str | None:
        # Only the last turn can hold a call the crash cut: earlier ones were settled
        # when the run that followed them was recorded.
        if call["id"] in waiting and call["id"] not in approved:
            return None
        if index != last_turn or call["id"] not in journaled:
            return CANCELLED_RESULT
        tool = tools.get(call["function"]["name"])
        if tool is not None and tool.resumes:
            found.resumed.append(call)  # its agent's session knows where it stopped
            return None
        if tool is not None and tool.idempotent:
            found.rerun.append(call)
            return None
        if (tool is not None and tool.approval) or call["id"] in approved:
            found.asked.append(call)
            return None
        found.unknown.append(call)
        return IN_DOUBT_RESULT

    answer_open_calls(messages, result)
    return found
