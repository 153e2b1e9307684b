"""An agent session's durable side: the store session it writes, and its state.

:class:`SessionRecord` holds what an :class:`~aimu.aio.agent.Agent` keeps durable
beside its transcript in memory: the store and the session's writer; whether memory
changed in a way the store has not seen (the transcript, rewritten whole at the next
write; the state); and the state kept beside the transcript (approvals are the agent's;
the messages a pause carries, the summary of older turns, the session's spend). The
agent records through it; nothing here runs a model or a tool.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from aimu.aio.approvals import Approvals
from aimu.aio.context import Summary
from aimu.aio.errors import StoreError
from aimu.aio.limits import Spend
from aimu.aio.run_handle import RunHandle
from aimu.aio.scope import RunScope
from aimu.aio.store._protocol import RunRecord
from aimu.aio.tools import Tool
from aimu.aio.tools._definition import external_tools
from aimu.aio.transcript import Message, UserMessage, validate

if TYPE_CHECKING:
    from aimu.aio.store import SessionWriter, Store

__all__ = ["Carried", "SessionRecord", "carried_message", "input_id", "shared_copy"]

#: The key of a session's state under which its external tools are kept.
EXTERNAL = "external_tools"
#: The key of a session's state under which the state it shares with its frontend is kept.
SHARED = "shared_state"


def shared_copy(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` as plain JSON data; ValueError if it is not JSON."""
    try:
        copied = json.loads(json.dumps(dict(state), allow_nan=False))
    except (TypeError, ValueError) as error:
        raise ValueError(f"the shared state must be JSON data: {error}") from None
    assert isinstance(copied, dict)
    return copied

log = logging.getLogger("aimu.aio.agent")


