"""The crossing matrix: every capability, under every way a run ends, in every place it runs.

Capabilities, endings and places are small declarative values; a cell is
(capability, ending, place, seed). Where a cell cannot apply, :data:`NOT_APPLICABLE` says
why (one table, rendered in ``docs/crossings.md``); where it fails because of a defect
being fixed elsewhere, :data:`KNOWN_DEFECTS` marks it ``xfail(strict=True)``.

One cell: ``AIMU_CROSSING=tools:cancel:library:3 pytest tests/crossings`` (or ``-k`` with
the cell's id, ``tools-cancel-library-3``). The seed varies the scenario (chunking, store,
the event index a stop lands at); in the library place an indexed ending with seed 0
sweeps every event index of the run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pytest

__all__ = [
    "CAPABILITIES", "ENDINGS", "KNOWN_DEFECTS", "NOT_APPLICABLE", "PLACES", "Capability",
    "Cell", "Ending", "Place", "cells", "known_defect", "params", "render_table", "why_not",
]


@dataclass(frozen=True)
class Capability:
    name: str
    what: str
    levels: int = 1
    """How many agents' transcripts a run writes (an agent tree: one per level)."""


@dataclass(frozen=True)
class Ending:
    name: str
    what: str
    indexed: bool = False
    """The stop lands at an event index (the seed picks it; seed 0 sweeps them all)."""


@dataclass(frozen=True)
class Place:
    name: str
    what: str
    expensive: bool = False
    """Cells here start processes or servers: the slow matrix samples them."""


CAPABILITIES: tuple[Capability, ...] = (
    Capability("plain", "a plain answer, streamed in chunks"),
    Capability("tools", "a round of two tools (one not idempotent), then the answer"),
    Capability("approvals", "a tool that waits for a person's approval"),
    Capability("external", "an external (client) tool whose result comes from outside"),
    Capability("send", "a message sent into the running run"),
    Capability("tree", "an agent as a tool, two levels deep (root -> mid -> leaf)", levels=3),
    Capability("handoff", "a handoff to another agent, which answers"),
    Capability("input_guardrail", "an input guardrail that passes beside the first turn"),
    Capability("output_guardrail", "an output guardrail that passes the answer"),
    Capability("tool_guardrail", "a tool guardrail before and after a call"),
    Capability("fallback", "a fallback model: the first fails, the second answers"),
    Capability("mcp", "a tool of an MCP server (stdio child process)"),
    Capability("continue_partial", "an answer cut by a stop, continued on resume"),
    Capability("typed_output", "typed output (a pydantic model)"),
)

ENDINGS: tuple[Ending, ...] = (
    Ending("completes", "the run answers"),
    Ending("cancel", "cancel at an event index", indexed=True),
    Ending("interrupt", "interrupt at an event index", indexed=True),
    Ending("stop", "stop(grace=0) at an event index", indexed=True),
    Ending("deadline", "the deadline passes at an event index", indexed=True),
    Ending("requests", "a budget of one model request"),
    Ending("tokens", "a budget of two output tokens"),
    Ending("leave", "the consumer leaves the stream at an event index", indexed=True),
    Ending("kill9", "kill -9 at an event index, then recover", indexed=True),
    Ending("drain", "the server drains (stops for recovery) mid-run, then recovers"),
)

PLACES: tuple[Place, ...] = (
    Place("library", "aio.Agent under a RunHandle (or its stream), SQLite store"),
    Place("serve", "aimu serve's runs API over HTTP"),
    Place("redis", "two aimu serve processes on Redis; the stop goes to the other one",
          expensive=True),
    Place("temporal", "aimu serve --temporal with a worker, on the Temporal dev server",
          expensive=True),
)

_BY_NAME = {
    "capability": {c.name: c for c in CAPABILITIES},
    "ending": {e.name: e for e in ENDINGS},
    "place": {p.name: p for p in PLACES},
}


