"""MCPServer: an MCP server's tools, offered to an agent beside plain functions.

``MCPServer.stdio(...)`` starts a server as a child process (tied to this process's
life: it never outlives it, even after ``kill -9``); ``MCPServer.http(url)`` talks
Streamable HTTP. Either is a :class:`~aimu.aio.tools.Toolset`: give it in an agent's
``tools=[...]``. Its tools keep the server's JSON schemas; annotations become policies
with the MCP specification's defaults: a tool is destructive (asks for approval) and not
idempotent unless its annotations say otherwise (``readOnlyHint: true``, or
``destructiveHint: false``; ``idempotentHint: true`` lets a call in doubt run again);
``approval=`` on the server decides for all its tools instead. A result over
``max_result`` bytes is cut with a marker. A cancelled call is cancelled on the server
(the SDK 2.x sends ``notifications/cancelled``, or aborts the HTTP request) and the
connection stays usable; a server that crashes mid-call gives the model a tool error
and is restarted at the next call.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import fnmatch
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Final
from urllib.parse import urlsplit

from mcp import MCPError, StdioServerParameters, types
from mcp.client._transport import Transport, TransportStreams
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp_types import CONNECTION_CLOSED
from pydantic import ValidationError

from aimu.aio._echo import echo
from aimu.aio._numbers import finite
from aimu.aio.errors import MCPServerError, ToolDefinitionError
from aimu.aio.mcp._connection import Connection, describe, first_error
from aimu.aio.tools import DEFAULT_MAX_RESULT, Tool, ToolContext, ToolOutcome

__all__ = ["MCPServer"]

#: Seconds a server may take to start and list its tools (``npx`` may fetch a package).
DEFAULT_TIMEOUT: Final = 30.0
_LAUNCHER: Final = str(Path(__file__).with_name("_launcher.py"))
_NOT_A_NAME = re.compile(r"[^A-Za-z0-9_-]+")
# Launchers whose first argument, not their own name, says which server it is.
_RUNNERS: Final = frozenset(
    {"npx", "uvx", "uv", "pipx", "bunx", "bun", "deno", "node", "python", "python3", "docker"}
)
_STDERR_TAIL: Final = 2000


class MCPServer:
    """One MCP server's tools for an agent; build it with :meth:`stdio` or :meth:`http`.

    Opened by the first run that needs it (or ``async with``/:meth:`open`), it stays
    connected until :meth:`aclose`; an agent closes a server it opened itself in
    ``agent.aclose()``. Start-up is bounded by ``timeout`` and fails with
    :class:`~aimu.aio.MCPServerError` naming the server.
    """

    def __init__(
        self,
        *,
        name: str,
        where: str,
        transport: _TransportFactory,
        tools: Sequence[str] | str | None,
        timeout: float | None,
        tool_timeout: float | None,
        approval: bool | None = None,
        max_result: int | None = DEFAULT_MAX_RESULT,
    ) -> None:
        self._name = name
        self._where = where
        self._transport = transport
        self._filters = _check_filters(name, tools)
        self._timeout = _check_seconds(name, "timeout", timeout, DEFAULT_TIMEOUT)
        self._tool_timeout = (
            None if tool_timeout is None
            else _check_seconds(name, "tool_timeout", tool_timeout, None)
        )
        if approval is not None and not isinstance(approval, bool):
            raise ValueError(
                f"MCP server {name!r}: approval= must be True, False or None, got {approval!r}"
            )
        self._approval = approval
        if max_result is not None and (
            isinstance(max_result, bool) or not isinstance(max_result, int) or max_result <= 0
        ):
            raise ValueError(
                f"MCP server {name!r}: max_result must be a positive number of bytes or "
                f"None, got {max_result!r}"
            )
        self._max_result = max_result
        self._connection: Connection | None = None
        self._tools: list[Tool] = []
        self._lock: asyncio.Lock | None = None

    # -- construction ------------------------------------------------------------

    @classmethod
    def stdio(
        cls,
        command: str,
        args: Sequence[str] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        name: str | None = None,
        tools: Sequence[str] | str | None = None,
        timeout: float | None = None,
        tool_timeout: float | None = None,
        approval: bool | None = None,
        max_result: int | None = DEFAULT_MAX_RESULT,
    ) -> MCPServer:
        """A server started as ``command args`` speaking MCP on its stdin and stdout.

        ``env`` is added to a minimal environment (PATH, HOME...); ``name`` defaults to
        the command's (or, for ``npx``/``uvx``..., its package's) name; ``tools``
        keeps the tools whose names match one of these names or globs; ``timeout``
        bounds start-up (default 30 s), ``tool_timeout`` each call (default none).
        ``approval``: None follows each tool's annotations (MCP's defaults: no
        annotations asks); False trusts the server (none of its tools asks); True makes
        every tool ask. ``max_result``: bytes of a result kept (default 1 MB), the rest
        cut with a marker saying how much was dropped; None keeps results whole.
        """
        if not isinstance(command, str) or not command.strip():
            raise ValueError(
                f"MCPServer.stdio: command must be a non-empty string, got {command!r}"
            )
        if isinstance(args, str) or not all(isinstance(a, str) for a in args):
            raise TypeError("MCPServer.stdio: args must be a list of strings")
        server_name = _check_name(name if name is not None else _default_name(command, args))
        parameters = StdioServerParameters(
            command=command,
            args=list(args),
            env=dict(env) if env is not None else None,
            cwd=None if cwd is None else os.fspath(cwd),
        )
        shown = " ".join([command, *args])
        return cls(
            name=server_name,
            where=f"`{shown[:200]}`",
            transport=_Stdio(server_name, parameters),
            tools=tools,
            timeout=timeout,
            tool_timeout=tool_timeout,
            approval=approval,
            max_result=max_result,
        )

    @classmethod
    def http(
        cls,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        name: str | None = None,
        tools: Sequence[str] | str | None = None,
        timeout: float | None = None,
        tool_timeout: float | None = None,
        approval: bool | None = None,
        max_result: int | None = DEFAULT_MAX_RESULT,
    ) -> MCPServer:
        """A server at ``url`` speaking MCP over Streamable HTTP.

        ``headers`` go with every request (an ``Authorization``: never shown in an
        error or a log); ``name`` defaults to the URL's host; the rest as :meth:`stdio`.
        """
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"MCPServer.http: url must be an http:// or https:// URL, got {url!r}")
        server_name = _check_name(
            name if name is not None else _NOT_A_NAME.sub("_", parts.hostname.replace(".", "_"))
        )
        # Shown without user:password or the query, which may carry a token.
        port = f":{parts.port}" if parts.port else ""
        shown = f"{parts.scheme}://{parts.hostname}{port}{parts.path}"
        return cls(
            name=server_name,
            where=shown,
            transport=_Http(url, dict(headers or {})),
            tools=tools,
            timeout=timeout,
            tool_timeout=tool_timeout,
            approval=approval,
            max_result=max_result,
        )

    def renamed(self, name: str) -> MCPServer:
        """The same server (not opened) under another ``name``."""
        return MCPServer(
            name=_check_name(name),
            where=self._where,
            transport=self._transport.copy(),
            tools=self._filters,
            timeout=self._timeout,
            tool_timeout=self._tool_timeout,
            approval=self._approval,
            max_result=self._max_result,
        )

    # -- the Toolset protocol -------------------------------------------------------

    @property
    def name(self) -> str:
        """The server's name in errors, and the prefix of its tools' names on a clash."""
        return self._name

    @property
    def is_open(self) -> bool:
        connection = self._connection
        return connection is not None and not connection.lost

    async def open(self) -> None:
        """Start or reach the server and list its tools (again, if the connection was
        lost); :class:`~aimu.aio.MCPServerError` naming it if that fails or takes longer
        than ``timeout``. Does nothing while open."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self.is_open:
                return
            await self._close_connection()
            connection = Connection()
            problem: str | None
            try:
                async with asyncio.timeout(self._timeout):
                    await connection.open(self._transport.make, self._name)
            except TimeoutError:
                problem = (
                    f"did not start and list its tools within {self._timeout:g} s "
                    "(raise timeout= if it is slow to start)"
                )
            except MCPServerError:
                self._transport.closed()
                raise
            except Exception as error:
                problem = self._start_failure(error)
            except BaseException:
                self._transport.closed()
                raise
            else:
                problem = None
            if problem is not None:
                self._transport.closed()
                del connection  # its failure's traceback holds sockets and pipes
                raise self._error(problem)
            try:
                tools = self._filtered(connection.tools)
            except BaseException:
                await connection.aclose()
                self._transport.closed()
                raise
            self._connection, self._tools = connection, tools

    async def list_tools(self) -> list[Tool]:
        """The server's tools (as filtered by ``tools=``), opening it first if need be."""
        if not self.is_open:
            await self.open()
        return self._tools

    async def aclose(self) -> None:
        """Close the connection; a stdio server is stopped and reaped (shielded from a
        cancel of the caller). Idempotent; :meth:`open` may connect again."""
        await self._close_connection()

    async def __aenter__(self) -> MCPServer:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        state = "open" if self.is_open else "closed"
        return f"<MCPServer {self._name!r} {self._where} {state}>"

    # -- internals -----------------------------------------------------------------

    async def _close_connection(self) -> None:
        connection, self._connection = self._connection, None
        try:
            if connection is not None:
                await connection.aclose()
        finally:
            self._transport.closed()

    def _error(self, problem: str) -> MCPServerError:
        message = f"MCP server {self._name!r} ({self._where}) {problem}"
        return MCPServerError(message, server=self._name)

    def _start_failure(self, error: BaseException) -> str:
        error = first_error(error)
        said = self._transport.stderr_tail()
        tail = f"; it wrote: {said}" if said else ""
        if isinstance(error, MCPError) and error.code == CONNECTION_CLOSED:
            return f"exited or closed the connection during start-up{tail}"
        if isinstance(error, MCPError):
            return f"answered its start-up requests with an error: {error.error.message}{tail}"
        unreadable = _unreadable(error)
        if unreadable is not None:
            return f"sent a message that cannot be read: {unreadable}{tail}"
        if isinstance(error, ValidationError):  # the SDK checks the tool list's shape
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors()[:3]
            )
            return (
                f"sent a tool list that is not valid MCP (a tool's inputSchema must be a "
                f"JSON schema of type 'object'): {problems}"
            )
        return f"could not be started or reached: {describe(error)}{tail}"

    def _filtered(self, listed: Sequence[types.Tool]) -> list[Tool]:
        """The tools ``tools=`` keeps, made into aimu tools; an exact name that the
        server does not have is an error (a typo would silently offer nothing)."""
        if self._filters is not None:
            names = {t.name for t in listed}
            missing = [f for f in self._filters if not _is_glob(f) and f not in names]
            if missing:
                have = ", ".join(sorted(names)) or "none"
                raise self._error(f"has no tool {', '.join(map(repr, missing))}; it has: {have}")
            filters = self._filters
            listed = [t for t in listed if any(fnmatch.fnmatchcase(t.name, f) for f in filters)]
        made: list[Tool] = []
        seen: dict[str, str] = {}
        for listed_tool in listed:
            tool = self._tool(listed_tool)
            if tool.name in seen:
                raise self._error(
                    f"has tools {seen[tool.name]!r} and {listed_tool.name!r}, which both become "
                    f"{tool.name!r} for a model; keep one with tools="
                )
            seen[tool.name] = listed_tool.name
            made.append(tool)
        return made

    def _tool(self, listed: types.Tool) -> Tool:
        approval, idempotent = policies(listed.annotations)
        if self._approval is not None:
            approval = self._approval
        name = _NOT_A_NAME.sub("_", listed.name)[:64] or "tool"
        call = _ToolCall(self, listed.name)
        try:
            return Tool.from_schema(
                name,
                listed.description or listed.title or "",
                listed.input_schema,
                call,
                timeout=self._tool_timeout,
                approval=approval,
                idempotent=idempotent,
                max_result=self._max_result,
            )
        except ToolDefinitionError as error:
            raise self._error(f"offers a tool aimu cannot use: {error}") from None

    async def _call(
        self, tool: str, arguments: dict[str, Any], ctx: ToolContext
    ) -> str | ToolOutcome:
        """Call ``tool`` on the server; a failure is an error outcome, a cancel is sent on."""
        if not self.is_open:
            try:
                await self.open()
            except MCPServerError as error:
                return ToolOutcome(str(error), True)
        connection = self._connection
        assert connection is not None

        async def progress(progress: float, total: float | None, message: str | None) -> None:
            ctx.report_progress(progress, total, message)

        try:
            result = await connection.session.call_tool(tool, arguments, progress_callback=progress)
        except MCPError as error:
            if error.code == CONNECTION_CLOSED:
                connection.lost = True
                return ToolOutcome(
                    f"MCP server {self._name!r} closed the connection during the call to "
                    f"{tool!r} (it may have crashed); it is restarted for the next call", True
                )
            return ToolOutcome(f"MCP server {self._name!r}: tool {tool!r} failed: {error}", True)
        except (OSError, EOFError) as error:
            connection.lost = True
            return ToolOutcome(
                f"MCP server {self._name!r}: the call to {tool!r} failed: {describe(error)}", True
            )
        return _outcome(result)