class SessionRecord:
    """The store session of one agent session, and the state kept beside it."""

    __slots__ = (
        "carried", "external", "name", "remote", "run", "shared", "spend", "state_stale",
        "store", "summary", "transcript_stale", "writer",
    )

    def __init__(self, store: Store | None, name: str | None) -> None:
        self.store = store
        self.name = name
        self.writer: SessionWriter | None = None
        #: Memory changed in a way the store has not seen (restore(), reset, the system
        #: prompt): the stored transcript is rewritten from memory at the next store write.
        self.transcript_stale = False
        #: The state changed since the store last saw it (a decision given).
        self.state_stale = False
        #: Text sent while the last run paused: it joins the next run at its first boundary
        #: (with a store it is kept in the session's state until then, see Carried).
        self.carried = Carried()
        #: With SummarizeOlderTurns: the summary of the older turns.
        self.summary: Summary | None = None
        #: What this session spent in all, its runs in every process.
        self.spend = Spend()
        #: A turn the model's server goes on making without us (a background response):
        #: its handle and ``at``, the transcript's length when it started. Loaded, it is
        #: picked up again if the transcript has nothing after it (the run died in it).
        self.remote: dict[str, Any] | None = None
        #: The record of the run going on now, as stored when it started (status running).
        self.run: RunRecord | None = None
        #: The external tools this session offers besides its agent's (by name), kept in
        #: its state so that every process opening it offers them (a frontend's tools).
        self.external: dict[str, Tool] = {}
        #: The state the session shares with its frontend (AG-UI's ``state``): JSON data
        #: its tools read and change, kept under SHARED (None: it has none).
        self.shared: dict[str, Any] | None = None

    def forget(self) -> None:
        """The transcript was replaced (reset, restore): what the state said of it goes,
        and the store is rewritten from memory at the next write."""
        self.carried = Carried()
        self.summary = None
        self.remote = None
        self.transcript_stale = self.state_stale = True

    def load_state(self, state: Mapping[str, Any], messages: Sequence[Message]) -> None:
        """Take the stored state of the session whose transcript is ``messages``
        (ValueError naming the session when it is unreadable); approvals are the agent's."""
        where = f"session {self.name!r}"
        self.spend = Spend.load(state.get("spend"), where)
        self.carried = Carried.load(state.get("sent"), messages, where)
        self.summary = Summary.load(state.get("summary"), len(messages), where)
        remote = state.get("remote_turn")
        fresh = isinstance(remote, dict) and remote.get("at") == len(messages)
        self.remote = remote if fresh else None
        self.load_extras(state)

    def load_extras(self, state: Mapping[str, Any]) -> None:
        """Take the session's external tools and shared state from its stored state."""
        where = f"session {self.name!r}"
        self.external = {tool.name: tool for tool in external_tools(state.get(EXTERNAL), where)}
        shared = state.get(SHARED)
        if shared is not None and not isinstance(shared, dict):
            raise ValueError(f"{where}: unreadable shared state (a {type(shared).__name__})")
        self.shared = shared

    async def record(self, messages: list[Message], message: Message) -> None:
        """Append ``message`` to ``messages`` (memory), then to the store; a pending
        input (see :func:`input_id`) joins through the store, or is left out when its
        sender took it back."""
        messages.append(message)
        if self.writer is not None:
            if input_id(message) is not None:
                await self._join(messages, message)
            elif self.transcript_stale:
                await self.sync(messages)
            else:
                await self.writer.append(message)

    async def _join(self, messages: list[Message], message: Message) -> None:
        """Join the pending input ``message``, last in memory, to the stored transcript
        (memory rewritten first if stale); out of memory again if no longer pending."""
        assert self.writer is not None
        if self.transcript_stale:
            await self.sync(messages[:-1])
        if not await self.writer.join_input(cast(UserMessage, message)):
            messages.remove(message)

    async def store_added(self, messages: list[Message], added: Sequence[Message]) -> None:
        """Store ``added``, already last in ``messages`` (or all of memory, if stale)."""
        writer = self.writer
        if writer is not None and self.transcript_stale:
            await self.sync(messages)
        elif writer is not None:
            for message in added:
                if input_id(message) is not None:
                    await self._join(messages, message)
                else:
                    await writer.append(message)

    async def sync(self, messages: Sequence[Message]) -> None:
        """Rewrite the stored transcript from memory if memory changed behind its back."""
        if self.writer is not None and self.transcript_stale:
            await self.writer.replace(messages)
            self.transcript_stale = False

    async def close(self, messages: Sequence[Message], approvals: Approvals) -> None:
        """Store what memory has that the store lacks, then release the writer."""
        writer = self.writer
        if writer is None:
            return
        try:
            if self.state_stale:
                await self.save_state(approvals)
            await self.sync(messages)
        finally:
            self.writer = None
            await writer.aclose()

    async def start_run(
        self, agent: str, scope: RunScope, first: int, parent: str | None = None
    ) -> None:
        """Store the record of a run starting now (status ``running``), whose messages
        begin at ``first``, before it does anything: a process that dies in the run
        leaves it so. ``parent``: the record id of the run it runs inside (agent trees)."""
        if self.writer is None or self.name is None:
            return
        record = RunRecord(
            id=_record_id(scope), session=self.name, agent=agent, started=time.time(),
            status="running", parent=parent, messages_from=first,
        )
        await self.writer.record_run(record)
        self.run = record

    async def end_run(self, messages: Sequence[Message], first: int, **ended: Any) -> None:
        """Store how the run started by :meth:`start_run` ended (``ended``: the
        :class:`RunRecord` fields to set); the models are those that wrote
        ``messages[first:]``. A store that fails now is logged: the record then says
        ``running``, as if the process had died, and the transcript is stored already."""
        record, self.run = self.run, None
        if record is None or self.writer is None:
            return
        models: dict[str, None] = {}
        for message in messages[first:]:
            model = message.get("aimu_model") if message["role"] == "assistant" else None
            if isinstance(model, str):
                models[model] = None
        record = dataclasses.replace(record, ended=time.time(), models=tuple(models), **ended)
        try:
            await self.writer.record_run(record)
        except StoreError as error:
            log.warning("session %r: cannot record how run %s ended: %s", self.name,
                        record.id, error)

    async def keep_run_spend(self, spend: Spend) -> None:
        """Store what the run started by :meth:`start_run` has spent so far (its record
        stays ``running``)."""
        if self.run is not None and self.writer is not None:
            self.run = dataclasses.replace(self.run, spend=spend.dump())
            await self.writer.record_run(self.run)

    async def save_state(self, approvals: Approvals) -> None:
        """Store the session's state: the approvals, the messages a pause carries, the
        summary and what the session has spent."""
        if self.writer is not None:
            state: dict[str, Any] = {**approvals.state(), "spend": self.spend.dump()}
            if self.carried.messages:
                state["sent"] = self.carried.dump()
            if self.summary is not None:
                state["summary"] = self.summary.dump()
            if self.remote is not None:
                state["remote_turn"] = self.remote
            if self.external:
                state[EXTERNAL] = [
                    {"name": t.name, "description": t.description, "parameters": t.parameters}
                    for t in self.external.values()
                ]
            if self.shared is not None:
                state[SHARED] = self.shared
            await self.writer.save_state(state)
            self.state_stale = False