@dataclass(frozen=True)
class Cell:
    capability: str
    ending: str
    place: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.capability}-{self.ending}-{self.place}-{self.seed}"

    def rng(self) -> random.Random:
        return random.Random(f"{self.capability}:{self.ending}:{self.place}:{self.seed}")

    @classmethod
    def parse(cls, text: str) -> Cell:
        """``cap:ending:place:seed`` (the ``AIMU_CROSSING`` form)."""
        capability, ending, place, seed = text.split(":")
        for kind, name in (("capability", capability), ("ending", ending), ("place", place)):
            if name not in _BY_NAME[kind]:
                raise ValueError(f"unknown {kind} {name!r}: one of {sorted(_BY_NAME[kind])}")
        return cls(capability, ending, place, int(seed))


# -- where a cell cannot apply --------------------------------------------------------------

#: (capability or "*", ending or "*", place or "*") -> why the cell cannot apply. The first
#: row that matches says it; rendered in docs/crossings.md.
NOT_APPLICABLE: tuple[tuple[str, str, str, str], ...] = (
    ("*", "kill9", "library",
     "not built here: a library process killed at each point is tests/aio/agent/"
     "test_crash_resume.py's; the matrix's kill9 runs in the serve place (--recover)"),
    ("*", "drain", "library",
     "draining is how a server process stops for recovery; a library run has stop(grace)"),
    ("*", "leave", "temporal",
     "leaving the stream is the serve place's dropped follower; on Temporal the run "
     "belongs to the workflow, not to the follower (the serve cells cover the API)"),
    ("send", "*", "temporal",
     "a send to a Temporal run is a workflow signal, covered by tests/temporal; the "
     "crossing runs use the serve API's local sessions"),
    ("external", "*", "serve",
     "the runs API has no way to declare a client tool (AG-UI and the AI SDK stream do: "
     "tests/serve/test_ag_ui.py, test_ai_sdk.py)"),
    ("external", "*", "redis", "as for serve: no client tools in the runs API"),
    ("external", "*", "temporal", "as for serve: no client tools in the runs API"),
    ("continue_partial", "*", "serve",
     "the runs API resumes with the server's own resume (re-ask); continue_partial is a "
     "library argument"),
    ("continue_partial", "*", "redis", "as for serve: a library argument"),
    ("continue_partial", "*", "temporal", "as for serve: a library argument"),
    ("*", "kill9", "redis",
     "not run: each case starts two server processes (~20 s each on a busy 2-core "
     "machine); kill -9 and --recover run in the serve place, whose recovery is the "
     "same process code"),
    ("*", "drain", "redis", "not run: as kill9 (two processes a case)"),
    ("*", "kill9", "temporal",
     "the worker is what dies on Temporal: tests/temporal/test_processes.py kills it"),
    ("*", "drain", "temporal", "a worker's drain is tests/temporal/test_drain.py's"),
    ("*", "requests", "serve",
     "a served run's budget is the server's (--max-requests), one for all its runs: the "
     "cells share one server without one (tests/serve/test_drain_recover.py holds it "
     "across kills)"),
    ("*", "requests", "redis", "as for serve: the budget is the server's"),
    ("*", "requests", "temporal", "as for serve: the budget is the server's"),
    ("*", "tokens", "serve", "aimu serve has --max-requests, not a per-run token budget"),
    ("*", "tokens", "redis", "as for serve: no per-run token budget option"),
    ("*", "tokens", "temporal", "as for serve: no per-run token budget option"),
    ("*", "deadline", "serve", "aimu serve sets no per-run deadline"),
    ("*", "deadline", "redis", "as for serve: no per-run deadline"),
    ("*", "deadline", "temporal", "as for serve: no per-run deadline"),
    ("typed_output", "*", "serve", "aimu serve's agent answers text (no --output-type)"),
    ("typed_output", "*", "redis", "as for serve: text answers only"),
    ("typed_output", "*", "temporal", "as for serve: text answers only"),
    ("tree", "*", "serve",
     "aimu serve's command line builds one agent; trees served are tests/aio/trees/"
     "test_tree_serve.py's (built in Python)"),
    ("tree", "*", "redis", "as for serve: the command line builds one agent"),
    ("tree", "*", "temporal",
     "as for serve; trees on Temporal are tests/temporal/test_tree_temporal.py's"),
    ("handoff", "*", "serve", "aimu serve's command line has no handoffs"),
    ("handoff", "*", "redis", "as for serve: no handoffs on the command line"),
    ("handoff", "*", "temporal", "as for serve: no handoffs on the command line"),
    ("input_guardrail", "*", "serve", "aimu serve's command line has no guardrails"),
    ("input_guardrail", "*", "redis", "as for serve: no guardrails on the command line"),
    ("input_guardrail", "*", "temporal", "as for serve: no guardrails on the command line"),
    ("output_guardrail", "*", "serve", "aimu serve's command line has no guardrails"),
    ("output_guardrail", "*", "redis", "as for serve: no guardrails on the command line"),
    ("output_guardrail", "*", "temporal", "as for serve: no guardrails on the command line"),
    ("tool_guardrail", "*", "serve", "aimu serve's command line has no guardrails"),
    ("tool_guardrail", "*", "redis", "as for serve: no guardrails on the command line"),
    ("tool_guardrail", "*", "temporal", "as for serve: no guardrails on the command line"),
    ("fallback", "*", "serve", "aimu serve takes one --model"),
    ("fallback", "*", "redis", "as for serve: one --model"),
    ("fallback", "*", "temporal", "as for serve: one --model"),
)


