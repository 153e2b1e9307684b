"""The one set of invariants every cell of the crossing matrix checks, whatever its place.

- every level's transcript is valid and a strict provider (the loopback server's OpenAI
  wire, which answers a dangling or orphan tool result with a 400) accepts it: 200;
- exactly one terminal event per run, matching its run record (status, reason, parent,
  agent, models);
- every accepted input (task, send, decision, client result) is in the transcript once;
- no tool that is not idempotent ran twice for one call; nothing is left running.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from aimu.aio.providers.openai import to_wire
from aimu.aio.store import RunRecord
from aimu.aio.transcript import Message, dangling_calls, validate
from aimu.testing.script import Turn

#: What the strict provider answers a transcript it accepts.
ACCEPTED_REPLY = "accepted"


def strict_script(body: Mapping[str, Any]) -> Turn:
    """The strict provider's model: the loopback server refuses an invalid transcript
    (400) before asking it; every valid one is answered so."""
    return Turn(text=ACCEPTED_REPLY)


@dataclass
class Terminal:
    """One run's terminal event as its reader saw it (None: the reader left before it)."""

    status: str | None
    """None: no reader could see one (the process running the run died)."""
    run_id: str | None
    reason: str | None = None
    count: int = 1
    """How many terminal events the run's reader saw (must be 1)."""


@dataclass
class Outcome:
    top: str
    """The top-level session."""
    agent: str
    """The name of the agent the top-level runs belong to."""
    levels: dict[str, list[Message]]
    records: list[RunRecord]
    terminals: list[Terminal]
    inputs: list[tuple[str, str]] = field(default_factory=list)
    """(kind, text) of each accepted input: a task or send (a user message), a client
    result or an approved call's result (a tool message)."""
    effects: Mapping[tuple[str, str], int] = field(default_factory=dict)
    idempotent: frozenset[str] = frozenset()
    leftovers: list[str] = field(default_factory=list)
    """What was still running after the case (tasks, streams, processes)."""
    known_children: bool = True
    """The place's store shows the runs of agents called as tools (their records)."""
    pause_continues_run: bool = False
    """A paused run goes on in the same run record after the decisions (Temporal: the
    same workflow), though the API follows the resume as a run of its own."""


def strict_accepts(url: str, levels: Mapping[str, Sequence[Message]]) -> None:
    """Send each level's stored transcript to the strict provider: each must get a 200."""
    with httpx.Client(base_url=url, timeout=30) as http:
        for name, messages in levels.items():
            if not messages:
                continue
            body = {"model": "strict", "stream": False,
                    "messages": [to_wire(m) for m in messages]}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, (name, response.text, messages)


def valid_levels(levels: Mapping[str, Sequence[Message]]) -> None:
    for name, messages in levels.items():
        validate(messages)
        assert dangling_calls(messages) == [], (name, messages)


def run_messages(outcome: Outcome, record: RunRecord) -> list[Message]:
    """The messages ``record``'s run added to its session."""
    messages = outcome.levels.get(record.session, [])
    same = sorted((r for r in outcome.records if r.session == record.session),
                  key=lambda r: (r.messages_from or 0, r.started))
    start = record.messages_from or 0
    later = [r.messages_from for r in same
             if r.messages_from is not None and r.messages_from > start]
    return list(messages[start:min(later, default=len(messages))])


def terminals_match_records(outcome: Outcome) -> None:
    tops = sorted((r for r in outcome.records if r.session == outcome.top),
                  key=lambda r: r.started)
    terminals = outcome.terminals
    if outcome.pause_continues_run:  # the pause's record is the resumed run's, at its end
        terminals = [t for t in terminals if t.status != "paused"]
        terminals = [Terminal(t.status, (t.run_id or "").split("-r")[0] or None, t.reason,
                              t.count) for t in terminals]
    assert len(tops) == len(terminals), (describe(tops), outcome.terminals)
    for terminal, record in zip(terminals, tops, strict=True):
        assert terminal.count == 1, f"{terminal.count} terminal events for one run"
        assert terminal.run_id in (None, record.id), (terminal, describe(tops))
        if terminal.status is None:
            continue
        assert record.status == terminal.status, (record, terminal)
        assert record.agent == outcome.agent, record
        assert record.parent is None, record
        if terminal.status == "cancelled" and terminal.reason is not None:
            assert record.reason == terminal.reason, (record, terminal)
    for record in outcome.records:
        wrote = {m.get("aimu_model") for m in run_messages(outcome, record)
                 if m["role"] == "assistant" and not m.get("aimu_partial")}
        wrote.discard(None)
        assert wrote <= set(record.models), (record, wrote)


def children_have_parents(outcome: Outcome) -> None:
    ids = {record.id for record in outcome.records}
    for record in outcome.records:
        if record.session != outcome.top:
            assert record.parent in ids, record


def inputs_once(outcome: Outcome) -> None:
    messages = outcome.levels[outcome.top]
    for kind, text in outcome.inputs:
        role = "user" if kind in ("task", "send") else "tool"
        count = sum(1 for m in messages if m["role"] == role and m["content"] == text)
        assert count == 1, (kind, text, count, messages)


def check(outcome: Outcome, strict_url: str) -> None:
    """Every invariant of the matrix, on one case's outcome."""
    assert outcome.leftovers == [], outcome.leftovers
    running = [r for r in outcome.records if r.status == "running"]
    assert running == [], running
    valid_levels(outcome.levels)
    strict_accepts(strict_url, outcome.levels)
    inputs_once(outcome)
    twice = [key for key, count in outcome.effects.items()
             if count > 1 and key[0] not in outcome.idempotent]
    assert twice == [], twice
    terminals_match_records(outcome)
    if outcome.known_children:
        children_have_parents(outcome)


def describe(records: Sequence[RunRecord]) -> list[dict[str, Any]]:
    """The records, short, for an assertion's message."""
    return [{k: r.to_json()[k] for k in ("id", "session", "status", "reason", "parent",
                                         "agent", "models")} for r in records]