class _ToolCall:
    """What an MCP tool's :class:`~aimu.aio.tools.Tool` calls: one tool of one server."""

    __slots__ = ("server", "tool")

    def __init__(self, server: MCPServer, tool: str) -> None:
        self.server, self.tool = server, tool

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> str | ToolOutcome:
        return await self.server._call(self.tool, arguments, ctx)


class _TransportFactory(abc.ABC):
    """Makes a fresh transport for each connection (a reconnect starts a new one)."""

    @abc.abstractmethod
    def make(self) -> Transport:
        """A new transport to the server."""

    @abc.abstractmethod
    def copy(self) -> _TransportFactory:
        """The same server's factory, for another MCPServer (its own connection)."""

    def stderr_tail(self) -> str:
        return ""

    def closed(self) -> None:  # noqa: B027 (optional hook: most transports keep nothing)
        """The connection ended: release what the last transport kept."""


class _Stdio(_TransportFactory):
    """A stdio server, started through the launcher that ties it to this process."""

    def __init__(self, name: str, parameters: StdioServerParameters) -> None:
        self._name = name
        self._parameters = parameters
        self._stderr: IO[str] | None = None

    def copy(self) -> _Stdio:
        return _Stdio(self._name, self._parameters)

    def make(self) -> Transport:
        parameters = self._parameters
        path = (parameters.env or {}).get("PATH", os.environ.get("PATH"))
        command = parameters.command
        found = shutil.which(command, path=path) if not os.path.dirname(command) else command
        if found is None or not os.path.exists(found):
            raise MCPServerError(
                f"MCP server {self._name!r}: command {command!r} not found (not on PATH, "
                "nor a file); install it or give its full path",
                server=self._name,
            )
        self.closed()
        # The server's stderr is kept (not mixed into a terminal chat); its tail goes
        # into a start-up error.
        self._stderr = tempfile.TemporaryFile(  # noqa: SIM115 - closed by closed()
            "w+", encoding="utf-8", errors="replace"
        )
        if sys.platform != "win32":
            parameters = parameters.model_copy(
                update={
                    "command": sys.executable,
                    "args": ["-I", _LAUNCHER, str(os.getpid()), found, *parameters.args],
                }
            )
        return stdio_client(parameters, errlog=self._stderr)

    def stderr_tail(self) -> str:
        log = self._stderr
        if log is None:
            return ""
        try:
            log.flush()
            log.seek(0, os.SEEK_END)
            size = log.tell()
            log.seek(max(0, size - _STDERR_TAIL))
            return " ".join(log.read().split())[-_STDERR_TAIL:]
        except (OSError, ValueError):
            return ""

    def closed(self) -> None:
        log, self._stderr = self._stderr, None
        if log is not None:
            log.close()