#: The handles whose run id names a run record already (a handle may run several).
_NAMED: weakref.WeakSet[RunHandle[Any]] = weakref.WeakSet()


def _record_id(scope: RunScope) -> str:
    """The id of the record of the run of ``scope``: its handle's run id when the run is
    the first this handle runs directly (so ``GET /runs/{id}`` and the record agree),
    else a new one."""
    handle = scope.parent
    if isinstance(handle, RunHandle) and handle.run_id is not None and handle not in _NAMED:
        _NAMED.add(handle)
        return handle.run_id
    return uuid.uuid4().hex


class Carried:
    """Messages sent to a run that then paused: they join the resumed run at its first
    step boundary, exactly once. ``after`` is the transcript's length when the run
    paused: the messages are already joined if they appear, in order, as user messages
    after it (a crash came between recording them and storing the state without them).
    Stored as ``{"texts": [...], "after": n}``, each a text or, with images, the message."""

    __slots__ = ("after", "messages")

    def __init__(self, messages: Sequence[UserMessage] = (), after: int = 0) -> None:
        self.messages = list(messages)
        self.after = after

    def add(self, messages: Sequence[UserMessage], after: int) -> None:
        if messages and not self.messages:
            self.after = after
        self.messages.extend(messages)

    def take(self) -> list[UserMessage]:
        messages, self.messages = self.messages, []
        return messages

    def dump(self) -> dict[str, Any]:
        """The messages without an input id (those with one are the store's pending
        inputs: a load finds them there)."""
        texts = [m["content"] if "images" not in m else dict(m) for m in self.messages
                 if input_id(m) is None]
        return {"texts": texts, "after": self.after}

    def add_inputs(self, pending: Sequence[UserMessage], after: int) -> None:
        """Add the stored pending inputs not carried already (by id)."""
        held = {input_id(m) for m in self.messages}
        self.add([m for m in pending if input_id(m) not in held], after)

    @classmethod
    def load(cls, data: object, messages: Sequence[Message], where: str) -> Carried:
        """The messages in :meth:`dump` data (None: none) not yet in ``messages``;
        ValueError naming ``where`` when the data is not that shape."""
        if data is None:
            return cls()
        texts = data.get("texts") if isinstance(data, Mapping) else None
        after = data.get("after") if isinstance(data, Mapping) else None
        carried = [carried_message(t) for t in texts] if isinstance(texts, list) else None
        if (carried is None or None in carried or isinstance(after, bool)
                or not isinstance(after, int)):
            raise ValueError(f"{where}: unreadable sent texts (expected {{'texts': [str or "
                             f"user message], 'after': int}}, got {data!r:.100})")
        sent = cast(list[UserMessage], carried)
        later = iter(m for m in messages[after:] if m["role"] == "user")
        if sent and all(message in later for message in sent):
            return cls()  # joined already
        return cls(sent, after)


def input_id(message: Message) -> str | None:
    """The id of the stored pending input ``message`` is (text sent to a run, kept
    before the send was answered), or None."""
    sent = message.get("aimu_sent") if message["role"] == "user" else None
    return sent if isinstance(sent, str) else None


def carried_message(item: object) -> UserMessage | None:
    """A stored sent text (a string, or a user message with images), or None if neither."""
    if isinstance(item, str):
        return {"role": "user", "content": item}
    if isinstance(item, Mapping) and item.get("role") == "user":
        try:
            validate([dict(item)])
        except ValueError:
            return None
        return cast(UserMessage, dict(item))
    return None