def _matches(pattern: str, name: str) -> bool:
    return pattern in ("*", name)


def why_not(capability: str, ending: str, place: str) -> str | None:
    """Why the cell cannot apply, or None when it does."""
    for cap, end, where, why in NOT_APPLICABLE:
        if _matches(cap, capability) and _matches(end, ending) and _matches(where, place):
            return why
    return None


# -- cells that fail today because of a defect being fixed elsewhere ----------------------

#: (capability, ending, place, seed) patterns -> "issue 42 item N: <what>" (xfail, strict:
#: once the fix is merged the cell XPASSes and fails, and the row goes). The seed is "*" when
#: every seed fails (the run without a stop that starts each cell fails already).
KNOWN_DEFECTS: tuple[tuple[str, str, str, str, str], ...] = ()


def _defect_matches(row: tuple[str, str, str, str, str], cell: Cell) -> bool:
    cap, end, where, seed, _ = row
    return (_matches(cap, cell.capability) and _matches(end, cell.ending)
            and _matches(where, cell.place) and _matches(seed, str(cell.seed)))


#: Cells that found a defect fixed on this branch: they always run in the sample of their
#: place, as its regression test ("cap:ending:place:seed" -> the defect).
REGRESSIONS: dict[str, str] = {
    "approvals:stop:temporal:0":
        "on Temporal a decision sent as soon as the run's events ended handle_finished "
        "'paused' was refused 409 'running, not paused': the workflow's state lags the "
        "worker's events by a workflow task",
    "external:leave:library:0":
        "a client result given to a paused run (answer()) was lost, the call settled "
        "'[cancelled before it finished]', when the consumer left the resumed run's "
        "stream at its first event (before the resume used the result)",
    "tools:kill9:serve:0":
        "the record of a run whose process died, marked failed by --recover, had no "
        "models although its messages were written by one",
    "tree:completes:library:0":
        "issue 42 item 1: an agent-tree child's run record had no parent",
    "handoff:completes:library:0":
        "issue 42 item 2: a handoff emptied the run record's models",
    "approvals:drain:serve:0":
        "a run paused before its server went away (a drain; a restart the same) could not "
        "be decided on the next server without Redis: GET /sessions/{s} said 'paused' "
        "with paused_run_id null and pending [], and the run was unknown to it",
    "send:kill9:serve:0":
        "issue 42 item 3: a send answered 202 waited in memory until the step boundary, so "
        "a kill -9 before it lost the send",
}