class _Http(_TransportFactory):
    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self._url = url
        self._headers = headers

    def copy(self) -> _Http:
        return _Http(self._url, self._headers)

    def make(self) -> Transport:
        return _http_transport(self._url, self._headers)


@contextlib.asynccontextmanager
async def _http_transport(url: str, headers: dict[str, str]) -> AsyncIterator[TransportStreams]:
    """Streamable HTTP on an HTTP client of its own, closed with it (the SDK leaves a
    client it was given open)."""
    async with (
        create_mcp_http_client(headers=headers or None) as client,
        streamable_http_client(url, http_client=client) as streams,
    ):
        yield streams


def policies(annotations: types.ToolAnnotations | None) -> tuple[bool, bool]:
    """(asks for approval, idempotent) as the MCP specification's defaults read a tool's
    annotations: ``readOnlyHint`` false, ``destructiveHint`` true, ``idempotentHint``
    false when unset. A read-only tool changes nothing: it never asks and may run again;
    otherwise it asks unless ``destructiveHint`` is false, and is idempotent only when
    ``idempotentHint`` is true. (Hints from a server you do not trust are only hints:
    ``approval=True`` on the server makes every tool ask.)"""
    if annotations is not None and annotations.read_only_hint is True:
        return False, True
    destructive = annotations is None or annotations.destructive_hint is not False
    idempotent = annotations is not None and annotations.idempotent_hint is True
    return destructive, idempotent


