"""The assistant people run: a chat loop whose turns can be stopped at any moment.

:class:`Assistant` reads input lines while a turn runs. Each turn is a background
:class:`~aimu.aio.RunHandle` that streams its reply to ``out``; ``/stop`` cancels the
turn running now (its partial reply stays in the session), input typed meanwhile runs
after it in order, and every message is durable in a store session, so a restart with
the same session continues the conversation. ``aimu chat`` and
``examples/personal-assistant`` both run this loop.

Output is line-oriented and flushed: reply text as it streams, ``[calling ...]`` and
``[tool → ...]`` lines for tool rounds, ``(thinking…)``, ``(stopped)`` and
``(interrupted)`` on lines of their own. An expected error is one ``error: ...`` line
on ``err`` (stderr), never a traceback, and :meth:`Assistant.serve` returns 1 when the
last turn failed. A ``> `` prompt is shown only on a terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import select
import shutil
import signal
import sys
import threading
import time
import traceback
import types
import unicodedata
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TextIO

from aimu._logs import add_log_level_option, logging_to
from aimu.aio.agent import Agent
from aimu.aio.client import ModelClient
from aimu.aio.client import client as make_model_client
from aimu.aio.errors import AimuError, ModelConnectionError
from aimu.aio.events import (
    Event,
    ModelRetry,
    RunFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolResult,
)
from aimu.aio.run_handle import RunHandle
from aimu.aio.store import SQLiteStore, Store, validate_session_name
from aimu.aio.tools import Tool, ToolContext
from aimu.aio.transcript import Message

__all__ = [
    "DEMO_TOOLS",
    "RESEARCH_SECONDS",
    "TEST_MODEL_DELAY",
    "Assistant",
    "ChatSettings",
    "add_chat_options",
    "current_time",
    "default_home",
    "make_client",
    "research",
    "run_chat",
    "word_count",
]

#: Seconds between the embedded test model's chunks, so a person sees the reply stream.
TEST_MODEL_DELAY = 0.03
#: How long the demo ``research`` tool works, so a person can stop it midway.
RESEARCH_SECONDS = 1.5

STOPPED = "(stopped)"
INTERRUPTED = "(interrupted)"

_CLIP = 200
_HELP = (
    ("/stop", "stop the running turn now; its partial reply stays in the session"),
    ("/interrupt", "let the running turn finish its current step, then stop"),
    ("/resume", "continue the turn that was stopped, interrupted or paused"),
    ("/approve [ID]", "let the tool call waiting for approval run (the one asked about)"),
    ("/deny [ID] [WHY]", "refuse it; the model reads that it was denied, and why"),
    ("/join", "switch mode: lines typed during a turn join it, or queue (the default)"),
    ("/history", "show this session's messages"),
    ("/sessions", "list the stored sessions"),
    ("/new [NAME]", "start a fresh session (or switch to session NAME)"),
    ("/help", "show this help"),
    ("/quit", "exit once the running turn and the queued input are done"),
)
# What to check when the model server cannot be reached, in the chat's own terms (the
# library's hint names the client's arguments).
_CLI_HINTS = {
    "ollama": "is Ollama running there? set OLLAMA_HOST, or chat offline with --model test",
    "openai": "is the server running? set OPENAI_BASE_URL, or chat offline with --model test",
}
_KEYS = (
    "Input typed while a turn runs is queued and answered in order (after /join it joins "
    "the running turn at its next step instead). Ctrl+C interrupts "
    "the running turn (press it again to stop it now) or exits when idle; Ctrl+D exits."
)


# --------------------------------------------------------------------------- demo tools


def current_time() -> str:
    """The current local date and time, in ISO 8601."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def word_count(text: Annotated[str, "the text whose words to count"]) -> int:
    """Count the words in a text."""
    return len(text.split())


