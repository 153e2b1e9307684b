"""The served places: a capability's run started over aimu serve's runs API, followed as
Server-Sent Events, its ending sent when the follower has seen event k (a provable point:
the run may be further on, never behind), then driven on (decisions, resumes) until it
answers; the invariants are checked on the shared store.

The stop, sends and decisions go to ``control``: the same server, or (``--redis``) the
other process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aimu.aio.ends import ANSWERED
from aimu.aio.store import Store
from aimu.testing.server import LoopbackServer
from tests.crossings.invariants import Outcome, Terminal, check, describe
from tests.crossings.matrix import Cell
from tests.crossings.serve_tools import SEND, effects
from tests.serve.harness import sse_events

REASON = "crossing stop"
RESUMED = frozenset({"cancelled", "interrupted", "timed_out", "limited"})
MAX_SEGMENTS = 8
STOP_PATHS = {"cancel": "cancel", "interrupt": "interrupt", "stop": "stop?grace=0"}


@dataclass
class Place:
    """Where served cases run: ``start`` starts and follows runs, ``control`` stops them,
    sends and decides; ``store`` reads what the servers stored."""

    start: httpx.AsyncClient
    control: httpx.AsyncClient
    store: Store
    model: LoopbackServer
    effects: Path
    agent: str = "agent"
    idempotent: frozenset[str] = frozenset({"look", "add"})
    crash: Callable[[], None] | None = None
    """What the kill9 and drain endings do to the process running the run."""
    pause_continues_run: bool = False
    """Temporal: a paused run and its resume after the decisions are one run record."""


@dataclass
class ServedCase:
    cell: Cell
    index: int | None
    place: Place
    session: str
    send_at: int
    seen: int = 0
    stopped: bool = False
    sent: bool = False
    terminals: list[Terminal] = field(default_factory=list)
    inputs: list[tuple[str, str]] = field(default_factory=list)

    @property
    def task(self) -> str:
        return f"cross {self.cell.capability} {self.session}"


async def hear(case: ServedCase, run_id: str) -> bool:
    """Count an event; send or stop at their indices. True: the follower leaves now."""
    case.seen += 1
    control = case.place.control
    if case.cell.capability == "send" and not case.sent and case.seen == case.send_at + 1:
        answer = await control.post(f"/runs/{run_id}/send", json={"text": SEND})
        assert answer.status_code in (202, 409), answer.text
        if answer.status_code == 202:
            case.sent = True
            case.inputs.append(("send", SEND))
    if case.index is None or case.stopped or case.seen != case.index + 1:
        return False
    case.stopped = True
    if case.cell.ending == "leave":
        return True
    if case.cell.ending in ("kill9", "drain"):
        assert case.place.crash is not None
        case.place.crash()
        return case.cell.ending == "kill9"
    path = STOP_PATHS[case.cell.ending]
    body = {"reason": REASON} if case.cell.ending == "cancel" else None
    answer = await control.post(f"/runs/{run_id}/{path}", json=body)
    assert answer.status_code in (202, 409), answer.text
    return False


async def follow(case: ServedCase, run_id: str) -> Terminal:
    """Follow ``run_id`` to its end (again from the start, if the follower left)."""
    finished: list[dict[str, Any]] = []
    events = sse_events(case.place.start, f"/runs/{run_id}/events")
    crashing = case.place.crash is not None
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if event.type == "handle_finished":
                    finished.append(event.data)
                if await hear(case, run_id):
                    break
    except httpx.TransportError:
        if not (crashing and case.stopped):
            raise
    if not finished and crashing and case.stopped:
        return Terminal(None, run_id)  # it died with its process: no one saw its end
    if not finished:  # the follower left; a follower leaving never stops a served run
        events = sse_events(case.place.start, f"/runs/{run_id}/events")
        finished = [e.data async for e in events if e.type == "handle_finished"]
    last = finished[-1]
    return Terminal(last["status"], run_id, last.get("reason"), len(finished))


async def decide(case: ServedCase, run_id: str) -> str:
    """Approve every call the paused run waits on; the resumed run's id."""
    control = case.place.control
    # The session's view: a server that did not run the run (it died) shows it too.
    info = (await control.get(f"/sessions/{case.session}")).json()
    if info.get("paused_run_id") != run_id:
        records = await case.place.store.runs(session=case.session)
        raise AssertionError(f"not paused on {run_id}: {info}; records {describe(records)}")
    resumed = None
    for pending in info["pending"]:
        answer = await control.post(
            f"/runs/{run_id}/approvals/{pending['call_id']}",
            json={"approve": True, "pause_id": pending["pause_id"]},
        )
        assert answer.status_code == 202, answer.text
        resumed = answer.json()["resumed_run_id"] or resumed
    assert resumed is not None, info
    return str(resumed)


