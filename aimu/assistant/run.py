"""``aimu chat``: the assistant on stdin and stdout, with line editing where it can.

:func:`run_chat` opens the model client and the session store that ``settings`` name,
runs an :class:`~aimu.assistant.loop.Assistant` on them until EOF or Ctrl+C, and closes
them; on a terminal with the ``chat`` extra it reads lines with the editor
(:mod:`aimu._terminal`), else plainly, saying once which extra would edit lines.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from aimu._extras import has_extra, missing_extra
from aimu._logs import logging_to
from aimu._mcp_options import loaded, mcp_servers, open_all
from aimu.aio.client import ModelClient
from aimu.aio.errors import AimuError
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.store import SQLiteStore, validate_session_name
from aimu.aio.tools import Tool, Toolset
from aimu.assistant.client import error_line, make_client
from aimu.assistant.loop import Assistant
from aimu.assistant.screen import is_tty
from aimu.assistant.settings import ChatSettings
from aimu.assistant.tools import DEMO_TOOLS

__all__ = ["run_chat"]


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
            if _could_edit(settings, out) and not has_extra("chat"):
                # A person at a terminal gets the plain mode: say once what would edit lines.
                err.write(f"({missing_extra('line editing', 'chat')})\n")
            return await _run_chat(settings, tools, out, err, history=None)
    from aimu._terminal import terminal_output

    with terminal_output() as (out, err), logging_to(err, settings.log_level):
        return await _run_chat(settings, tools, out, err, history=settings.history_path)


def _could_edit(settings: ChatSettings, out: TextIO) -> bool:
    """A person types at a capable terminal and did not ask for the plain mode."""
    if settings.plain or os.environ.get("TERM") == "dumb":
        return False
    return out is sys.stdout and is_tty(sys.stdin) and is_tty(sys.stdout)


def _wants_terminal(settings: ChatSettings, out: TextIO) -> bool:
    """Line editing where a person could edit lines and the ``chat`` extra is installed."""
    return _could_edit(settings, out) and has_extra("chat")


async def _run_chat(
    settings: ChatSettings,
    tools: Sequence[Callable[..., Any] | Tool] | None,
    out: TextIO,
    err: TextIO,
    *,
    history: Path | None,
) -> int:
    try:
        validate_session_name(settings.session)
        servers = mcp_servers(settings.mcp, settings.mcp_urls)
        client = make_client(settings.model)
    except ValueError as error:
        return _failed(err, error, 2)
    chosen: list[Callable[..., Any] | Tool | Toolset] = [
        *((tools if tools is not None else DEMO_TOOLS) if settings.tools else ()), *servers
    ]
    try:
        if isinstance(client, OllamaClient):
            status = await _offer_pull(client, out, err)
            if status is not None:
                return status
        try:
            await open_all(servers)  # one clear error now for a server that cannot start
            for line in await loaded(servers):
                out.write(f"({line})\n")
            settings.home.mkdir(parents=True, exist_ok=True)
            store = SQLiteStore(settings.store_path)
        except (AimuError, OSError) as error:
            return _failed(err, error, 1)
        try:
            return await _chat(client, store, chosen, settings, out, err, history)
        finally:
            await store.aclose()
    finally:
        try:
            for server in servers:
                await server.aclose()
        finally:
            await client.aclose()


async def _chat(
    client: ModelClient,
    store: SQLiteStore,
    tools: list[Callable[..., Any] | Tool | Toolset],
    settings: ChatSettings,
    out: TextIO,
    err: TextIO,
    history: Path | None,
) -> int:
    """The assistant on ``store``, serving stdin until it ends; the exit status."""
    try:
        assistant = Assistant(
            client,
            store,
            session=settings.session,
            system=settings.system,
            tools=tools,
            out=out,
            err=err,
            prompt=history is None and is_tty(sys.stdin) and is_tty(out),
            colour=history is not None,
            join=settings.join,
            plain=settings.plain,
            limits=settings.limits,
        )
    except AimuError as error:
        return _failed(err, error, 1)
    try:
        try:
            await assistant.open()
        except AimuError as error:
            return _failed(err, error, 1)
        sigint = threading.current_thread() is threading.main_thread()
        return await assistant.serve(stdin=True, sigint=sigint, terminal=history)
    finally:
        await assistant.aclose()


def _failed(err: TextIO, error: BaseException, status: int) -> int:
    """Say ``error`` in one line on ``err``; ``status``."""
    err.write(f"error: {error_line(error)}\n")
    err.flush()
    return status


async def _offer_pull(client: OllamaClient, out: TextIO, err: TextIO) -> int | None:
    """When the Ollama server lacks the chat's model: on a terminal, offer to pull it
    (None once pulled: the chat goes on); else one line naming the command, and 1."""
    from aimu.ollama_models import Lines, ModelsError, is_missing, pull  # the ollama package

    model, host = client.model, client.host
    if not await is_missing(model, client.url):
        return None
    command = f"aimu pull {model}"
    where = f"the model {model!r} is not on the Ollama server at {host}"
    if not (is_tty(sys.stdin) and is_tty(out)):
        err.write(f"error: {where}; fetch it with: {command}\n")
        return 1
    out.write(f"{where[0].upper()}{where[1:]}. Pull it now? [Y/n] ")
    out.flush()
    answer = await asyncio.to_thread(sys.stdin.readline)
    if answer.strip().lower() not in ("", "y", "yes"):
        err.write(f"not pulled; {command} fetches it\n")
        return 1
    try:
        await pull(model, client.url, Lines(out))
    except ModelsError as error:
        err.write(f"error: {error}\n")
        return 1
    out.write(f"pulled {model}\n")
    out.flush()
    return None
