"""``aimu chat`` on a terminal: line editing, history and a spinner (extra ``aimu-agents[chat]``).

prompt_toolkit keeps the input line at the bottom while replies stream above it
(``patch_stdout``; the line still streaming is drawn by the prompt itself, since a
partial line printed above a live prompt would be overwritten), recalls earlier lines
(Up, Ctrl+R) from a history file under ``AIMU_HOME``, and shows a spinner in the
bottom bar while a turn waits for the model or a tool. In raw mode Ctrl+C is a key, not
a signal: it reaches the same :meth:`~aimu.assistant.Assistant.press_ctrl_c` as the
signal does in plain mode, and leaves the line being typed as it is.
rich is not used: its live display redraws the screen and fights prompt_toolkit's own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, TextIO

__all__ = ["ChatInput", "read_lines", "terminal_output"]

_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
_IDLE = " Enter sends · /help lists the commands · Ctrl+C interrupts a turn · Ctrl+D exits"


class ChatInput(Protocol):
    """What the editor needs of the chat (:class:`aimu.assistant.Assistant` is one)."""

    @property
    def waiting(self) -> str | None:
        """What the running turn waits for, for the spinner; None when idle."""

    @property
    def partial_line(self) -> str:
        """The reply's line still streaming, drawn above the input line."""

    def submit(self, line: str) -> None: ...

    def press_ctrl_c(self) -> None: ...

    def end_input(self) -> None: ...


@contextlib.contextmanager
def terminal_output() -> Iterator[tuple[TextIO, TextIO]]:
    """stdout and stderr that print above the input line while it is shown."""
    from prompt_toolkit.patch_stdout import patch_stdout

    with patch_stdout(raw=True):  # raw: our colour codes pass through as written
        yield sys.stdout, sys.stderr


def _private_file(path: Path) -> Path:
    """``path``, created empty and readable by the user only if it does not exist."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
    return path


async def read_lines(assistant: ChatInput, history: Path) -> None:
    """Prompt for lines until Ctrl+D, handing each to ``assistant``; Ctrl+C presses too."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory
    from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

    keys = KeyBindings()

    @keys.add("c-c")
    def _(event: KeyPressEvent) -> None:
        assistant.press_ctrl_c()  # a press, as in plain mode; the typed line stays

    def toolbar() -> str:
        waiting = assistant.waiting
        if waiting is None:
            return _IDLE
        frame = _FRAMES[int(time.monotonic() * 10) % len(_FRAMES)]
        return f" {frame} {waiting}…  (Ctrl+C interrupts, twice stops)"

    session: PromptSession[str] = PromptSession(
        history=FileHistory(str(_private_file(history))),
        bottom_toolbar=toolbar,
        refresh_interval=0.1,
        key_bindings=keys,
    )
    def prompt() -> str:
        partial = assistant.partial_line
        # The last drawing, as a line is accepted, stays on the screen: without the
        # partial line, which the chat prints once it is whole (or the turn stops).
        if partial and not session.app.is_done:
            return f"{partial}\n> "
        return "> "

    while True:
        try:
            # Leave SIGINT to the chat's own handler: a ^C typed while the editor is
            # briefly out of raw mode (printing above it) arrives as the signal.
            line = await session.prompt_async(prompt, handle_sigint=False)
        except EOFError:
            assistant.end_input()
            return
        assistant.submit(line)
