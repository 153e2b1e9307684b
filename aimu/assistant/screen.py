"""What the chat prints: whole lines, the reply as it streams, notes and errors.

:class:`Screen` writes to ``out`` (and ``err``) line-oriented and flushed. On a terminal
it escapes control characters (a model's or a tool's words cannot drive it) and, unless
told ``colour=False`` or ``NO_COLOR`` is set, colours notes, tool lines and errors. In
the editor's mode (:mod:`aimu._terminal`) the reply's line still streaming is held in
:attr:`Screen.partial_line` for the prompt to draw, and only whole lines go above it.
"""

from __future__ import annotations

import json
import os
import shutil
import unicodedata
from collections.abc import Mapping
from typing import Any, TextIO

from aimu.aio.events import (
    Event,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
    TurnRetried,
)
from aimu.aio.transcript import Message

__all__ = [
    "INTERRUPTED_MARK",
    "STOPPED",
    "Screen",
    "arguments_text",
    "describe",
    "is_tty",
    "one_line",
    "printable",
    "progress_text",
]

STOPPED = "(stopped)"
INTERRUPTED_MARK = "(interrupted)"

_CLIP = 200
# Control characters other than newline and tab, shown as escapes (ESC as \x1b).
_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F]}
_COLOURS = {"note": "\x1b[2m", "tool": "\x1b[36m", "error": "\x1b[31m"}


def is_tty(stream: object) -> bool:
    """Whether ``stream`` is a terminal (False for anything that cannot say)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):
        return False


def printable(text: str) -> str:
    """``text`` with control characters escaped, so showing it cannot drive a terminal."""
    return text.translate(_CONTROL)


def one_line(text: str, limit: int = _CLIP) -> str:
    """``text`` on one line, escaped, clipped to ``limit`` characters."""
    text = printable(" ".join(text.split()))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def progress_text(event: ToolProgress) -> str:
    """How far a tool said it is: ``1/3 reading sources``, or ``12`` with no total."""
    amount = f"{event.progress:g}/{event.total:g}" if event.total else f"{event.progress:g}"
    return f"{amount} {one_line(event.message, 60)}" if event.message else amount


def arguments_text(arguments: Mapping[str, Any]) -> str:
    """A call's arguments as ``key=value`` pairs, values in JSON."""
    return ", ".join(f"{key}={json.dumps(v, ensure_ascii=False)}" for key, v in arguments.items())


def describe(message: Message) -> str:
    """One line saying what ``message`` is (``/history``)."""
    role = message["role"]
    content = one_line(message["content"])
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


