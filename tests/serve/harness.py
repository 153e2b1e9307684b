"""A real Uvicorn on a random port serving aimu.serve.app, with the loopback model server.

The model is the loopback server's OpenAI-compatible endpoint, so a stopped run shows
up where it matters: the model server records the stream abandoned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from aimu import aio
from aimu.aio._sse import SSEParser
from aimu.serve import ServeApp, app
from aimu.serve.slow_clients import DeadlineH11Protocol
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
#: Where browser tests save a screenshot when they fail.
ARTIFACTS = Path(os.environ.get("AIMU_TEST_ARTIFACTS") or ROOT / "test-artifacts")
#: Milliseconds a browser test waits for the page: a loaded machine, not a slow page.
WAIT_MS = 20_000

LONG = " ".join(f"w{i}" for i in range(400))
#: Seconds between the chunks of a "long" reply: it streams for about 8 s unless stopped.
LONG_DELAY = 0.02


#: ``flaky ...``: the words of its reply, and the tasks whose first reply was cut already.
FLAKY = " ".join(f"f{i}" for i in range(200))
_FLAKY: set[str] = set()


def last_user(request: Mapping[str, Any]) -> str:
    for message in reversed(request.get("messages") or []):
        if message.get("role") == "user":
            return str(message.get("content") or "")
    return ""


def script(request: Mapping[str, Any]) -> Turn:
    """``long ...``: a slow reply; ``tool ...``: a slow turn calling lookup, then an answer;
    ``mail ...``: a call of send_email (needs approval), then its result read back;
    ``mails ...``: two calls of send_email in one turn, then their results read back;
    ``mailto NAME``: a call of send_email to NAME, always under the call id ``call-mailto``;
    ``short N``: N quick chunks; ``gate N W``: N rounds calling gated_lookup, then W words;
    ``wire W``: a call of gated_wire (needs approval), then W words; ``locate``: a call of
    the client-side tool ``locate``, then its result read back; ``remember NOTE``: a call
    of remember (the shared state), then its result read back; ``cut``: a reply the
    length limit cut off; ``flaky ...``: a reply whose connection is cut mid-way the first
    time (the client asks again); anything else:
    "answer to <it>"."""
    said = last_user(request)
    messages = request.get("messages") or []
    after_tool = bool(messages) and messages[-1].get("role") == "tool"
    if said.startswith(("gate ", "wire ")):
        return gated_turn(said, messages)
    if said.startswith("long"):
        return Turn(text=LONG, delay=LONG_DELAY)
    if said.startswith("tool") and not after_tool:
        return Turn(
            text="let me look that up " * 10,
            tool_calls=(ScriptedCall("lookup", {"query": said}),),
            delay=LONG_DELAY,
        )
    if said.startswith("mails"):
        if after_tool:
            results = [m.get("content") for m in messages if m.get("role") == "tool"]
            return Turn(text=f"mail results: {results}")
        return Turn(tool_calls=(ScriptedCall("send_email", {"to": f"{said} 1"}),
                                ScriptedCall("send_email", {"to": f"{said} 2"})))
    if said.startswith("mailto ") and not after_tool:
        return Turn(tool_calls=(ScriptedCall("send_email", {"to": said[7:]}, "call-mailto"),))
    if said.startswith("mail"):
        if after_tool:
            return Turn(text=f"mail result: {messages[-1].get('content')}")
        return Turn(tool_calls=(ScriptedCall("send_email", {"to": said}),))
    if said.startswith("remember "):
        if after_tool:
            return Turn(text=f"noted; {messages[-1].get('content')}")
        return Turn(tool_calls=(ScriptedCall("remember", {"note": said[9:]}),))
    if said.startswith("locate"):
        return locate_turn(said, request, after_tool)
    if said.startswith("cut"):
        return Turn(text="cut off in the mid", stop_reason="length")
    if said.startswith("flaky"):  # the connection cut mid-reply the first time asked
        first = said not in _FLAKY
        _FLAKY.add(said)
        return Turn(text=FLAKY, delay=LONG_DELAY, fault="cut" if first else None, fault_after=12)
    if said.startswith("short"):
        count = int(said.split()[1])
        return Turn(text=" ".join(f"c{i}" for i in range(count)), delay=0.005)
    return Turn(text=f"answer to {said}")


def locate_turn(said: str, request: Mapping[str, Any], after_tool: bool) -> Turn:
    """``locate [long|slowly]``: a call of the page's tool ``locate`` (if it was offered;
    after a slow text with ``long``), then where (slowly: a long slow text)."""
    if after_tool:
        where = f"you are in {request['messages'][-1].get('content')}"
        if said.endswith("slowly"):
            return Turn(text=f"{where} {LONG}", delay=LONG_DELAY)
        return Turn(text=where)
    offered = [tool.get("function", {}).get("name") for tool in request.get("tools") or []]
    if "locate" not in offered:
        return Turn(text=f"no locate tool among {offered}")
    long = said.endswith("long")
    return Turn(text=LONG if long else "let me see", delay=LONG_DELAY if long else 0.0,
                tool_calls=(ScriptedCall("locate", {"precise": True}),))


def gated_turn(said: str, messages: list[dict[str, Any]]) -> Turn:
    """The turns of ``gate N W`` and ``wire W`` (see :func:`script`)."""
    words = said.split()
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    results = sum(1 for m in messages[users[-1]:] if m.get("role") == "tool") if users else 0
    if words[0] == "gate":
        rounds, length, tool = int(words[1]), int(words[2]), "gated_lookup"
    else:
        rounds, length, tool = 1, int(words[1]), "gated_wire"
    if results < rounds:
        return Turn(text="calling ", tool_calls=(ScriptedCall(tool, {"query": said}),))
    delay = 0.0 if GATE.hurry else LONG_DELAY
    return Turn(text=" ".join(f"w{i}" for i in range(length)), delay=delay)


class Gate:
    """Holds every call of the gated tools until the test opens it; counts the calls
    entered. Works across threads: the app runs under Uvicorn in its own thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entered = 0
        self._opened = False
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._changed = threading.Condition(self._lock)

        self.hurry = False
        """The long replies of gated_turn stream at once (the stop under test landed)."""

    def reset(self) -> None:
        with self._lock:
            self._entered, self._opened, self._waiting = 0, False, []
            self.hurry = False

    async def hold(self) -> None:
        event = asyncio.Event()
        with self._lock:
            self._entered += 1
            self._changed.notify_all()
            if self._opened:
                return
            self._waiting.append((asyncio.get_running_loop(), event))
        await event.wait()

    def release(self) -> None:
        """Let the calls held now go on (later ones are held again)."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
        for loop, event in waiting:
            loop.call_soon_threadsafe(event.set)

    def open(self) -> None:
        """Let every held call go on, and the later ones through."""
        with self._lock:
            self._opened = True
        self.release()

    async def entered(self, count: int) -> None:
        """Wait until ``count`` gated calls have started (a provable point)."""

        def wait() -> bool:
            with self._lock:
                return self._changed.wait_for(lambda: self._entered >= count, 30)

        assert await asyncio.to_thread(wait), f"{self._entered} of {count} gated calls entered"


GATE = Gate()


@aio.tool
async def gated_lookup(query: str) -> str:
    """Look something up, slowly (held by the test's gate)."""
    await GATE.hold()
    return f"found {query}"


@aio.tool(approval=True)
async def gated_wire(query: str) -> str:
    """Wire money (a person approves it first; held by the test's gate)."""
    await GATE.hold()
    return f"wired {query}"


def lookup(query: str) -> str:
    """Look something up."""
    return f"found {query}"


def remember(note: str, ctx: aio.ToolContext) -> str:
    """Add a note to the state shared with the page."""
    if ctx.shared_state is None:
        return "no shared state"
    had = list(ctx.shared_state.get("notes", []))
    ctx.shared_state["notes"] = [*had, note]
    return f"had {had}"


#: Who send_email mailed, in this process: an approved call shows up here, a denied never.
MAILED: list[str] = []


@aio.tool(approval=True)
def send_email(to: str) -> str:
    """Send an email (a person approves it first)."""
    MAILED.append(to)
    return f"sent to {to}"


# Per module: a session-long server thread would outlive tests/serve and be seen as a
# leak by the loopback server's own tests.
@pytest.fixture(scope="module")
def model_server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread(script) as server:
        yield server


@contextlib.contextmanager
def uvicorn_serving(
    application: ServeApp, protocol: type[asyncio.Protocol] = DeadlineH11Protocol
) -> Iterator[str]:
    """Serve ``application`` with Uvicorn in a thread on a random port, with ``protocol``
    (as ``aimu serve`` does); yield its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    config = uvicorn.Config(application, log_level="warning", lifespan="on", http=protocol)
    server = uvicorn.Server(config)
    started = threading.Event()
    original_startup = server.startup

    async def startup(sockets: list[socket.socket] | None = None) -> None:
        await original_startup(sockets)
        started.set()

    server.startup = startup  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert started.wait(20), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        application.runs.begin_shutdown()
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextlib.contextmanager
def hurried(model: LoopbackServer) -> Iterator[None]:
    """Inside the block the model server streams without its turns' delays: for the end
    of a test whose send, stop or input has landed and that has only a slow reply's end to
    wait for (a "long" one streams for ~8 s)."""
    model.hurried = True
    try:
        yield
    finally:
        model.hurried = False


@dataclass
class Served:
    url: str
    app: ServeApp
    model: LoopbackServer
    store: Path | str


def make_app(model: LoopbackServer, store: Path | str, **options: Any) -> ServeApp:
    client = aio.client("openai:loop", base_url=model.openai_base_url, api_key="sk-test")
    tools = [lookup, send_email, gated_lookup, gated_wire, remember]
    return app(client, store=store, tools=tools, **options)


@pytest.fixture
def served(model_server: LoopbackServer, tmp_path: Path) -> Iterator[Served]:
    application = make_app(model_server, tmp_path / "sessions.db")
    with uvicorn_serving(application) as url:
        yield Served(url, application, model_server, tmp_path / "sessions.db")


@pytest.fixture
async def http(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served.url, timeout=20) as client:
        yield client


@dataclass
class SSE:
    id: str
    type: str
    data: dict[str, Any]


async def sse_events(
    client: httpx.AsyncClient, path: str, headers: Mapping[str, str] | None = None
) -> AsyncIterator[SSE]:
    """The events of a Server-Sent Events response (aimu's own parser); keep-alives skipped."""
    async with client.stream("GET", path, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        parser = SSEParser()
        async for line in response.aiter_lines():
            event = parser.feed(line)
            if event is not None:
                yield SSE(event.id, event.event, json.loads(event.data))


async def collect(
    client: httpx.AsyncClient, run_id: str, headers: Mapping[str, str] | None = None
) -> list[SSE]:
    return [event async for event in sse_events(client, f"/runs/{run_id}/events", headers)]


async def first_text(client: httpx.AsyncClient, run_id: str) -> list[SSE]:
    """Follow ``run_id`` until its first text event; return what was seen (then disconnect)."""
    seen: list[SSE] = []
    events = sse_events(client, f"/runs/{run_id}/events")
    async with contextlib.aclosing(events):
        async for event in events:
            seen.append(event)
            if event.type == "text":
                return seen
    raise AssertionError(f"run {run_id} ended without a text event: {seen}")


async def start(client: httpx.AsyncClient, session: str, task: str) -> str:
    response = await client.post(f"/sessions/{session}/runs", json={"task": task})
    assert response.status_code == 202, response.text
    return str(response.json()["run_id"])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AIMU_API_TOKEN", "AIMU_MODEL")}
    env.update(PYTHONPATH=str(ROOT), **extra)
    return env


@contextlib.asynccontextmanager
async def postgres_database() -> AsyncIterator[str]:
    """The URL of a PostgreSQL database made for the test, dropped afterwards."""
    import secrets
    from urllib.parse import urlsplit, urlunsplit

    import asyncpg

    from tests.services import postgres_dsn

    admin_dsn = postgres_dsn()
    database = f"aimu_test_{secrets.token_hex(4)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{database}"')
        yield urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{database}"))
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.close()


@contextlib.asynccontextmanager
async def store_of(kind: str, tmp_path: Path) -> AsyncIterator[Path | str]:
    """A store for servers to share: ``sqlite`` (a file) or ``postgres`` (a database URL)."""
    if kind == "sqlite":
        yield tmp_path / "sessions.db"
        return
    async with postgres_database() as url:
        yield url


@dataclass
class ServeProcess:
    url: str
    process: asyncio.subprocess.Process
    log: Path


@contextlib.asynccontextmanager
async def aimu_serve(
    model: LoopbackServer, workdir: Path, *args: str, name: str = "serve",
    port: int | None = None,
) -> AsyncIterator[ServeProcess]:
    """``aimu serve ARGS`` in a child process on ``port`` (default: a free one), on the
    loopback model."""
    port = free_port() if port is None else port
    log_path = workdir / f"{name}.log"
    env = clean_env(OPENAI_BASE_URL=model.openai_base_url, OPENAI_API_KEY="sk-test")
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "aimu", "serve", "--port", str(port), "--model", "openai:loop",
            "--log-level", "warning", *args,
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url) as http:
            deadline = time.monotonic() + 30
            while True:  # the server starting up, not a race with the work under test
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if process.returncode is not None or time.monotonic() > deadline:
                    raise AssertionError(f"aimu serve did not start: {log_path.read_text()}")
                await asyncio.sleep(0.05)
        yield ServeProcess(url, process, log_path)
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 30)
            except TimeoutError:
                process.kill()
                await process.wait()
