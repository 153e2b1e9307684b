"""The chat's slash commands that read the session: ``/help``, ``/history``, ``/sessions``.

The commands that act on turns (``/stop``, ``/resume``, ``/approve``...) are the
assistant's own (:mod:`aimu.assistant.loop`); this module holds the help table, and
what the others print or check, so the loop stays about turns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from aimu.aio.store import Store
from aimu.aio.transcript import Message
from aimu.assistant.screen import Screen, describe

__all__ = ["HELP", "fresh_name", "nothing_to_resume", "show_help", "show_history", "show_sessions"]

HELP = (
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
_KEYS = (
    "Input typed while a turn runs is queued and answered in order (after /join it joins "
    "the running turn at its next step instead). Ctrl+C interrupts "
    "the running turn (press it again to stop it now) or exits when idle; Ctrl+D exits."
)


def show_help(screen: Screen) -> None:
    screen.line("commands:")
    width = max(len(command) for command, _ in HELP)
    for command, meaning in HELP:
        screen.line(f"  {command:<{width}} {meaning}")
    screen.line(_KEYS)


def show_history(screen: Screen, session: str, messages: Sequence[Message]) -> None:
    screen.line(f"session {session!r}: {len(messages)} messages")
    for index, message in enumerate(messages, 1):
        screen.line(f"{index:>3} {describe(message)}")


async def show_sessions(screen: Screen, store: Store, current: str) -> None:
    infos = await store.sessions()
    screen.line(f"{len(infos)} stored sessions (* is this one):")
    for info in infos:
        mark = "*" if info.name == current else " "
        updated = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.updated))
        status = info.status or "new"
        screen.line(
            f"{mark} {info.name}: {info.message_count} messages, {status}, updated {updated}"
        )


async def fresh_name(store: Store, current: str) -> str:
    """A session name no stored session has, from the time: ``chat-YYYYmmdd-HHMMSS``."""
    taken = {info.name for info in await store.sessions()}
    base = time.strftime("chat-%Y%m%d-%H%M%S")
    name, serial = base, 1
    while name in taken or name == current:
        serial += 1
        name = f"{base}-{serial}"
    return name


def nothing_to_resume(messages: Sequence[Message]) -> str | None:
    """Why ``/resume`` has nothing to continue in ``messages``, or None if it has."""
    if not any(m["role"] == "user" for m in messages):
        return "(nothing to resume: this session has no conversation yet)"
    last = messages[-1]
    if last["role"] == "assistant" and not (last.get("tool_calls") or last.get("aimu_partial")):
        return "(nothing to resume: the last turn finished; type your next message)"
    return None
