"""Runs that go on without a person: ``aimu serve --recover``.

A server that recovers looks, when it starts and then every few seconds, for the runs
whose record says they must go on: ``running`` while no process runs them (their process
died), or marked ``recover`` (a drain stopped them). It resumes each exactly once.

The lease is the session's write lock, which every store already has and which its
holder's death releases: an OS lock on a file for SQLite and JSONL (one host), a
PostgreSQL advisory lock held by the writer's connection (any host). A run's record
says ``running`` only while a writer holds that lock, so a ``running`` record whose
session can be opened is a dead process's. Under the lock the server checks that the
run is still its session's latest (else another server went on with it already),
writes the run's end, and starts the resume, which records a new run, all before the
lock is let go: two servers never resume one run. A run whose process died three times
in a row with no progress (no message added between, in its session or those of the
agents it called) is left ``failed`` with the reason. A run of an agent called as a tool
(its record has a ``parent``) goes on only inside its top-level run. Calls in doubt go
as after any crash: an idempotent tool's runs again, another's is answered "outcome
unknown", an approval tool's is asked again (the run pauses).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Sequence
from typing import Final

from aimu._hosting import open_agent
from aimu.aio.agent import Agent
from aimu.aio.agent.tree import DIED, nested_session_name
from aimu.aio.errors import SessionLockedError, StoreError
from aimu.aio.store import RunRecord, SessionWriter, Store
from aimu.aio.transcript import Message, dangling_calls
from aimu.serve.backends.base import RESUMED, continued_event, next_run, resumed_here
from aimu.serve.errors import ServeError
from aimu.serve.runs import Runs

__all__ = [
    "CRASHED", "MAX_CRASHES", "RECOVER_EVERY", "RESUMED", "Recovery", "continued_event",
    "next_run", "resumed_here",
]

_log = logging.getLogger("aimu.serve")

#: How a run whose process died is recorded (its reason starts so).
CRASHED: Final = DIED
#: A run whose process died this many times in a row is left failed, not resumed.
MAX_CRASHES: Final = 3
_AT: Final = re.compile(r"at message ([0-9]{1,12})\)")
#: The session of an agent called as a tool: ``<caller>--<turn>.<call id or digest>``.
_NESTED: Final = re.compile(r"(?P<caller>.+)--(?P<turn>[0-9]{1,9})\.[A-Za-z0-9._-]+")
#: Seconds between two looks for runs to recover.
RECOVER_EVERY: Final = 5.0
#: The runs one query of a look reads.
_PAGE: Final = 1000


class Recovery:
    """Finds the runs to go on with and resumes each through ``runs`` exactly once."""

    def __init__(self, runs: Runs, max_crashes: int = MAX_CRASHES) -> None:
        self._runs = runs
        self.max_crashes = max_crashes
        """Deaths in a row with no progress after which a run is left failed."""
        self.resumed: list[str] = []
        """The ids of the runs this process resumed (the new runs'), in order."""
        self._said: dict[str, str] = {}
        """Why each run found could not be recovered, as last logged: said once at
        WARNING, then at DEBUG while it stays so (a look every 0.1 s would flood)."""

    async def tidy(self) -> int:
        """Clear the marks that are spent: a marked run whose session went on with a
        newer run (its server died before it cleared the mark); how many were."""
        store = self._runs.store
        cleared = 0
        for record in await store.runs(recover=True, limit=_PAGE):
            if await _latest_id(store, record.session) == record.id:
                continue  # still to go on with
            try:
                writer = await store.open_session(record.session)
            except SessionLockedError:
                continue  # a later look
            try:
                fresh = await store.run(record.id)
                if fresh is not None and fresh.recover and (
                    await _latest_id(store, record.session) != fresh.id
                ):
                    await writer.record_run(dataclasses.replace(fresh, recover=False))
                    cleared += 1
            finally:
                await writer.aclose()
        return cleared

    async def look(self) -> list[str]:
        """Resume every run found to go on with now; the new runs' ids."""
        store = self._runs.store
        await self.tidy()
        found: dict[str, RunRecord] = {}
        # Every running record, a page at a time: the live runs (skipped at the lock)
        # may be more than a page, and a dead one among the oldest must still be found.
        # A marked run's mark is cleared as it goes on: the next look takes the rest.
        running = await _every_running(store)
        for record in [*running, *await store.runs(recover=True, limit=_PAGE)]:
            # A run of an agent called as a tool goes on inside its top-level run's resume.
            if record.id not in found and not await _inside_a_tree(store, record):
                found[record.id] = record
        started: list[str] = []
        self._said = {run: why for run, why in self._said.items() if run in found}
        for record in found.values():
            if self._runs.draining:
                break
            try:
                run_id = await self.claim(record)
            except (StoreError, ServeError) as error:
                self._cannot(record.id, str(error))
                continue
            self._said.pop(record.id, None)
            if run_id is not None:
                started.append(run_id)
        self.resumed += started
        return started

    async def claim(self, record: RunRecord) -> str | None:
        """Resume the session of ``record`` if the run must still go on and its session
        is free; the new run's id, or None (it runs, or went on elsewhere, or stays)."""
        try:
            agent = await open_agent(self._runs.agents, record.session)
        except SessionLockedError:
            return None  # it runs (alive), or another server claims it now
        try:
            writer = _writer_of(agent)
            latest = await self._runs.store.runs(
                session=record.session, limit=self.max_crashes
            )
            current = latest[0] if latest else None
            if current is None or current.id != record.id:
                if record.recover:  # went on already: the mark is spent
                    await writer.record_run(dataclasses.replace(record, recover=False))
                current = None
            elif current.status != "running" and not current.recover:
                current = None  # it ended meanwhile
            if current is not None:
                current = await self._ready(agent, writer, current, latest)
            if current is None:
                await agent.aclose()
                return None
        except BaseException:
            await agent.aclose()
            raise
        view = await self._runs.backend.start(record.session, None, agent)
        _log.warning("run %s of session %r goes on as run %s", record.id, record.session,
                     view.run_id)
        # The new run is recorded (start returns once it is): the mark is spent. Until
        # now it let another server resume the run, had this one died.
        try:
            await writer.record_run(dataclasses.replace(current, recover=False))
        except (StoreError, RuntimeError, ValueError) as error:  # the run ended already
            _log.debug("run %s: its mark is cleared at a later look (%s)", record.id, error)
        return view.run_id

    async def _ready(
        self, agent: Agent, writer: SessionWriter, current: RunRecord, latest: list[RunRecord]
    ) -> RunRecord | None:
        """Record how ``current`` ended; its record as written if its session may
        resume, None if not: after :data:`MAX_CRASHES` deaths in a row, or while calls
        wait for a decision."""
        now = time.time()
        if current.status == "running":
            # The models that wrote what the run added before it died, as a run's end
            # records them (its record said none: it never reached its end).
            current = dataclasses.replace(current, models=_models_of(agent, current))
            size = await _tree_size(self._runs.store, current.session, agent.messages)
            streak = _streak(latest, size)
            if streak >= self.max_crashes:
                await writer.record_run(dataclasses.replace(
                    current, status="failed", ended=now, recover=False,
                    reason=f"{CRASHED} {streak} times in a row: left failed, not resumed "
                    "again (once the cause is fixed: aimu runs resume RUN_ID)",
                ))
                await writer.set_status("failed")
                return None
            # Still marked: if this server dies before the resume starts, another resumes.
            current = dataclasses.replace(
                current, status="failed", ended=now, recover=True,
                reason=f"{CRASHED} ({streak} in a row, at message {size}); {RESUMED}",
            )
            await writer.record_run(current)
        waiting = agent.pending_approvals
        if waiting:
            names = ", ".join(f"{p.call_id} ({p.tool})" for p in waiting)
            await writer.record_run(dataclasses.replace(
                current, status="paused", ended=current.ended or now, recover=False,
                reason=f"{current.reason or 'stopped'}; calls wait for a decision: {names}",
            ))
            await writer.set_status("paused")
            return None
        return current

    def _cannot(self, run_id: str, why: str) -> None:
        """Log that run ``run_id`` cannot be recovered now: once for each reason."""
        level = logging.DEBUG if self._said.get(run_id) == why else logging.WARNING
        self._said[run_id] = why
        _log.log(level, "cannot recover run %s: %s", run_id, why)

    async def keep_looking(self, every: float = RECOVER_EVERY) -> None:
        """Look now and every ``every`` seconds until cancelled or the server drains."""
        while not self._runs.draining:
            try:
                await self.look()
            except (StoreError, ServeError) as error:
                _log.warning("cannot look for runs to recover: %s", error)
            await asyncio.sleep(every)

def _models_of(agent: Agent, record: RunRecord) -> tuple[str, ...]:
    """The models (``aimu_model``) of the assistant messages ``record``'s run added."""
    models: dict[str, None] = {}
    for message in agent.messages[record.messages_from or 0:]:
        model = message.get("aimu_model") if message["role"] == "assistant" else None
        if isinstance(model, str):
            models[model] = None
    return tuple(models)


def _streak(latest: list[RunRecord], messages: int) -> int:
    """How many times in a row the session's run died with no progress: the deaths
    recorded just before (newest first in ``latest``, after the one dying now) at the
    same transcript length ``messages``, plus this one. A run that added messages
    before it died starts the count again: a crash loop makes no progress."""
    streak = 1
    for earlier in latest[1:]:
        found = _AT.search(earlier.reason or "")
        if not (earlier.reason or "").startswith(CRASHED) or found is None:
            break
        if int(found.group(1)) != messages:
            break
        streak += 1
    return streak


async def _inside_a_tree(store: Store, record: RunRecord) -> bool:
    """True for a run of an agent called as a tool: its record names its parent run, or
    (a record of an aimu that did not) its session is named from a caller's session
    whose transcript holds that call (:func:`~aimu.aio.agent.tree.nested_session_name`)."""
    if record.parent is not None:
        return True
    named = _NESTED.fullmatch(record.session)
    if named is None:
        return False
    caller, turn = named["caller"], int(named["turn"])
    if await store.info(caller) is None:
        return False
    messages = await store.load(caller)
    message = messages[turn] if turn < len(messages) else None
    return message is not None and message["role"] == "assistant" and any(
        nested_session_name(caller, turn, call["id"]) == record.session
        for call in message.get("tool_calls", ())
    )


async def _tree_size(store: Store, session: str, messages: Sequence[Message]) -> int:
    """How many messages ``session`` holds with the sessions of the agents its open calls
    run (agent trees), in all: a tree that died while an agent it called went on made
    progress, though the top's transcript still waits on the call."""
    size = len(messages)
    for turn, call in dangling_calls(messages):
        name = nested_session_name(session, turn, call["id"])
        if await store.info(name) is not None:
            size += await _tree_size(store, name, await store.load(name))
    return size


async def _every_running(store: Store) -> list[RunRecord]:
    found: list[RunRecord] = []
    before = None
    while True:
        page = await store.runs(status="running", limit=_PAGE, before=before)
        found += page
        if len(page) < _PAGE:
            return found
        before = page[-1].id


async def _latest_id(store: Store, session: str) -> str | None:
    latest = await store.runs(session=session, limit=1)
    return latest[0].id if latest else None


def _writer_of(agent: Agent) -> SessionWriter:
    """The open writer of ``agent``'s session (its write lock: the lease)."""
    writer = agent.session_writer
    if writer is None:
        raise StoreError("the session is not open")
    return writer