async def start_run(case: ServedCase) -> str:
    start = case.place.start
    answer = await start.post(f"/sessions/{case.session}/runs", json={"task": case.task})
    assert answer.status_code == 202, answer.text
    case.inputs.append(("task", case.task))
    return str(answer.json()["run_id"])


async def drive(case: ServedCase, run_id: str | None = None) -> None:
    """Follow ``run_id`` (None: a new run of the case's task), then decide and resume
    until the run answers."""
    start = case.place.start
    if run_id is None:
        run_id = await start_run(case)
    for _ in range(MAX_SEGMENTS):
        terminal = await follow(case, run_id)
        case.terminals.append(terminal)
        if terminal.status in ANSWERED:
            return
        if terminal.status == "paused":
            run_id = await decide(case, run_id)
        elif terminal.status in RESUMED:
            answer = await start.post(f"/sessions/{case.session}/resume")
            assert answer.status_code == 202, answer.text
            run_id = str(answer.json()["run_id"])
        else:
            raise AssertionError(f"the run ended {terminal}")
    raise AssertionError(f"no answer after {MAX_SEGMENTS} segments: {case.terminals}")


async def outcome_of(case: ServedCase) -> Outcome:
    store = case.place.store
    names = [info.name for info in await store.sessions()
             if info.name == case.session or info.name.startswith(case.session + "--")]
    levels = {name: await store.load(name) for name in names}
    records = [r for r in await store.runs(limit=1000) if r.session in levels]
    model = case.place.model

    def still_open() -> list[object]:
        return [s for s in model.streams if not (s.completed or s.abandoned or s.fault)]

    # Polled: a reply's last flag is set after the server's last notice (a state
    # reached, bounded; never a time measured).
    deadline = time.monotonic() + 30
    while still_open():
        assert time.monotonic() < deadline, f"model streams still open: {still_open()}"
        await asyncio.sleep(0.02)
    counts = effects(case.place.effects)
    return Outcome(
        top=case.session, agent=case.place.agent, levels=levels, records=records,
        terminals=case.terminals, inputs=case.inputs, effects=dict(counts),
        idempotent=case.place.idempotent,
        pause_continues_run=case.place.pause_continues_run,
    )


async def run_served_case(
    cell: Cell, index: int | None, place: Place, session: str, strict_url: str
) -> int:
    case = ServedCase(cell, index, place, session, send_at=cell.rng().randrange(6))
    await drive(case)
    check(await outcome_of(case), strict_url)
    return case.seen


async def run_served_cell(
    cell: Cell, place: Place, strict_url: str, *, sweep: bool, prefix: str = ""
) -> int:
    """A run with no stop (counting its events), then the ending at one seeded index
    (every index when ``sweep``); the cases run. Sessions are named from the cell after
    ``prefix`` (tests sharing a server use their own)."""
    session = f"{prefix}{cell.id}".replace("_", "-")
    total = await run_served_case(cell, None, place, f"{session}-probe", strict_url)
    if cell.ending not in ("cancel", "interrupt", "stop", "leave"):
        return 1
    indices = range(total) if sweep else [cell.rng().randrange(total)]
    for k in indices:
        await run_served_case(cell, k, place, f"{session}-{k}", strict_url)
    return len(indices)