def _outcome(result: types.CallToolResult) -> ToolOutcome:
    """A tool result as the text the model reads: text blocks as they are; an image, a
    sound or a binary resource as a line naming it and its size (its base64 is no text
    for a model or a person to read); other blocks and structured content as JSON."""
    parts: list[str] = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.ImageContent | types.AudioContent):
            parts.append(f"[{block.type}: {block.mime_type}, {_decoded_size(block.data)}]")
        elif isinstance(block, types.EmbeddedResource) and isinstance(
            block.resource, types.BlobResourceContents
        ):
            kind = block.resource.mime_type or "binary"
            size = _decoded_size(block.resource.blob)
            parts.append(f"[resource {block.resource.uri}: {kind}, {size}]")
        else:
            parts.append(json.dumps(block.model_dump(mode="json", exclude_none=True)))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return ToolOutcome("\n".join(parts), bool(result.is_error))


def _unreadable(error: BaseException) -> str | None:
    """What makes a message from the server unreadable (its JSON), or None."""
    if not isinstance(error, ValidationError):
        return None
    for problem in error.errors():
        if problem["type"] != "json_invalid":
            continue
        said = str(problem.get("ctx", {}).get("error", problem["msg"]))
        if "recursion" in said:
            return (
                "it nests deeper than a JSON parser allows (a tool's inputSchema is nested "
                "too deeply to list its tools)"
            )
        return f"it is not valid JSON ({said})"
    return None


