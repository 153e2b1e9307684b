"""The agent: a tool loop whose transcript survives any stop.

One async generator (:meth:`Agent._loop`) does the work; ``run()`` drains it and
``run(stream=True)`` hands it out, so both share one code path. The loop records
every message the moment it exists and settles in a ``finally``: whatever ends a run
(answer, error, cancel, interrupt, a consumer that stops iterating), the transcript in
``agent.model_client.messages`` is valid to send to a model again.

A step is one model turn and the tool round it asked for. ``interrupt()`` stops the
run at the next step boundary; ``resume()`` continues where it stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from types import CoroutineType, EllipsisType
from typing import TYPE_CHECKING, Any, Literal, cast, overload

from aimu.aio.client import ModelClient, TextDelta, ThinkingDelta, ToolCallDelta, TurnAssembler
from aimu.aio.errors import ModelProtocolError, StoreError
from aimu.aio.events import (
    Event,
    RunFinished,
    RunStarted,
    RunStatus,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolResult,
)
from aimu.aio.scope import current_scope
from aimu.aio.store import validate_session_name
from aimu.aio.tools import Tool, ToolContext, ToolOutcome, as_tool, invoke
from aimu.aio.transcript import (
    Message,
    ToolCall,
    ToolMessage,
    ToolSpec,
    Usage,
    add_usage,
    copy_messages,
    settle,
    validate,
    zero_usage,
)

if TYPE_CHECKING:
    from aimu.aio.store import SessionWriter, Store

__all__ = ["FINAL_TURN_PROMPT", "INTERRUPTED", "Agent"]

#: What a run returns when ``interrupt()`` stopped it at a step boundary.
INTERRUPTED = "Run interrupted."

#: The user message that opens the last turn once ``max_rounds`` model turns were made.
FINAL_TURN_PROMPT = (
    "You have used every tool round allowed for this task. Answer now with your best "
    "final answer, without calling any tool."
)

_NO_ROUNDS_LEFT = "[not run: no tool rounds were left]"
_BUSY = "a run is already in progress on this session; use agent.start() for another"


@dataclass(frozen=True, slots=True)
class _Config:
    """What every session of one agent shares; never changes after construction."""

    name: str
    system: str | None
    max_rounds: int
    concurrent_tools: bool
    tools: tuple[Tool, ...]
    tools_by_name: dict[str, Tool]
    specs: tuple[ToolSpec, ...]


class _RunState:
    """The pieces of a run in flight that the settling ``finally`` must see."""

    __slots__ = (
        "assembler", "closed", "closing", "contexts", "interrupt_asked", "store_error", "usage"
    )

    def __init__(self, interrupt_asked: Callable[[], bool]) -> None:
        #: True once this agent or a scope around the run asked for an interrupt.
        self.interrupt_asked = interrupt_asked
        self.assembler: TurnAssembler | None = None
        self.contexts: list[ToolContext] = []
        self.usage: Usage = zero_usage()
        self.closed = False
        #: The consumer closed the stream (GeneratorExit came in at a yield).
        self.closing = False
        #: A store write that failed while the run settled; the run then ends ``failed``.
        self.store_error: StoreError | None = None


class Agent:
    """A model client, tools and a system prompt, running a tool loop on one transcript.

    ``agent.start()`` makes another session of the same agent with its own transcript.
    With ``store`` and ``session`` every message is written durably as it is recorded,
    and a new process building the same agent continues from the stored transcript: the
    session is opened (its write lock taken, its transcript loaded) by :meth:`open`,
    ``async with agent``, or the first run.
    """

    def __init__(
        self,
        client: ModelClient,
        tools: Sequence[Callable[..., Any] | Tool | EllipsisType] = (),
        *,
        system: str | None = None,
        max_rounds: int = 10,
        name: str | None = None,
        store: Store | None = None,
        session: str | None = None,
        concurrent_tools: bool = False,
    ) -> None:
        if not isinstance(client, ModelClient):
            raise TypeError(
                "Agent needs a model client such as aio.client('test'), "
                f"got {type(client).__name__}"
            )
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__}")
        if (store is None) != (session is None):
            raise ValueError("store and session go together: give both, or neither")
        # `tools=[...]`, the docs' placeholder, means no tools.
        built = tuple(as_tool(t) for t in tools if t is not Ellipsis)
        by_name: dict[str, Tool] = {}
        for t in built:
            if t.name in by_name:
                raise ValueError(f"two tools are named {t.name!r}; tool names must be unique")
            by_name[t.name] = t
        config = _Config(
            name=name or "agent",
            system=system,
            max_rounds=max_rounds,
            concurrent_tools=concurrent_tools,
            tools=built,
            tools_by_name=by_name,
            specs=tuple(t.spec for t in built),
        )
        self._setup(config, client, store, session, owns_client=True)

    def _setup(
        self,
        config: _Config,
        client: ModelClient,
        store: Store | None,
        session: str | None,
        *,
        owns_client: bool,
    ) -> None:
        self._config = config
        self.model_client = client
        self._owns_client = owns_client
        self._store = store
        self._session = session
        self._writer: SessionWriter | None = None
        #: Memory changed in a way the store has not seen (restore(), reset, the system
        #: prompt): the stored transcript is rewritten from memory at the next store write.
        self._store_stale = False
        self._run_active = False
        self._interrupt_requested = False
        #: How the last run on this session ended (None before the first).
        self.last_status: RunStatus | None = None
        if session is not None:
            validate_session_name(session)
        self._place_system()

    # -- configuration -------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def system(self) -> str | None:
        return self._config.system

    @property
    def max_rounds(self) -> int:
        return self._config.max_rounds

    @property
    def tools(self) -> tuple[Tool, ...]:
        return self._config.tools

    @property
    def session(self) -> str | None:
        """The store session this agent writes to, if any."""
        return self._session

    @property
    def running(self) -> bool:
        """True while a run is in progress on this session."""
        return self._run_active

    def start(self, *, session: str | None = None) -> Agent:
        """A new session of this agent: same model settings, tools and limits.

        It has its own transcript and interrupt state, so many conversations can run
        concurrently. With ``session=`` it persists to this agent's store under that name.
        """
        if session is not None and self._store is None:
            raise ValueError("start(session=...) needs an agent built with a store")
        twin = Agent.__new__(Agent)
        twin._setup(
            self._config,
            self.model_client.fork(),
            self._store if session is not None else None,
            session,
            owns_client=False,
        )
        return twin

    def __repr__(self) -> str:
        state = "running" if self._run_active else "idle"
        return (
            f"<Agent {self.name!r} {state} messages={len(self.model_client.messages)} "
            f"tools={[t.name for t in self.tools]}>"
        )

    async def open(self) -> None:
        """Open the store session now: take its write lock and load its transcript.

        ``SessionLockedError`` if another writer holds it. The first run does this
        itself; without a store this does nothing. Idempotent.
        """
        if self._store is None or self._session is None or self._writer is not None:
            return
        writer = self._writer = await self._store.open_session(self._session)
        try:
            await self._load_stored(writer)
        except BaseException:
            self._writer = None
            await writer.aclose()
            raise

    async def aclose(self) -> None:
        """Release the store session and, for the agent that was given it, the client.

        A transcript given to :meth:`restore` since the last run is stored first.
        """
        writer, self._writer = self._writer, None
        try:
            if writer is not None:
                try:
                    await self._sync_store(writer)
                finally:
                    await writer.aclose()
        finally:
            if self._owns_client:
                await self.model_client.aclose()

    async def __aenter__(self) -> Agent:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- transcript ----------------------------------------------------------------

    async def _record(self, message: Message) -> None:
        self.model_client.messages.append(message)
        if self._writer is not None:
            if self._store_stale:
                await self._sync_store(self._writer)
            else:
                await self._writer.append(message)

    async def _sync_store(self, writer: SessionWriter) -> None:
        """Rewrite the stored transcript from memory if memory changed behind its back."""
        if self._store_stale:
            await writer.replace(self.model_client.messages)
            self._store_stale = False

    def _place_system(self) -> None:
        """Keep the system prompt present exactly once, first."""
        system = self._config.system
        messages = self.model_client.messages
        if system is None:
            return
        if messages and messages[0]["role"] == "system":
            if messages[0]["content"] == system:
                return
            messages[0] = {"role": "system", "content": system}
        else:
            messages.insert(0, {"role": "system", "content": system})
        if self._writer is not None:
            self._store_stale = True

    async def _load_stored(self, writer: SessionWriter) -> None:
        """Take the stored transcript into memory (a restore() before this one wins)."""
        messages = self.model_client.messages
        stored = [] if self._store_stale else await writer.load()
        if stored:
            validate(stored)
            settled = copy_messages(stored)
            self._store_stale = bool(settle(settled))
            messages[:] = settled
        elif messages:
            validate(messages)
            self._store_stale = True
        self._place_system()
        await self._sync_store(writer)

    def restore(self, messages: Sequence[Message]) -> None:
        """Load ``messages`` as this session's transcript, validating them first.

        An invalid transcript raises ``ValueError`` naming the bad message and changes
        nothing. Messages are copied in; dangling tool calls get "cancelled" results;
        this agent's system prompt is kept.
        """
        if self._run_active:
            raise RuntimeError("cannot restore() while a run is in progress on this session")
        validate(messages)
        restored = copy_messages(messages)
        settle(restored)
        system = self._config.system
        if system is not None and restored and restored[0]["role"] == "system":
            restored[0] = {"role": "system", "content": system}
        elif system is not None:
            restored.insert(0, {"role": "system", "content": system})
        self.model_client.messages[:] = restored
        self._store_stale = True

    # -- stopping ------------------------------------------------------------------

    def interrupt(self) -> bool:
        """Ask the run in progress to stop at its next step boundary.

        The model turn and tool round in flight finish and are recorded; the run then
        returns ``"Run interrupted."``. With no run in progress this does nothing and
        returns False. Safe to call from a signal handler or another thread.
        """
        if not self._run_active:
            return False
        self._interrupt_requested = True
        return True

    @property
    def interrupt_requested(self) -> bool:
        return self._interrupt_requested

    # -- running -------------------------------------------------------------------

    @overload
    def run(
        self, task: str, *, reset: bool = False, stream: Literal[False] = False
    ) -> Coroutine[Any, Any, str]: ...

    @overload
    def run(
        self, task: str, *, reset: bool = False, stream: Literal[True]
    ) -> AsyncGenerator[Event, None]: ...

    def run(
        self, task: str, *, reset: bool = False, stream: bool = False
    ) -> Coroutine[Any, Any, str] | AsyncGenerator[Event, None]:
        """Run ``task`` until the model answers; return the answer.

        ``stream=True`` returns the run as an async iterator of events instead, ending
        with one :class:`RunFinished`. ``reset=True`` starts from an empty transcript
        (keeping the system prompt).
        """
        if not isinstance(task, str):
            raise TypeError(f"run() takes the task as a string, got {type(task).__name__}")
        self._check_idle()
        events = self._loop(task, reset=reset)
        return events if stream else self._drain(events)

    @overload
    def resume(self, *, stream: Literal[False] = False) -> Coroutine[Any, Any, str]: ...

    @overload
    def resume(self, *, stream: Literal[True]) -> AsyncGenerator[Event, None]: ...

    def resume(
        self, *, stream: bool = False
    ) -> Coroutine[Any, Any, str] | AsyncGenerator[Event, None]:
        """Continue exactly where the last run stopped, adding no user message.

        The round budget goes on from where it was. On a transcript whose last turn is
        a finished answer this returns that answer without calling the model.
        """
        self._check_idle()
        if self._store is None or self._writer is not None:
            self._check_resumable()  # else once the first run has loaded the session
        events = self._loop(None, reset=False)
        return events if stream else self._drain(events)

    def _drain(self, events: AsyncGenerator[Event, None]) -> CoroutineType[Any, Any, str]:
        coroutine = cast("CoroutineType[Any, Any, str]", _drain(events))
        # A RunHandle names itself after its coroutine: make that the agent's name.
        coroutine.__qualname__ = coroutine.__name__ = self._config.name
        return coroutine

    def _check_resumable(self) -> None:
        if not any(m["role"] == "user" for m in self.model_client.messages):
            raise ValueError("nothing to resume: the transcript has no task yet; use run(task)")

    def _check_idle(self) -> None:
        if self._run_active:
            raise RuntimeError(_BUSY)

    def _rounds_used(self) -> int:
        """Model turns already made for the current task, derived from the transcript."""
        rounds = 0
        for message in reversed(self.model_client.messages):
            role = message["role"]
            if role == "user":
                if message["content"] == FINAL_TURN_PROMPT:
                    return self._config.max_rounds
                break
            if role == "assistant" and not message.get("aimu_partial"):
                rounds += 1
        return rounds

    def _finished_answer(self) -> str | None:
        messages = self.model_client.messages
        if not messages:
            return None
        last = messages[-1]
        if last["role"] != "assistant":
            return None
        last_assistant = last
        if last_assistant.get("tool_calls") or last_assistant.get("aimu_partial"):
            return None
        return last_assistant["content"]

    async def _loop(self, task: str | None, *, reset: bool) -> AsyncGenerator[Event, None]:
        self._check_idle()
        self._run_active = True
        self._interrupt_requested = False
        config = self._config
        name = config.name
        client = self.model_client
        messages = client.messages
        scope = current_scope.get()
        emit = scope.emit if scope is not None else None
        state = _RunState(
            (lambda: self._interrupt_requested or scope.interrupt_requested)
            if scope is not None
            else (lambda: self._interrupt_requested)
        )
        status: RunStatus = "failed"
        reply = ""
        failure: BaseException | None = None
        try:
            await self.open()
            if reset:
                messages.clear()
                self._store_stale = True
            self._place_system()
            if self._writer is not None:
                await self._sync_store(self._writer)
            if task is None:
                self._check_resumable()
            else:
                await self._record({"role": "user", "content": task})
            if self._writer is not None:
                await self._writer.set_status("in_progress")
            event: Event = RunStarted(name, task)
            if emit is not None:
                emit(event)
            yield event
            rounds = self._rounds_used()
            answer = self._finished_answer() if task is None else None
            if answer is not None:
                status, reply = "completed", answer
            while answer is None:
                if state.interrupt_asked():
                    status, reply = "interrupted", INTERRUPTED
                    if scope is not None:
                        scope.note_interrupted()
                    break
                final_turn = rounds >= config.max_rounds
                if final_turn and not (
                    messages[-1]["role"] == "user" and messages[-1]["content"] == FINAL_TURN_PROMPT
                ):
                    await self._record({"role": "user", "content": FINAL_TURN_PROMPT})
                assembler = state.assembler = TurnAssembler()
                argument_errors: dict[str, str] = {}
                turn = client.stream_turn(messages, None if final_turn else config.specs)
                try:
                    async for chunk in turn:
                        assembler.add(chunk)
                        if isinstance(chunk, TextDelta):
                            event = TextChunk(name, chunk.text)
                        elif isinstance(chunk, ThinkingDelta):
                            event = ThinkingChunk(name, chunk.text)
                        elif isinstance(chunk, ToolCallDelta):
                            if chunk.error is not None:
                                argument_errors[chunk.call["id"]] = chunk.error
                            continue
                        else:
                            continue
                        if emit is not None:
                            emit(event)
                        yield event
                except GeneratorExit:
                    state.closing = True  # the await below may raise a pending cancel instead
                    raise
                finally:
                    await turn.aclose()
                if not assembler.done:
                    raise ModelProtocolError(
                        f"the model at {client.host} ended its turn without finishing it",
                        host=client.host,
                    )
                state.assembler = None
                message = assembler.message()
                await self._record(message)
                add_usage(state.usage, assembler.usage)
                rounds += 1
                calls = message.get("tool_calls")
                if not calls:
                    status = "max_rounds" if final_turn else "completed"
                    reply = message["content"]
                    break
                if final_turn:
                    for call in calls:
                        await self._record(_result(call, ToolOutcome(_NO_ROUNDS_LEFT, True)))
                    status, reply = "max_rounds", message["content"]
                    break
                async with aclosing(
                    self._tool_round(calls, argument_errors, state)
                ) as round_events:
                    try:
                        async for event in round_events:
                            if emit is not None:
                                emit(event)
                            yield event
                    except GeneratorExit:
                        state.closing = True  # closing the round awaits its cancelled tools
                        raise
                event = StepFinished(name, rounds)
                if emit is not None:
                    emit(event)
                yield event
        except BaseException as exc:
            status = "failed" if isinstance(exc, Exception) else "cancelled"
            closed = isinstance(exc, GeneratorExit)
            if closed or state.closing:
                # The consumer stopped iterating (or a cleanup await then raised a cancel
                # pending on the task in its place): settle, tell the scope, never yield.
                reply = await self._settle(state, status, reply)
                if emit is not None:
                    error = None if closed else _describe(exc)
                    emit(RunFinished(name, status, reply, state.usage, error))
                raise
            failure = exc
        finally:
            if not state.closed:
                reply = await self._settle(state, status, reply)
        if state.store_error is not None and failure is None:
            status, failure = "failed", state.store_error
        final = RunFinished(
            name,
            status,
            reply,
            state.usage,
            None if failure is None else _describe(failure),
        )
        if emit is not None:
            emit(final)
        if failure is None:
            yield final
            return
        # Deliver the terminal event, then the exception, whatever the consumer does next.
        try:
            yield final
        except GeneratorExit:
            raise failure from None
        raise failure

    async def _tool_round(
        self,
        calls: list[ToolCall],
        argument_errors: dict[str, str],
        state: _RunState,
    ) -> AsyncGenerator[Event, None]:
        name = self._config.name
        if self._config.concurrent_tools and len(calls) > 1:
            for call in calls:
                yield ToolCallStarted(name, call["id"], call["function"]["name"],
                                      call["function"]["arguments"])
            tasks = [
                asyncio.ensure_future(self._call_tool(call, argument_errors, state))
                for call in calls
            ]
            try:
                for finished in asyncio.as_completed(tasks):
                    yield await finished
            finally:
                pending = [t for t in tasks if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
            return
        for call in calls:
            yield ToolCallStarted(name, call["id"], call["function"]["name"],
                                  call["function"]["arguments"])
            yield await self._call_tool(call, argument_errors, state)

    async def _call_tool(
        self,
        call: ToolCall,
        argument_errors: dict[str, str],
        state: _RunState,
    ) -> ToolResult:
        """Run one call and record its result the moment it exists."""
        error = argument_errors.get(call["id"])
        if error is not None:
            outcome = ToolOutcome(error, True)
        else:
            context = ToolContext(
                agent=self._config.name,
                call_id=call["id"],
                tool_name=call["function"]["name"],
                interrupt_probe=state.interrupt_asked,
            )
            state.contexts.append(context)
            outcome = await invoke(self._config.tools_by_name, call, context)
        result = _result(call, outcome)
        if not state.closed:
            await self._record(result)
        return ToolResult(
            self._config.name, call["id"], result["name"], outcome.content, outcome.is_error
        )

    async def _settle(self, state: _RunState, status: RunStatus, reply: str) -> str:
        """Leave a valid transcript however the run ended; return the reply to report.

        Memory is settled first; a store that fails now is kept in ``state.store_error``
        (the run ends ``failed``, its transcript in memory and restorable).
        """
        state.closed = True
        messages = self.model_client.messages
        for context in state.contexts:
            context.mark_cancelled()
        unstored: list[Message] = []
        assembler = state.assembler
        if assembler is not None and assembler.started:
            unstored.append(assembler.message())
            messages.append(unstored[-1])
            reply = reply or assembler.text
        if status in ("cancelled", "failed"):
            last_assistant = len(messages) - 1
            while last_assistant > 0 and messages[last_assistant]["role"] == "tool":
                last_assistant -= 1
            unstored.extend(settle(messages, start=max(last_assistant, 0)))
        try:
            if self._writer is not None:
                for message in unstored:
                    await self._writer.append(message)
                await self._writer.set_status(status)
        except StoreError as error:
            state.store_error = error
        finally:
            self.last_status = status
            self._interrupt_requested = False
            self._run_active = False
        return reply


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _result(call: ToolCall, outcome: ToolOutcome) -> ToolMessage:
    return {
        "role": "tool",
        "content": outcome.content,
        "tool_call_id": call["id"],
        "name": call["function"]["name"],
    }


async def _drain(events: AsyncGenerator[Event, None]) -> str:
    """Run the loop to its end for ``run()``; return the reply of its RunFinished."""
    reply = ""
    async with aclosing(events):
        async for event in events:
            if isinstance(event, RunFinished):
                reply = event.reply
    return reply