class Screen:
    """The chat's output on ``out`` and ``err``.

    ``editor``: the editor's mode (whole lines only; :attr:`partial_line` for the prompt).
    ``colour``: colour notes, tool lines and errors on a terminal (never when ``NO_COLOR``
    is set); plain mode passes False.
    """

    def __init__(self, out: TextIO, err: TextIO, *, editor: bool, colour: bool) -> None:
        self.out = out
        self.err = err
        self._editor = editor
        on_terminal = editor or is_tty(out)
        self._escape = on_terminal
        no_colour = bool(os.environ.get("NO_COLOR")) or not colour
        self._colour = on_terminal and not no_colour
        self._err_colour = (editor or is_tty(err)) and not no_colour
        self._partial = ""
        self.at_line_start = True
        self._prompting = False  # the "> " is the last thing printed
        self._thinking = False
        #: Who said the last event shown: its path and source (an agent tree's levels).
        self._who: tuple[str, ...] = ()
        #: The reply's text printed so far (since its turn began).
        self._reply = ""
        #: A restarted reply's text printed before the cut, not printed again as the new
        #: reply repeats it (see _restarted_text).
        self._printed = ""

    @property
    def partial_line(self) -> str:
        """In the editor's mode: the reply's line still streaming, not yet printed."""
        return self._partial

    def write(self, text: str) -> None:
        """``text`` as it comes (a reply streaming); flushed."""
        if not text:
            return
        self._prompting = False
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
                self.out.write(done)
                self.out.flush()
            self.at_line_start = not self._partial
            return
        self.out.write(text)
        self.out.flush()
        self.at_line_start = text.endswith("\n")

    def _label(self, event: Event) -> None:
        path = getattr(event, "path", ())
        who = (*path, getattr(event, "source", ""))
        if who != self._who and (path or len(self._who) > 1):
            self._thinking = False
            self._reply = self._printed = ""
            self.line(f"({' › '.join(one_line(name) for name in who)})", "note")
        self._who = who

    def line(self, text: str, kind: str = "") -> None:
        """``text`` on a line of its own, after the streamed text if a reply is mid-line.

        ``kind`` (``note``, ``tool``, ``error``) colours the line on a terminal.
        """
        kind = kind or ("note" if text.startswith("(") else "")  # (stopped), (bye)...
        if self._colour and kind:
            text = f"{_COLOURS[kind]}{text}\x1b[0m"
        self.write(("" if self.at_line_start else "\n") + text + "\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def to_err(self, text: str, kind: str) -> None:
        """``text`` as a line on ``err``, after the output so far (same terminal)."""
        self.end_line()
        if self.err is self.out:
            self.line(text, kind)
            return
        if self._err_colour:
            text = f"{_COLOURS[kind]}{text}\x1b[0m"
        self.err.write(f"{text}\n")
        self.err.flush()

    def error(self, text: str) -> None:
        """One ``error: text`` line on ``err``, after the output so far (same terminal);
        its control characters escaped (a server's words may carry them)."""
        self.to_err(f"error: {printable(text)}", "error")

    def _restarted_text(self, text: str) -> str:
        """What to print of ``text``, a restarted reply's next words: nothing while it
        repeats the words printed before the cut; past them, the rest. A reply that
        says something else there is printed whole after a note."""
        printed, said = self._printed, self._reply + text
        if printed.startswith(said):
            return ""
        if said.startswith(printed):
            self._printed = ""
            return said[len(printed):]
        self._printed = ""
        self.line("(the reply broke off and was asked again; it now says:)", "note")
        return said

    def prompt(self) -> None:
        """The plain mode's ``> `` prompt."""
        self._reply = self._printed = ""
        self.out.write("> ")
        self.out.flush()
        # The user's Enter (echoed by the terminal) ends the prompt's line.
        self.at_line_start = True
        self._prompting = True

    def input_ended(self) -> None:
        """The input ended (Ctrl+D) at the prompt: the terminal echoed no Enter, so end
        the prompt's line here, or the shell's prompt would follow on it."""
        if self._prompting:
            self.write("\n")

    def show(self, event: Event) -> None:
        """A streamed event of a turn: thinking, reply text, a tool call or its result.
        In an agent tree, a line names the agent whenever another one goes on."""
        self._label(event)
        if isinstance(event, ThinkingChunk):
            # Thinking can take a while before any text: say so once, not word by word.
            if not self._thinking:
                self.line("(thinking…)", "note")
                self._thinking = True
            return
        self._thinking = False
        if isinstance(event, TextChunk):
            text = self._restarted_text(event.text) if self._printed else event.text
            self._reply += event.text
            # On a terminal a model's escape sequences would act on it: show them instead.
            self.write(printable(text) if self._escape else text)
            return
        if isinstance(event, TurnRetried):
            # The stream broke and the turn was asked again. Continued: the text goes on.
            # Restarted: what was printed stays on the screen, so the new reply prints
            # only from where it goes past (or away from) it, never the same words twice.
            if event.mode == "restarted":
                self._printed += self._reply[len(self._printed):]
                self._reply = ""
            return
        self._reply = self._printed = ""
        if isinstance(event, ToolCallStarted):
            name = one_line(event.name)  # the model named it: maybe no tool of ours
            self.line(f"[calling {name}({one_line(arguments_text(event.arguments))})]", "tool")
        elif isinstance(event, ToolResult):
            verb = "failed" if event.is_error else "→"
            self.line(f"[{one_line(event.name)} {verb} {one_line(event.content)}]", "tool")