def research(topic: Annotated[str, "what to look into"], ctx: ToolContext) -> str:
    """Look into a topic and return notes on it. Slow: it takes a moment."""
    # A sync tool runs in a worker thread: waiting on the context lets a cancel end it.
    if ctx.wait_cancelled(RESEARCH_SECONDS) or ctx.cancelled:
        return f"research on {topic!r} was cancelled"
    return f"notes on {topic!r}: it is well documented and worth a closer look"


#: The harmless tools ``aimu chat`` offers, so the test model's tool rounds show.
DEMO_TOOLS: tuple[Callable[..., Any], ...] = (current_time, word_count, research)


# --------------------------------------------------------------------------- settings


def default_home() -> Path:
    """Where state lives: ``$AIMU_HOME``, else ``~/.aimu``."""
    return Path(os.environ.get("AIMU_HOME") or "~/.aimu").expanduser()


def _default_model() -> str:
    return os.environ.get("AIMU_MODEL") or "test"


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What one chat runs with; ``home`` holds the session store (``sessions.db``)."""

    model: str = field(default_factory=_default_model)
    session: str = "default"
    system: str | None = None
    home: Path = field(default_factory=default_home)
    tools: bool = True
    log_level: str | None = None
    """Send the "aimu" loggers' records at this level and above to stderr (None: off)."""
    plain: bool = False
    """Plain line input even on a terminal (no line editing, history or colour)."""
    join: bool = False
    """Lines typed during a turn join it (``agent.send``) instead of queueing after it."""

    @property
    def store_path(self) -> Path:
        return self.home / "sessions.db"

    @property
    def history_path(self) -> Path:
        """The lines typed at a terminal, for Up and Ctrl+R (readable by the user only)."""
        return self.home / "history"

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> ChatSettings:
        """Settings from options parsed by a parser that :func:`add_chat_options` set up."""
        return cls(
            model=options.model or _default_model(),
            session=options.session,
            system=options.system,
            tools=not options.no_tools,
            log_level=options.log_level,
            plain=options.plain,
            join=options.join,
        )


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--session``, ``--system`` and ``--no-tools`` to ``parser``."""
    parser.add_argument(
        "--model",
        metavar="SPEC",
        default=None,
        help="the model: test (embedded, offline), ollama:NAME or openai:NAME "
        "(default: $AIMU_MODEL, else test)",
    )
    parser.add_argument(
        "--session",
        metavar="NAME",
        default="default",
        help="the conversation to continue or start (default: default); "
        "kept in $AIMU_HOME/sessions.db ($AIMU_HOME defaults to ~/.aimu)",
    )
    parser.add_argument("--system", metavar="TEXT", default=None, help="the system prompt")
    parser.add_argument(
        "--no-tools", action="store_true", help="offer the model no tools (for models without)"
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="lines typed during a turn join that turn at its next step, instead of "
        "being queued and answered after it (/join switches while chatting)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain line input on a terminal too: no line editing, history, colour or spinner",
    )
    add_log_level_option(parser, default=None)


def make_client(spec: str) -> ModelClient:
    """The model client for ``spec``; the embedded test model streams visibly slowly."""
    if spec.partition(":")[0] == "test":
        return make_model_client(spec, delay=TEST_MODEL_DELAY)
    return make_model_client(spec)


# --------------------------------------------------------------------------- the loop


@dataclass(eq=False, slots=True)
class _Turn:
    handle: RunHandle[RunFinished]
    presses: int = 0
    """Ctrl+C presses meant for this turn: 1 interrupts, 2 cancels, 3 exits."""


def _one_line(text: str, limit: int = _CLIP) -> str:
    text = _printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Control characters other than newline and tab, shown as escapes (ESC as \x1b).
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F]}
_COLOURS = {"note": "\x1b[2m", "tool": "\x1b[36m", "error": "\x1b[31m"}


def _wrap_point(text: str, width: int) -> int | None:
    """Where to break ``text`` to fit ``width`` terminal columns (after its last space
    that fits, else at the width); None if it fits. East Asian wide characters take two."""
    columns = 0
    space = 0
    for index, char in enumerate(text):
        columns += 2 if unicodedata.east_asian_width(char) in "WF" else 1
        if columns > width:
            return space or index or 1
        if char == " ":
            space = index + 1
    return None


def _arguments_text(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as ``key=value`` pairs, values in JSON."""
    return ", ".join(f"{key}={json.dumps(v, ensure_ascii=False)}" for key, v in arguments.items())


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so showing it cannot drive a terminal."""
    return text.translate(_CONTROL)


def _as_message(text: str) -> str | None:
    """The message a line sends, or None for a command (``//`` sends a leading slash)."""
    if not text.startswith("/"):
        return text
    return text[1:] if text.startswith("//") else None


def _error_line(error: BaseException, client: ModelClient | None = None) -> str:
    """The first line of ``error``'s message; a connection error gets the chat's hint."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    if isinstance(error, ModelConnectionError) and client is not None:
        line = _in_chat_terms(line, client)
    return line


def _in_chat_terms(text: str, client: ModelClient) -> str:
    """``text`` with ``client``'s hint (which names its arguments) in the chat's terms."""
    hint = getattr(client, "hint", None)
    if isinstance(hint, str) and client.provider in _CLI_HINTS:
        return text.replace(hint, _CLI_HINTS[client.provider])
    return text


def _describe(message: Message) -> str:
    role = message["role"]
    content = _one_line(message["content"])
    if message["role"] == "assistant":
        calls = message.get("tool_calls") or []
        if calls:
            names = ", ".join(call["function"]["name"] for call in calls)
            content = f"{content} [calls {names}]".lstrip()
        if message.get("aimu_partial"):
            content = f"{content} {STOPPED}".lstrip()
    elif message["role"] == "tool":
        return f"tool {message['name']}: {content}"
    return f"{role}: {content}"


class Assistant:
    """A chat serve loop over one model client and one session store.

    Feed it lines with :meth:`submit` (or let :meth:`serve` read stdin); ``/stop`` and
    ``/interrupt`` act on the running turn at once, everything else runs in order.
    :meth:`open` (or :meth:`serve`) opens ``session`` for writing
    (``SessionLockedError`` if it is open elsewhere).
    """

    def __init__(
        self,
        client: ModelClient,
        store: Store,
        *,
        session: str = "default",
        system: str | None = None,
        tools: Sequence[Callable[..., Any] | Tool] = DEMO_TOOLS,
        out: TextIO | None = None,
        err: TextIO | None = None,
        prompt: bool = False,
        colour: bool = False,
        join: bool = False,
        max_rounds: int = 10,
    ) -> None:
        self._client = client
        self._store = store
        self._system = system
        self._tools = tuple(tools)
        self._max_rounds = max_rounds
        self._out = out if out is not None else sys.stdout
        self._err = err if err is not None else sys.stderr
        self._prompt = prompt
        # colour=True is the editor's mode (aimu._terminal): it also holds the line still
        # streaming for the prompt to draw. Any terminal gets colour (unless NO_COLOR is
        # set) and sees a model's or a tool's control characters escaped, never acted on.
        self._editor = colour
        on_terminal = colour or _is_tty(self._out)
        self._escape = on_terminal
        self._colour = on_terminal and not os.environ.get("NO_COLOR")
        self._err_colour = (colour or _is_tty(self._err)) and not os.environ.get("NO_COLOR")
        self._join = join
        # The tool call whose "approve? [y/N]" the next plain line answers.
        self._asking: str | None = None
        self._partial = ""
        self._waiting: str | None = None
        self._agent = self._open(session)
        self._backlog: deque[str] = deque()
        self._current: _Turn | None = None
        # The finished turn that the last Ctrl+C was meant for, until new input comes:
        # a press that was meant for a turn that ended meanwhile must not exit the chat.
        self._pressed: _Turn | None = None
        self._last_turn_failed = False
        self._turns = 0
        self._wake = asyncio.Event()
        self._input_ended = False
        self._exit_requested = False
        self._at_line_start = True
        self._serving = False
        self._busy = False
        self._thinking = False

    def _open(self, session: str) -> Agent:
        validate_session_name(session)
        return Agent(
            self._client.fork(),
            self._tools,
            system=self._system,
            max_rounds=self._max_rounds,
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
    def running(self) -> bool:
        """True while a turn is running."""
        return self._running() is not None

    @property
    def waiting(self) -> str | None:
        """What the running turn waits for ("the model", a tool), for a spinner; else None."""
        return self._waiting if self._current is not None else None

    @property
    def turn(self) -> RunHandle[RunFinished] | None:
        """The handle of the turn running now (or settling, not yet reported), else None."""
        return self._current.handle if self._current is not None else None

    async def aclose(self) -> None:
        """Release the current session (its write lock); the client and store stay open."""
        await self._agent.aclose()

    # -- output --------------------------------------------------------------------

    def _write(self, text: str) -> None:
        if not text:
            return
        if self._editor:
            # On a terminal whole lines go above the input line; the line still streaming
            # is shown by the prompt (partial_line), which redraws in place but does not
            # wrap: a line as wide as the terminal goes above too, broken at a space.
            done, newline, partial = (self._partial + text).rpartition("\n")
            done += newline
            width = max(20, shutil.get_terminal_size().columns - 1)
            while (cut := _wrap_point(partial, width)) is not None:
                done, partial = done + partial[:cut].rstrip(" ") + "\n", partial[cut:]
            self._partial = partial
            if done:
                self._out.write(done)
                self._out.flush()
            self._at_line_start = not self._partial
            return
        self._out.write(text)
        self._out.flush()
        self._at_line_start = text.endswith("\n")

    def _retrying(self, event: Event) -> None:
        """Say on ``err`` that the model request is retried, rather than wait in silence."""
        if isinstance(event, ModelRetry):
            self._waiting = f"retrying the model (attempt {event.attempt + 1})"
            hint = getattr(self._client, "hint", None)  # for the error, if retries fail
            error = event.error.replace(f"; {hint}", "") if isinstance(hint, str) else event.error
            text = f"(retry {event.attempt} in {event.delay:.1f}s: {_one_line(error)})"
            self._to_err(text, "note")

    def _to_err(self, text: str, kind: str) -> None:
        """``text`` as a line on ``err``, after the output so far (same terminal)."""
        self._end_line()
        if self._err is self._out:
            self._line(text, kind)
            return
        if self._err_colour:
            text = f"{_COLOURS[kind]}{text}\x1b[0m"
        self._err.write(f"{text}\n")
        self._err.flush()

    @property
    def partial_line(self) -> str:
        """In the editor (``colour=True``): the reply's line still streaming, not yet printed."""
        return self._partial

    def _line(self, text: str, kind: str = "") -> None:
        """``text`` on a line of its own, after the streamed text if a reply is mid-line.

        ``kind`` (``note``, ``tool``, ``error``) colours the line on a terminal.
        """
        kind = kind or ("note" if text.startswith("(") else "")  # (stopped), (bye)...
        if self._colour and kind:
            text = f"{_COLOURS[kind]}{text}\x1b[0m"
        self._write(("" if self._at_line_start else "\n") + text + "\n")

    def _end_line(self) -> None:
        if not self._at_line_start:
            self._write("\n")

    def _error(self, text: str) -> None:
        """One ``error: text`` line on ``err``, after the output so far (same terminal);
        its control characters escaped (a server's words may carry them)."""
        self._to_err(f"error: {_printable(text)}", "error")

    def _show_prompt(self) -> None:
        if self._prompt and self._current is None and not self._backlog:
            self._out.write("> ")
            self._out.flush()
            # The user's Enter (echoed by the terminal) ends the prompt's line.
            self._at_line_start = True

    def _show(self, event: Event) -> None:
        if isinstance(event, ThinkingChunk):
            self._waiting = None
            # Thinking can take a while before any text: say so once, not word by word.
            if not self._thinking:
                self._line("(thinking…)", "note")
                self._thinking = True
            return
        self._thinking = False
        if isinstance(event, TextChunk):
            self._waiting = None
            # On a terminal a model's escape sequences would act on it: show them instead.
            self._write(_printable(event.text) if self._escape else event.text)
        elif isinstance(event, ToolCallStarted):
            name = _one_line(event.name)  # the model named it: maybe no tool of ours
            self._waiting = f"running {name}"
            arguments = _arguments_text(event.arguments)
            self._line(f"[calling {name}({_one_line(arguments)})]", "tool")
        elif isinstance(event, ToolResult):
            self._waiting = "waiting for the model"
            verb = "failed" if event.is_error else "→"
            self._line(f"[{_one_line(event.name)} {verb} {_one_line(event.content)}]", "tool")

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
        word = text.split(maxsplit=1)[0].lower()
        if word == "/stop":
            self._stop()
        elif word == "/interrupt":
            self._interrupt()
        elif self._idle() and (message := _as_message(text)) is not None:
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
        message = _as_message(text)
        if message is None or self._running() is None or not self._agent.send(message):
            return False
        self._line("(joins the running turn at its next step)")
        return True

    def end_input(self) -> None:
        """No more input (EOF): :meth:`serve` returns once the queued input is done."""
        self._input_ended = True
        self._wake.set()

    def _idle(self) -> bool:
        return self._serving and not self._busy and self._current is None and not self._backlog

    def _running(self) -> _Turn | None:
        turn = self._current
        return turn if turn is not None and not turn.handle.done else None

    def _running_or_say(self, verb: str) -> _Turn | None:
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
            self._write("\n")  # the terminal echoed ^C: our line starts after it
        turn = self._current if self._current is not None else self._pressed
        if turn is None:
            self._line("(bye)")
            self._exit_requested = True
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
            self._exit_requested = True
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
        if self._serving:
            raise RuntimeError("this Assistant is already serving")
        await self.open()
        self._serving = True
        loop = asyncio.get_running_loop()
        stop_reading = self._read_input(stdin, terminal)
        restore_sigint = self._wire_sigint(loop) if sigint else None
        try:
            self._banner()
            if self._agent.pending_approvals:  # paused before a restart: ask again
                self._line("(this session is paused: a tool call waits for your approval)")
                self._ask_next()
            self._show_prompt()
            while True:
                self._wake.clear()
                turn = self._current
                if turn is not None and turn.handle.done:
                    self._current = None
                    await self._report(turn)
                    self._show_prompt()
                    continue
                if turn is None:
                    if self._exit_requested:
                        break
                    if self._backlog:
                        self._busy = True
                        try:
                            await self._handle(self._backlog.popleft())
                        finally:
                            self._busy = False
                        self._show_prompt()
                        continue
                    if self._input_ended:
                        break
                await self._wake.wait()
        finally:
            await stop_reading()
            if restore_sigint is not None:
                restore_sigint()
            try:
                await self._abandon_turn()
            finally:
                self._serving = False
        return 1 if self._last_turn_failed else 0

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
        reader = _StdinReader(asyncio.get_running_loop(), self.submit, self.end_input)
        if stdin:
            reader.start()

        async def stop_stdin() -> None:
            reader.stop()

        return stop_stdin

    def _wire_sigint(self, loop: asyncio.AbstractEventLoop) -> Callable[[], None] | None:
        """Send Ctrl+C to :meth:`_on_sigint`; return what puts the previous handler back.

        ``signal.signal``, not ``loop.add_signal_handler``: removing a loop handler
        would drop one the loop had before, and Ctrl+C would then do nothing.
        """

        def on_signal(signum: int, frame: types.FrameType | None) -> None:
            # Runs between two bytecodes of the main thread: queue the work, touch nothing.
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.press_ctrl_c)

        try:
            previous = signal.signal(signal.SIGINT, on_signal)
        except ValueError:  # not the main thread: Ctrl+C stays with whoever has it
            return None

        def restore() -> None:
            if signal.getsignal(signal.SIGINT) is on_signal:
                # A handler installed outside Python reads as None: the default is closest.
                signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

        return restore

    async def _abandon_turn(self) -> None:
        """Cancel a turn still running when serving ends, and wait for it to settle."""
        turn = self._current
        self._current = None
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
        count = sum(1 for m in client.messages if m["role"] != "system")
        plural = "" if count == 1 else "s"
        known = f"{count} message{plural}; /history shows them" if count else "new"
        spec = f"{client.provider}:{client.model}"
        if client.model == client.provider:  # the embedded "test", not "test:test"
            spec = client.model
        self._line(
            f"aimu chat: model {spec} ({client.host}), "
            f"session {self.session!r} ({known}). /help lists the commands."
        )

    async def _handle(self, text: str) -> None:
        """Run one queued line; an expected error (a store failing) is one line, not an exit."""
        message = _as_message(text)
        if message is not None:
            self._take(message)
            return
        try:
            await self._command(text)
        except AimuError as error:
            self._error(_error_line(error))

    async def _command(self, text: str) -> None:
        word, _, rest = text.partition(" ")
        command = word.lower()
        if command == "/resume":
            self._resume()
        elif command in ("/approve", "/deny"):
            self._approve_or_deny(command == "/approve", rest.strip())
        elif command == "/join":
            self._join = not self._join
            mode = "join the running turn" if self._join else "queue after it"
            self._line(f"(lines typed during a turn now {mode})")
        elif command == "/history":
            self._history()
        elif command == "/sessions":
            await self._sessions()
        elif command == "/new":
            await self._new(rest.strip() or None)
        elif command == "/help":
            self._help()
        elif command in ("/quit", "/exit"):
            self._backlog.clear()
            self._input_ended = True
        else:
            self._line(
                f"unknown command {word}: /help lists the commands "
                "(start a message with // to send it as text)"
            )

    def _start(self, task: str | None) -> None:
        self._pressed = None
        self._waiting = "waiting for the model"
        self._turns += 1
        handle = RunHandle.start(self._turn(self._agent, task), name=f"turn {self._turns}")
        handle.add_done_callback(lambda _: self._wake.set())
        # A retry is told to the run's scope (the handle), not in the agent's events.
        handle.add_listener(lambda event: self._retrying(event))
        self._current = _Turn(handle)

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

    async def _report(self, turn: _Turn) -> None:
        """Say how a finished turn ended: nothing more, (stopped), (interrupted), an error."""
        handle = turn.handle
        self._waiting = None
        self._last_turn_failed = False
        if handle.cancelled:
            self._line(STOPPED)
            return
        try:
            finished = await handle
        except AimuError as error:
            self._last_turn_failed = True
            self._error(_error_line(error, self._client))
            return
        except BrokenPipeError:  # our own output went away: nobody to tell
            raise
        except Exception as error:  # a bug, not an expected error: details go to stderr
            self._last_turn_failed = True
            traceback.print_exception(error, file=self._err)
            self._error(f"{type(error).__name__}: {_error_line(error)}")
            return
        if finished.status == "paused":
            self._line("(paused: a tool call waits for your approval)")
            self._ask_next()
        elif finished.status == "interrupted":
            self._line(INTERRUPTED)
        elif finished.status == "max_rounds":
            self._line(f"(stopped: the turn used its {self._max_rounds} tool rounds)")
        elif finished.status == "incomplete":
            self._line(f"(cut off: the model stopped with {finished.stop_reason!r})")
        else:
            self._end_line()

    # -- commands --------------------------------------------------------------------

    def _resume(self) -> None:
        messages = self._agent.model_client.messages
        if not any(m["role"] == "user" for m in messages):
            self._line("(nothing to resume: this session has no conversation yet)")
            return
        last = messages[-1]
        if last["role"] == "assistant" and not (
            last.get("tool_calls") or last.get("aimu_partial")
        ):
            self._line("(nothing to resume: the last turn finished; type your next message)")
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
        arguments = _arguments_text(call.arguments)
        doubt = " (it was running when the chat stopped: approving runs it again)"
        self._line(
            f"[{call.tool}({_one_line(arguments)}) call {call.call_id}]"
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
            self._error(_error_line(error))
            return
        self._line(f"({'approved' if approved else 'denied'} call {call_id})")
        self._ask_next()

    def _history(self) -> None:
        messages = self._agent.model_client.messages
        self._line(f"session {self.session!r}: {len(messages)} messages")
        for index, message in enumerate(messages, 1):
            self._line(f"{index:>3} {_describe(message)}")

    async def _sessions(self) -> None:
        infos = await self._store.sessions()
        self._line(f"{len(infos)} stored sessions (* is this one):")
        for info in infos:
            mark = "*" if info.name == self.session else " "
            updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.updated))
            status = info.status or "new"
            self._line(
                f"{mark} {info.name}: {info.message_count} messages, {status}, updated {updated}"
            )

    async def _fresh_name(self) -> str:
        taken = {info.name for info in await self._store.sessions()}
        base = time.strftime("chat-%Y%m%d-%H%M%S")
        name, serial = base, 1
        while name in taken or name == self.session:
            serial += 1
            name = f"{base}-{serial}"
        return name

    async def _new(self, name: str | None) -> None:
        name = name or await self._fresh_name()
        if name == self.session:
            self._line(f"(already in session {name!r})")
            return
        try:
            agent = self._open(name)
        except ValueError as error:
            self._error(_error_line(error))
            return
        try:
            await agent.open()
        except AimuError as error:
            await agent.aclose()
            self._error(_error_line(error))
            return
        previous, self._agent = self._agent, agent
        await previous.aclose()
        count = len(agent.model_client.messages)
        if count:
            self._line(f"(switched to session {name!r}: {count} messages)")
        else:
            self._line(f"(new session {name!r})")

    def _help(self) -> None:
        self._line("commands:")
        width = max(len(command) for command, _ in _HELP)
        for command, meaning in _HELP:
            self._line(f"  {command:<{width}} {meaning}")
        self._line(_KEYS)


