"""The chat loop: :class:`Assistant` runs turns that can be stopped at any moment.

:class:`Assistant` reads input lines while a turn runs. Each turn is a background
:class:`~aimu.aio.RunHandle` that streams its reply to the :class:`~.screen.Screen`;
``/stop`` cancels the turn running now (its partial reply stays in the session), input
typed meanwhile runs after it in order, and every message is durable in a store
session, so a restart with the same session continues the conversation.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import sys
import traceback
import types
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, cast

from aimu.aio._signals import SignalHandlers
from aimu.aio.agent import Agent
from aimu.aio.client import ModelClient
from aimu.aio.errors import AimuError
from aimu.aio.events import (
    Event,
    ModelRetry,
    RunFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
)
from aimu.aio.limits import UsageLimits
from aimu.aio.providers.test import EMBEDDED, WHAT_IT_DOES
from aimu.aio.run_handle import RunHandle
from aimu.aio.store import Store, validate_session_name
from aimu.aio.tools import Tool, Toolset
from aimu.assistant.client import error_line, without_hint
from aimu.assistant.commands import (
    fresh_name,
    nothing_to_resume,
    show_help,
    show_history,
    show_sessions,
)
from aimu.assistant.screen import (
    INTERRUPTED_MARK,
    STOPPED,
    Screen,
    arguments_text,
    one_line,
    progress_text,
)
from aimu.assistant.stdin import StdinReader
from aimu.assistant.tools import DEMO_TOOLS

__all__ = ["Assistant", "Leaving", "Mode", "as_message"]


def as_message(text: str) -> str | None:
    """The message a line sends, or None for a command (``//`` sends a leading slash)."""
    if not text.startswith("/"):
        return text
    return text[1:] if text.startswith("//") else None


class Mode(enum.Enum):
    """What the assistant is doing: it decides what a line typed now does."""

    CLOSED = "closed"
    """Not serving: lines are queued for when it serves."""
    IDLE = "idle"
    """Serving, nothing under way: a message starts a turn at once."""
    ASKING = "asking"
    """Idle, and a paused turn's call waits: the next message answers "approve? [y/N]"."""
    COMMAND = "command"
    """A queued line is being handled (``/sessions`` reads the store): lines queue after it."""
    RUNNING = "running"
    """A turn runs, or ended and is not reported yet: ``/stop`` and Ctrl+C act on it."""


class Leaving(enum.Enum):
    """Whether serving should end, and when."""

    NO = "no"
    WHEN_DONE = "when done"
    """The input ended (or ``/quit``): once the queued lines and the turn are done."""
    NOW = "now"
    """Ctrl+C asked to exit: once the turn has settled, whatever is queued."""


@dataclass(eq=False, slots=True)
class _ChatTurn:
    handle: RunHandle[RunFinished]
    presses: int = 0
    """Ctrl+C presses meant for this turn: 1 interrupts, 2 cancels, 3 exits."""



class Assistant:
    """A chat serve loop over one model client and one session store.

    Feed it lines with :meth:`submit` (or let :meth:`serve` read stdin); ``/stop`` and
    ``/interrupt`` act on the running turn at once, everything else runs in order.
    :meth:`open` (or :meth:`serve`) opens ``session`` for writing
    (``SessionLockedError`` if it is open elsewhere). ``prompt`` shows the plain mode's
    ``> ``; ``colour=True`` is the editor's mode (:mod:`aimu._terminal`); ``plain``
    prints no colour even on a terminal.
    """

    def __init__(
        self,
        client: ModelClient,
        store: Store,
        *,
        session: str = "default",
        system: str | None = None,
        tools: Sequence[Callable[..., Any] | Tool | Toolset] = DEMO_TOOLS,
        out: TextIO | None = None,
        err: TextIO | None = None,
        prompt: bool = False,
        colour: bool = False,
        join: bool = False,
        plain: bool = False,
        max_rounds: int = 10,
        limits: UsageLimits | None = None,
    ) -> None:
        self._client = client
        self._limits = limits
        self._store = store
        self._system = system
        self._tools = tuple(tools)
        self._max_rounds = max_rounds
        self._prompt = prompt
        # colour=True is the editor's mode (aimu._terminal): the screen holds the line
        # still streaming for the prompt to draw. Any terminal sees a model's or a tool's
        # control characters escaped, never acted on, and gets colour unless ``plain``.
        self._screen = Screen(
            out if out is not None else sys.stdout,
            err if err is not None else sys.stderr,
            editor=colour,
            colour=not plain,
        )
        self._join = join
        self._mode = Mode.CLOSED
        self._leaving = Leaving.NO
        # What the modes act on: the turn of RUNNING; the tool call whose "approve?
        # [y/N]" the next message answers (ASKING, and while a queued line is handled).
        self._current: _ChatTurn | None = None
        self._asking: str | None = None
        self._waiting: str | None = None  # what the running turn waits for, for a spinner
        self._agent = self._open(session)
        self._backlog: deque[str] = deque()
        # The finished turn that the last Ctrl+C was meant for, until new input comes:
        # a press that was meant for a turn that ended meanwhile must not exit the chat.
        self._pressed: _ChatTurn | None = None
        self._last_turn_failed = False
        self._turns = 0
        self._wake = asyncio.Event()

    def _open(self, session: str) -> Agent:
        validate_session_name(session)
        return Agent(
            self._client.fork(),
            self._tools,
            system=self._system,
            max_rounds=self._max_rounds,
            limits=self._limits,
            name="assistant",
            store=self._store,
            session=session,
        )

    async def open(self) -> None:
        """Open the current session for writing and load it; ``serve()`` does it first."""
        await self._agent.open()

    @property
    def agent(self) -> Agent:
        """The agent of the current session (``/new`` replaces it)."""
        return self._agent

    @property
    def session(self) -> str:
        session = self._agent.session
        assert session is not None
        return session

    @property
    def mode(self) -> Mode:
        """What the assistant is doing now (what a line typed now does)."""
        return self._mode

    def _at_rest(self) -> Mode:
        """The mode with nothing under way: asking, when a call waits for an answer."""
        return Mode.ASKING if self._asking is not None else Mode.IDLE

    @property
    def running(self) -> bool:
        """True while a turn is running."""
        return self._running() is not None

    @property
    def waiting(self) -> str | None:
        """What the running turn waits for ("the model", a tool), for a spinner; else None."""
        return self._waiting if self._mode is Mode.RUNNING else None

    @property
    def turn(self) -> RunHandle[RunFinished] | None:
        """The handle of the turn running now (or settling, not yet reported), else None."""
        return self._current.handle if self._current is not None else None

    async def aclose(self) -> None:
        """Release the current session (its write lock); the client and store stay open."""
        await self._agent.aclose()

    # -- output --------------------------------------------------------------------

    @property
    def partial_line(self) -> str:
        """In the editor (``colour=True``): the reply's line still streaming, not yet printed."""
        return self._screen.partial_line

    def _line(self, text: str, kind: str = "") -> None:
        self._screen.line(text, kind)

    def _error(self, text: str) -> None:
        self._screen.error(text)

    def _retrying(self, event: Event) -> None:
        """Say on ``err`` that the model request is retried, rather than wait in silence."""
        if isinstance(event, ModelRetry):
            self._waiting = f"retrying the model (attempt {event.attempt + 1})"
            error = without_hint(event.error, self._client)  # the error says it if all fail
            text = f"(retry {event.attempt} in {event.delay:.1f}s: {one_line(error)})"
            self._screen.to_err(text, "note")

    def _show_prompt(self) -> None:
        if self._prompt and self._mode is not Mode.RUNNING and not self._backlog:
            self._screen.prompt()

    def _show(self, event: Event) -> None:
        if isinstance(event, ThinkingChunk | TextChunk):
            self._waiting = None
        elif isinstance(event, ToolCallStarted):
            self._waiting = f"running {one_line(event.name)}"
        elif isinstance(event, ToolProgress):  # the status line says how far it is
            self._waiting = f"running {one_line(event.name)} ({progress_text(event)})"
        elif isinstance(event, ToolResult):
            self._waiting = "waiting for the model"
        self._screen.show(event)

    # -- input ---------------------------------------------------------------------

    def submit(self, line: str) -> None:
        """Take one input line; call it on the loop's thread.

        ``/stop`` and ``/interrupt`` act on the running turn now; any other line (a
        message or a command) is queued and handled after the turns before it.
        """
        text = line.strip()
        if not text:
            return
        self._pressed = None  # new input: an idle Ctrl+C exits again
        at_once = _AT_ONCE.get(text.split(maxsplit=1)[0].lower())
        if at_once is not None:
            at_once(self)
        elif self._idle() and (message := as_message(text)) is not None:
            self._take(message)  # at once, so that a /stop right after it finds it
        elif self._join and self._joins(text):
            pass
        else:
            self._backlog.append(text)
            self._wake.set()

    def _take(self, message: str) -> None:
        """A message when no turn runs: the answer to "approve?", or a new turn."""
        if self._asking is not None:
            self._decide(message.strip().lower() in ("y", "yes"), self._asking, None)
        else:
            self._start(message)

    def _joins(self, text: str) -> bool:
        """In join mode, send a message typed during a turn into that turn."""
        message = as_message(text)
        if message is None or self._running() is None or not self._agent.send(message):
            return False
        self._line("(joins the running turn at its next step)")
        return True

    def end_input(self) -> None:
        """No more input (EOF): :meth:`serve` returns once the queued input is done."""
        self._screen.input_ended()
        if self._leaving is Leaving.NO:
            self._leaving = Leaving.WHEN_DONE
        self._wake.set()

    def _idle(self) -> bool:
        return self._mode in (Mode.IDLE, Mode.ASKING) and not self._backlog

    def _running(self) -> _ChatTurn | None:
        turn = self._current
        return turn if turn is not None and not turn.handle.done else None

    def _running_or_say(self, verb: str) -> _ChatTurn | None:
        """The running turn, or None after saying there is nothing to ``verb``."""
        turn = self._running()
        if turn is None:
            self._line(f"(nothing to {verb}: no turn is running)")
            self._show_prompt()
        return turn

    def _stop(self) -> None:
        if (turn := self._running_or_say("stop")) is not None:
            turn.handle.cancel("/stop")

    def _interrupt(self) -> None:
        turn = self._running_or_say("interrupt")
        if turn is not None and turn.handle.interrupt():
            self._line("(interrupting: this step finishes, then the turn stops; /stop stops now)")

    def press_ctrl_c(self) -> None:
        """Ctrl+C: interrupt the running turn, cancel it on a second press; exit when idle.

        A press counts against the turn that is running or settling, or against the
        turn the previous press was for until new input arrives: two quick presses
        never exit, even when the turn ended between them. A third press exits once
        the turn has settled. Nothing of the count reaches the next turn.
        """
        if self._prompt:
            self._screen.write("\n")  # the terminal echoed ^C: our line starts after it
        turn = self._current if self._current is not None else self._pressed
        if turn is None:
            self._line("(bye)")
            self._leaving = Leaving.NOW
            self._wake.set()
            return
        self._pressed = turn
        turn.presses += 1
        running = not turn.handle.done
        if turn.presses == 1:
            if running and turn.handle.interrupt():
                self._line(
                    "(Ctrl+C: this step finishes, then the turn stops; "
                    "press Ctrl+C again to stop now)"
                )
        elif turn.presses == 2:
            if running:
                turn.handle.cancel("Ctrl+C")
            else:
                self._line("(the turn has already ended; press Ctrl+C again to exit)")
        else:
            self._line("(bye)" if not running else "(exiting once this turn has stopped)")
            self._leaving = Leaving.NOW
            self._wake.set()

    # -- serving -------------------------------------------------------------------

    async def serve(
        self, *, stdin: bool = False, sigint: bool = False, terminal: Path | None = None
    ) -> int:
        """Serve until the input ends (after the queued input is done) or Ctrl+C when idle.

        ``stdin=True`` reads lines from standard input in a daemon thread; ``terminal``
        (a history file) reads them with line editing instead (``aimu._terminal``);
        ``sigint=True`` wires Ctrl+C (main thread only). Returns the exit status: 1 if
        the last turn failed, else 0.
        """
        if self._mode is not Mode.CLOSED:
            raise RuntimeError("this Assistant is already serving")
        await self.open()
        self._mode = Mode.IDLE
        loop = asyncio.get_running_loop()
        stop_reading = self._read_input(stdin, terminal)
        restore_sigint = self._wire_sigint(loop) if sigint else None
        try:
            self._banner()
            if self._agent.pending_approvals:  # paused before a restart: ask again
                self._line("(this session is paused: a tool call waits for your approval)")
                self._ask_next()
            self._show_prompt()
            await self._loop()
        finally:
            await stop_reading()
            if restore_sigint is not None:
                restore_sigint()
            try:
                await self._abandon_turn()
            finally:
                self._mode = Mode.CLOSED
        return 1 if self._last_turn_failed else 0

    async def _loop(self) -> None:
        """Report turns as they end and run queued lines in order, until the input ended
        (and nothing is queued or running) or an exit was asked for."""
        while True:
            self._wake.clear()
            turn = self._current
            if turn is not None and turn.handle.done:
                self._current = None
                self._mode = self._at_rest()
                await self._report(turn)
                self._show_prompt()
                continue
            if turn is None:
                if self._leaving is Leaving.NOW:
                    return
                if self._backlog:
                    await self._handle_queued(self._backlog.popleft())
                    self._show_prompt()
                    continue
                if self._leaving is Leaving.WHEN_DONE:
                    return
            await self._wake.wait()

    async def _handle_queued(self, text: str) -> None:
        self._mode = Mode.COMMAND
        try:
            await self._handle(text)
        finally:
            if self._mode is Mode.COMMAND:  # not a turn it started
                self._mode = self._at_rest()

    def _read_input(
        self, stdin: bool, terminal: Path | None
    ) -> Callable[[], Coroutine[Any, Any, None]]:
        """Start reading lines (the editor, or stdin); return what stops the reading."""
        if terminal is not None:
            from aimu._terminal import read_lines

            editor = asyncio.create_task(read_lines(self, terminal), name="aimu-chat-input")
            editor.add_done_callback(lambda _: self.end_input())

            async def stop_editor() -> None:
                editor.cancel()
                await asyncio.wait([editor])  # ours to cancel: its CancelledError stays in it

            return stop_editor
        reader = StdinReader(asyncio.get_running_loop(), self.submit, self.end_input)
        if stdin:
            reader.start()

        async def stop_stdin() -> None:
            reader.stop()

        return stop_stdin

    def _wire_sigint(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Send Ctrl+C to :meth:`press_ctrl_c`; return what puts the previous handler
        back (see :mod:`aimu.aio._signals`)."""

        def on_signal(signum: int, frame: types.FrameType | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.press_ctrl_c)

        try:
            return SignalHandlers(on_signal).restore
        except ValueError:  # not the main thread: Ctrl+C stays with whoever has it
            return None

    async def _abandon_turn(self) -> None:
        """Cancel a turn still running when serving ends, and wait for it to settle."""
        turn = self._current
        self._current = None
        if self._mode is Mode.RUNNING:
            self._mode = self._at_rest()
        if turn is None or turn.handle.done:
            return
        turn.handle.cancel("the assistant is closing")
        ended = asyncio.get_running_loop().create_future()

        def on_done(_: object) -> None:
            if not ended.done():
                ended.set_result(None)

        turn.handle.add_done_callback(on_done)
        await ended

    def _banner(self) -> None:
        client = self._agent.model_client
        count = sum(1 for m in self._agent.messages if m["role"] != "system")
        plural = "" if count == 1 else "s"
        known = f"{count} message{plural}; /history shows them" if count else "new"
        spec = f"{client.provider}:{client.model}"
        where = client.host
        if client.model == client.provider:  # the embedded "test", not "test:test"
            spec = client.model
        if client.host == EMBEDDED:  # what a newcomer's first answer will look like
            where = f"{EMBEDDED} and offline: {WHAT_IT_DOES}"
        self._line(
            f"aimu chat: model {spec} ({where}), "
            f"session {self.session!r} ({known}). /help lists the commands."
        )

    async def _handle(self, text: str) -> None:
        """Run one queued line; an expected error (a store failing) is one line, not an exit."""
        message = as_message(text)
        if message is not None:
            self._take(message)
            return
        try:
            await self._command(text)
        except AimuError as error:
            self._error(error_line(error))

    async def _command(self, text: str) -> None:
        word, _, rest = text.partition(" ")
        command = _COMMANDS.get(word.lower())
        if command is None:
            self._line(
                f"unknown command {word}: /help lists the commands "
                "(start a message with // to send it as text)"
            )
            return
        await command(self, rest.strip())

    # -- the queued commands (see _COMMANDS), each given the rest of its line ----------

    async def _resume_command(self, rest: str) -> None:
        self._resume()

    async def _approve_command(self, rest: str) -> None:
        self._approve_or_deny(True, rest)

    async def _deny_command(self, rest: str) -> None:
        self._approve_or_deny(False, rest)

    async def _join_command(self, rest: str) -> None:
        self._join = not self._join
        mode = "join the running turn" if self._join else "queue after it"
        self._line(f"(lines typed during a turn now {mode})")

    async def _history_command(self, rest: str) -> None:
        show_history(self._screen, self.session, self._agent.messages)

    async def _sessions_command(self, rest: str) -> None:
        await show_sessions(self._screen, self._store, self.session)

    async def _new_command(self, rest: str) -> None:
        await self._new(rest or None)

    async def _help_command(self, rest: str) -> None:
        show_help(self._screen)

    async def _quit_command(self, rest: str) -> None:
        self._backlog.clear()
        if self._leaving is Leaving.NO:
            self._leaving = Leaving.WHEN_DONE

    def _start(self, task: str | None) -> None:
        self._pressed = None
        self._waiting = "waiting for the model"
        self._turns += 1
        handle = RunHandle.start(self._turn(self._agent, task), name=f"turn {self._turns}")
        handle.add_done_callback(lambda _: self._wake.set())
        # A retry is told to the run's scope (the handle), not in the agent's events.
        handle.add_listener(lambda event: self._retrying(event))
        self._current = _ChatTurn(handle)
        self._mode = Mode.RUNNING

    async def _turn(self, agent: Agent, task: str | None) -> RunFinished:
        """One turn: stream the run's events to the output; return its final event."""
        events = agent.run(task, stream=True) if task is not None else agent.resume(stream=True)
        finished: RunFinished | None = None
        async with aclosing(events):
            async for event in events:
                if isinstance(event, RunFinished):
                    finished = event
                else:
                    self._show(event)
        if finished is None:
            raise RuntimeError("the agent run ended without its final event")
        return finished

    async def _report(self, turn: _ChatTurn) -> None:
        """Say how a finished turn ended: nothing more, (stopped), (interrupted), an error."""
        handle = turn.handle
        self._waiting = None
        self._last_turn_failed = False
        final = await handle.wait()  # never raises: the run's outcome is in the event
        if handle.cancelled:
            self._line(STOPPED)
            return
        error = handle.exception()
        if isinstance(error, BrokenPipeError) or not isinstance(error, Exception | None):
            raise error  # our own output went away (nobody to tell), or not a run's error
        if isinstance(error, AimuError):
            self._last_turn_failed = True
            self._error(error_line(error, self._client))
            return
        if error is not None:  # a bug, not an expected error: details go to stderr
            self._last_turn_failed = True
            traceback.print_exception(error, file=self._screen.err)
            self._error(f"{type(error).__name__}: {error_line(error)}")
            return
        finished = cast(RunFinished, final.result)  # what _turn returned
        if finished.status == "paused":
            self._line("(paused: a tool call waits for your approval)")
            self._ask_next()
        elif finished.status == "interrupted":
            self._line(INTERRUPTED_MARK)
        elif finished.status == "max_rounds":
            self._line(f"(stopped: the turn used its {self._max_rounds} tool rounds)")
        elif finished.status == "limited":
            self._line(f"(stopped: {finished.stop_reason}; /resume goes on)")
        elif finished.status == "blocked":
            self._line(f"(blocked: {finished.reply})")
        elif finished.status == "incomplete":
            self._line(f"(cut off: the model stopped with {finished.stop_reason!r})")
        else:
            self._screen.end_line()

    # -- commands --------------------------------------------------------------------

    def _resume(self) -> None:
        reason = nothing_to_resume(self._agent.messages)
        if reason is not None:
            self._line(reason)
            return
        self._line("(resuming)")
        self._start(None)

    def _ask_next(self) -> None:
        """Ask about the first call still waiting; resume the turn once none is left."""
        waiting = self._agent.pending_approvals
        if not waiting:
            self._asking = None
            self._line("(resuming)")
            self._start(None)
            return
        call = waiting[0]
        self._asking = call.call_id
        if self._mode is Mode.IDLE:
            self._mode = Mode.ASKING
        arguments = arguments_text(call.arguments)
        doubt = " (it was running when the chat stopped: approving runs it again)"
        self._line(
            f"[{call.tool}({one_line(arguments)}) call {call.call_id}]"
            f"{doubt if call.in_doubt else ''} approve? [y/N]",
            "tool",
        )

    def _approve_or_deny(self, approved: bool, rest: str) -> None:
        """``/approve [ID]`` and ``/deny [ID] [WHY]``: the call asked about by default."""
        word, _, why = rest.partition(" ")
        waiting = [p.call_id for p in self._agent.pending_approvals]
        call_id: str | None
        if word in waiting:
            call_id, reason = word, why.strip() or None
        else:
            call_id, reason = self._asking or (waiting[0] if waiting else None), rest or None
        if call_id is None:
            self._line("(nothing waits for approval)")
            return
        self._decide(approved, call_id, reason)

    def _decide(self, approved: bool, call_id: str, reason: str | None) -> None:
        try:
            if approved:
                self._agent.approve(call_id)
            else:
                self._agent.deny(call_id, reason or "denied in the chat")
        except (ValueError, RuntimeError) as error:
            self._error(error_line(error))
            return
        self._line(f"({'approved' if approved else 'denied'} call {call_id})")
        self._ask_next()

    async def _new(self, name: str | None) -> None:
        name = name or await fresh_name(self._store, self.session)
        if name == self.session:
            self._line(f"(already in session {name!r})")
            return
        try:
            agent = self._open(name)
        except ValueError as error:
            self._error(error_line(error))
            return
        try:
            await agent.open()
        except AimuError as error:
            await agent.aclose()
            self._error(error_line(error))
            return
        previous, self._agent = self._agent, agent
        await previous.aclose()
        count = len(agent.messages)
        if count:
            self._line(f"(switched to session {name!r}: {count} messages)")
        else:
            self._line(f"(new session {name!r})")


#: The commands a line runs at once, even while a turn runs.
_AT_ONCE: Mapping[str, Callable[[Assistant], None]] = {
    "/stop": Assistant._stop,
    "/interrupt": Assistant._interrupt,
}

#: The commands a line runs in its turn, after the turns and lines before it.
_COMMANDS: Mapping[str, Callable[[Assistant, str], Awaitable[None]]] = {
    "/resume": Assistant._resume_command,
    "/approve": Assistant._approve_command,
    "/deny": Assistant._deny_command,
    "/join": Assistant._join_command,
    "/history": Assistant._history_command,
    "/sessions": Assistant._sessions_command,
    "/new": Assistant._new_command,
    "/help": Assistant._help_command,
    "/quit": Assistant._quit_command,
    "/exit": Assistant._quit_command,
}