def known_defect(cell: Cell) -> str | None:
    return next((row[4] for row in KNOWN_DEFECTS if _defect_matches(row, cell)), None)


# -- generating cells ------------------------------------------------------------------------


def cells(places: Iterable[str], seeds: Iterable[int]) -> Iterator[Cell]:
    """Every applicable cell of ``places`` for each seed."""
    seed_list = list(seeds)
    for place in places:
        for capability in CAPABILITIES:
            for ending in ENDINGS:
                if why_not(capability.name, ending.name, place) is not None:
                    continue
                for seed in seed_list:
                    yield Cell(capability.name, ending.name, place, seed)


def sample(all_cells: Iterable[Cell], count: int, seed: int) -> list[Cell]:
    """``count`` cells of ``all_cells`` chosen by ``seed`` (stable order); all of them
    with ``AIMU_CROSSING_ALL=1``."""
    pool = list(all_cells)
    if os.environ.get("AIMU_CROSSING_ALL") == "1":
        return pool
    chosen = set(random.Random(seed).sample(pool, min(count, len(pool))))
    chosen |= {c for c in pool if f"{c.capability}:{c.ending}:{c.place}:{c.seed}"
               in REGRESSIONS}
    for row in KNOWN_DEFECTS:  # one cell of each known defect: its fix shows as an XPASS
        hit = next((c for c in pool if _defect_matches(row, c)), None)
        if hit is not None and not any(_defect_matches(row, c) for c in chosen):
            chosen.add(hit)
    return sorted(chosen, key=lambda c: c.id)


def stratified(all_cells: Iterable[Cell], per_capability: int, seed: int) -> list[Cell]:
    """``per_capability`` cells of each capability, their endings taken in turn (from a
    place chosen by ``seed``), so that every capability and every ending is in."""
    pool = list(all_cells)
    endings = [e.name for e in ENDINGS if any(c.ending == e.name for c in pool)]
    turn = random.Random(seed).randrange(len(endings)) if endings else 0
    chosen: list[Cell] = []
    for capability in CAPABILITIES:
        mine = {c.ending: c for c in pool if c.capability == capability.name}
        taken = 0
        for step in range(len(endings)):
            if taken == per_capability:
                break
            cell = mine.get(endings[(turn + step) % len(endings)])
            if cell is not None:
                chosen.append(cell)
                taken += 1
        turn += per_capability
    return chosen


def chosen_cell() -> Cell | None:
    """The one cell ``AIMU_CROSSING=cap:ending:place:seed`` asks for, if set."""
    text = os.environ.get("AIMU_CROSSING")
    if not text:
        return None
    cell = Cell.parse(text)
    why = why_not(cell.capability, cell.ending, cell.place)
    if why is not None:
        raise ValueError(f"AIMU_CROSSING={text}: the cell does not apply: {why}")
    return cell


def params(
    selected: Iterable[Cell], place: str, *, full: bool = True,
    endings: Iterable[str] | None = None,
) -> list[object]:
    """pytest params of ``selected`` (or of the one ``AIMU_CROSSING`` cell, given to the
    ``full`` matrix of its place that runs its ending: one of ``endings``, None: any),
    each with its xfail mark when a known defect applies."""
    chosen = chosen_cell()
    if chosen is not None:
        runs_it = endings is None or chosen.ending in set(endings)
        selected = [chosen] if chosen.place == place and full and runs_it else []
    out: list[object] = []
    for cell in selected:
        defect = known_defect(cell)
        marks = [pytest.mark.xfail(strict=True, reason=defect)] if defect else []
        out.append(pytest.param(cell, id=cell.id, marks=marks))
    return out


def render_table() -> str:
    """The not-applicable table as Markdown (docs/crossings.md holds this text)."""
    rows = ["| capability | ending | place | why not |", "| --- | --- | --- | --- |"]
    for cap, end, where, why in NOT_APPLICABLE:
        rows.append(f"| {cap} | {end} | {where} | {why} |")
    return "\n".join(rows)