class _StdinReader:
    """Reads stdin lines in a daemon thread (pipes, ttys, files, /dev/null) and posts them
    to the loop; :meth:`stop` ends the thread once serving ends, so that it neither stays
    blocked on stdin nor takes lines meant for whatever reads stdin next (POSIX: the
    thread waits in ``select`` on stdin and a wake-up pipe; elsewhere it stays blocked
    in its read until a line or EOF comes, and then ends without taking it)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        submit: Callable[[str], None],
        end_input: Callable[[], None],
    ) -> None:
        self._loop = loop
        self._submit = submit
        self._end_input = end_input
        self._stopped = False
        self._wake: tuple[int, int] | None = None
        self.thread = threading.Thread(target=self._run, name="aimu-chat-stdin", daemon=True)

    def start(self) -> None:
        if sys.platform != "win32":
            self._wake = os.pipe()
        self.thread.start()

    def stop(self) -> None:
        """Serving ended: the thread reads no more (call on the loop's thread)."""
        self._stopped = True
        wake, self._wake = self._wake, None
        if wake is not None:
            with contextlib.suppress(OSError):
                os.write(wake[1], b"x")
            os.close(wake[1])  # the thread closes the read end as it ends

    def _post(self, callback: Callable[..., None], *args: object) -> bool:
        if self._stopped:
            return False
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            return False
        return True

    def _readable(self, fd: int) -> bool:
        """Wait until ``fd`` has input (True) or :meth:`stop` was called (False)."""
        wake = self._wake
        if wake is None:
            return not self._stopped
        ready, _, _ = select.select([fd, wake[0]], [], [])
        return wake[0] not in ready and not self._stopped

    def _run(self) -> None:
        wake = self._wake
        try:
            self._read()
        finally:
            if wake is not None:
                os.close(wake[0])

    def _read(self) -> None:
        try:
            fd = sys.stdin.fileno() if sys.stdin is not None else -1
        except (OSError, ValueError):
            fd = -1
        pending = b""
        try:
            while fd >= 0 and self._readable(fd):
                # os.read, not sys.stdin: it holds no lock that interpreter exit would need.
                data = os.read(fd, 65536)
                if not data:
                    break
                pending += data
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    if not self._post(self._submit, raw.decode(errors="replace")):
                        return
            if pending:
                self._post(self._submit, pending.decode(errors="replace"))
        except OSError:
            pass
        self._post(self._end_input)


# --------------------------------------------------------------------------- running


async def run_chat(
    settings: ChatSettings,
    *,
    tools: Sequence[Callable[..., Any] | Tool] | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the assistant on stdin and stdout until EOF or Ctrl+C; return the exit status.

    ``tools`` defaults to :data:`DEMO_TOOLS` (none with ``settings.tools`` false). A
    bad setting prints one ``error:`` line on ``err`` (stderr) and returns 2; a store
    problem (the session is open elsewhere) returns 1; so does a last turn that failed.
    """
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if not _wants_terminal(settings, out):
        with logging_to(err, settings.log_level):
            return await _run_chat(settings, tools, out, err, history=None)
    from aimu._terminal import terminal_output

    with terminal_output() as (out, err), logging_to(err, settings.log_level):
        return await _run_chat(settings, tools, out, err, history=settings.history_path)


def _wants_terminal(settings: ChatSettings, out: TextIO) -> bool:
    """Line editing when a person types at a capable terminal and prompt_toolkit is there."""
    if settings.plain or os.environ.get("TERM") == "dumb":
        return False
    if not (out is sys.stdout and _is_tty(sys.stdin) and _is_tty(sys.stdout)):
        return False
    from aimu._terminal import available

    return available()


async def _run_chat(
    settings: ChatSettings,
    tools: Sequence[Callable[..., Any] | Tool] | None,
    out: TextIO,
    err: TextIO,
    *,
    history: Path | None,
) -> int:
    def fail(error: BaseException, status: int) -> int:
        err.write(f"error: {_error_line(error)}\n")
        err.flush()
        return status

    try:
        validate_session_name(settings.session)
        client = make_client(settings.model)
    except ValueError as error:
        return fail(error, 2)
    chosen = (tools if tools is not None else DEMO_TOOLS) if settings.tools else ()
    try:
        try:
            settings.home.mkdir(parents=True, exist_ok=True)
            store = SQLiteStore(settings.store_path)
        except (AimuError, OSError) as error:
            return fail(error, 1)
        try:
            try:
                assistant = Assistant(
                    client,
                    store,
                    session=settings.session,
                    system=settings.system,
                    tools=chosen,
                    out=out,
                    err=err,
                    prompt=history is None and _is_tty(sys.stdin) and _is_tty(out),
                    colour=history is not None,
                    join=settings.join,
                )
            except AimuError as error:
                return fail(error, 1)
            try:
                try:
                    await assistant.open()
                except AimuError as error:
                    return fail(error, 1)
                sigint = threading.current_thread() is threading.main_thread()
                return await assistant.serve(stdin=True, sigint=sigint, terminal=history)
            finally:
                await assistant.aclose()
        finally:
            await store.aclose()
    finally:
        await client.aclose()


def _is_tty(stream: object) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False
