"""The library place: a capability's agent run under a RunHandle (or read as a stream),
its ending landed at an event index (a listener on the handle: the stop lands as event k
is emitted, never after a sleep), then driven on (decisions, resumes) until it answers,
and the invariants checked on what its store holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aimu import aio
from aimu.aio.ends import ANSWERED
from aimu.aio.events import Event, HandleFinished, RunFinished
from aimu.aio.store import Store
from tests.crossings.capabilities import BUILDERS, CLIENT_RESULT, SEND, TASK, Built, Kit
from tests.crossings.invariants import Outcome, Terminal, check
from tests.crossings.matrix import Cell

REASON = "crossing stop"
#: Statuses after which the driver resumes the run (a stop's, a limit's).
RESUMED = frozenset({"cancelled", "interrupted", "timed_out", "limited"})
MAX_SEGMENTS = 8


@dataclass
class Case:
    """One run of a cell with its stop at event ``index`` (None: no stop)."""

    cell: Cell
    index: int | None
    built: Built
    session: str
    seen: int = 0
    stopped: bool = False
    send_at: int = 0
    sent: bool = False
    stopping: list[asyncio.Task[Any]] = field(default_factory=list)
    before: set[asyncio.Task[Any]] = field(default_factory=asyncio.all_tasks)
    """The tasks running before the case (the shared MCP server's): not its leftovers."""
    terminals: list[Terminal] = field(default_factory=list)
    inputs: list[tuple[str, str]] = field(default_factory=lambda: [("task", TASK)])

    def hear(self, event: Event, handle: aio.RunHandle[Any] | None) -> bool:
        """Count ``event``; send or stop at their indices. True: leave the stream now."""
        self.seen += 1
        built = self.built
        if built.send is not None and not self.sent and self.seen == self.send_at + 1:
            self.sent = built.agent.send(built.send)
            if self.sent:
                self.inputs.append(("send", SEND))
        if self.index is None or self.stopped or self.seen != self.index + 1:
            return False
        self.stopped = True
        ending = self.cell.ending
        if handle is None:
            return ending == "leave"
        if ending == "cancel":
            handle.cancel(REASON)
        elif ending == "interrupt":
            handle.interrupt()
        elif ending == "stop":
            self.stopping.append(asyncio.get_running_loop().create_task(handle.stop(grace=0)))
        elif ending == "deadline":
            handle.reschedule(asyncio.get_running_loop().time())
        return False


def limits_for(ending: str) -> aio.UsageLimits | None:
    if ending == "requests":
        return aio.UsageLimits(requests=1)
    if ending == "tokens":
        return aio.UsageLimits(output_tokens=2)
    return None


def segment(case: Case, first: bool, stream: bool) -> Any:
    agent = case.built.agent
    if first:
        return agent.run(TASK, limits=limits_for(case.cell.ending), stream=stream)
    return agent.resume(limits=aio.UsageLimits(), stream=stream,
                        continue_partial=case.built.continue_partial)


async def under_handle(case: Case, first: bool) -> None:
    run_id = f"{case.session}-{len(case.terminals)}"
    handle: aio.RunHandle[Any] = aio.RunHandle.start(segment(case, first, False), run_id=run_id)
    handle.add_listener(lambda event: case.hear(event, handle))
    events = handle.events(maxsize=100_000)
    await handle.wait()
    for stopping in case.stopping:
        await stopping
    heard = [event async for event in events]
    tops = [e for e in heard if isinstance(e, RunFinished) and e.path == ()]
    finals = [e for e in heard if isinstance(e, HandleFinished)]
    assert len(finals) == 1, heard
    status = tops[-1].status if tops else "missing"
    case.terminals.append(Terminal(status, run_id, finals[0].reason, len(tops)))


async def as_stream(case: Case, first: bool) -> None:
    """Read the run as a stream; leave it at the stop's index (a ``break``)."""
    stream: AsyncIterator[Event] = segment(case, first, True)
    tops = 0
    async with aclosing(stream):  # type: ignore[type-var]
        async for event in stream:
            tops += isinstance(event, RunFinished) and event.path == ()
            if case.hear(event, None):
                break
    last = case.built.agent.last_run
    assert last is not None
    # A reader that left saw no terminal event: the record alone says how it ended.
    case.terminals.append(Terminal(last.status, None, None, max(tops, 1)))


def decide(case: Case) -> None:
    agent = case.built.agent
    for pending in agent.pending_approvals:
        if pending.external:
            agent.answer(pending, CLIENT_RESULT)
            case.inputs.append(("client", CLIENT_RESULT))
        else:
            agent.approve(pending)


async def drive(case: Case) -> None:
    """Run the case's segments until the run answers."""
    agent = case.built.agent
    for number in range(MAX_SEGMENTS):
        leaving = case.cell.ending == "leave" and not case.stopped
        await (as_stream if leaving else under_handle)(case, number == 0)
        status = agent.last_status
        if status in ANSWERED:
            return
        if status == "paused" and case.built.decide:
            decide(case)
        elif status not in RESUMED and status != "paused":
            last = agent.last_run
            raise AssertionError(f"the run ended {status}: {last and last.error}")
    raise AssertionError(f"no answer after {MAX_SEGMENTS} segments: {agent.last_status}")


async def outcome_of(case: Case, store: Store, session: str) -> Outcome:
    names = [info.name for info in await store.sessions()
             if info.name == session or info.name.startswith(session + "--")]
    levels = {name: await store.load(name) for name in names}
    records = [r for r in await store.runs(limit=1000) if r.session in levels]
    leftovers = [f"open stream of {m.model}" for m in case.built.models if m.open_streams]
    current = asyncio.current_task()
    leftovers += [repr(t) for t in asyncio.all_tasks() - case.before
                  if t is not current and not t.done()]
    return Outcome(
        top=session, agent="top", levels=levels, records=records, terminals=case.terminals,
        inputs=case.inputs, effects=dict(case.built.effects.runs),
        idempotent=case.built.idempotent, leftovers=leftovers,
    )


async def run_case(
    cell: Cell, index: int | None, store: Store, session: str, strict_url: str,
    extra: dict[str, Any],
) -> int:
    """Run ``cell`` once with its stop at event ``index``; check it; the events seen."""
    kit = Kit(store, session, cell.rng(), extra=extra)
    built = BUILDERS[cell.capability](kit)
    case = Case(cell, index, built, session, send_at=kit.rng.randrange(6))
    try:
        await drive(case)
        await built.agent.aclose()
        outcome = await outcome_of(case, store, session)
        check(outcome, strict_url)
        order = built.effects.order
        if cell.capability == "input_guardrail" and any(o.startswith("tool:") for o in order):
            # No tool runs on a task the input guardrail has not passed.
            first_tool = next(i for i, o in enumerate(order) if o.startswith("tool:"))
            assert "guardrail:input" in order[:first_tool], order
        if built.output_type is not None:
            assert isinstance(built.agent.last_run.output, built.output_type)  # type: ignore[union-attr]
        return case.seen
    finally:
        await built.agent.aclose()
        for close in built.closers:
            await close()


async def run_cell(
    cell: Cell, tmp_path: Path, strict_url: str, *, sweep: bool,
    extra: Callable[[], Any] | None = None,
) -> int:
    """The cell: a run with no stop (which counts the events), then the ending at one
    seeded index, or at every index when ``sweep``. Returns the cases run."""
    kind = cell.rng().choice(("sqlite", "sqlite", "jsonl"))
    store: Store = (aio.SQLiteStore(tmp_path / "cell.db") if kind == "sqlite"
                    else aio.JSONLStore(tmp_path / "jsonl"))
    shared = await extra() if extra is not None else {}
    try:
        total = await run_case(cell, None, store, "probe", strict_url, shared)
        indexed = cell.ending in ("cancel", "interrupt", "stop", "deadline", "leave")
        if not indexed:  # the first run was the case (its budget, or no stop at all)
            return 1
        indices = range(total) if sweep else [cell.rng().randrange(total)]
        for k in indices:
            await run_case(cell, k, store, f"case{k}", strict_url, shared)
        return len(indices)
    finally:
        for close in shared.get("closers", ()):
            await close()
        await store.aclose()