def _decoded_size(data: str) -> str:
    """The size of base64 ``data`` once decoded, for a person ("1,234 bytes")."""
    size = len(data.rstrip("=")) * 3 // 4
    return f"{size:,} byte{'' if size == 1 else 's'}"


def _default_name(command: str, args: Sequence[str]) -> str:
    base = os.path.basename(command)
    if base in _RUNNERS or base.startswith("python"):
        for arg in args:
            if not arg.startswith("-") and arg not in ("run", "exec", "-m"):
                base = arg.rsplit("/", 1)[-1].split("@", 1)[0] or arg
                break
    base = re.sub(r"\.(py|js|mjs|ts)$", "", base)
    return _NOT_A_NAME.sub("_", base).strip("_")[:40] or "mcp"


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name):
        raise ValueError(
            f"MCPServer name must be 1-40 letters, digits, '_' or '-' (it prefixes tool "
            f"names on a clash), got {name!r}"
        )
    return name


def _check_filters(server: str, tools: Sequence[str] | str | None) -> tuple[str, ...] | None:
    if tools is None:
        return None
    filters = (tools,) if isinstance(tools, str) else tuple(tools)
    if not filters or not all(isinstance(f, str) and f for f in filters):
        raise ValueError(
            f"MCP server {server!r}: tools= must be tool names or globs (like 'read_*'), "
            f"got {tools!r}"
        )
    return filters


def _check_seconds(server: str, what: str, value: object, default: float | None) -> float:
    if value is None and default is not None:
        return default
    if not finite(value) or value <= 0:
        raise ValueError(
            f"MCP server {server!r}: {what} must be a positive number of seconds, "
            f"got {echo(value)}"
        )
    return float(value)


def _is_glob(pattern: str) -> bool:
    return any(c in pattern for c in "*?[")
