"""Worker processes and a Redis the control tests own (imported by tests and fixtures)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from aimu import aio
from tests import services

WORKER = Path(__file__).with_name("worker_proc.py")
ROOT = Path(__file__).parents[3]
#: Short, so a killed worker's run is lost soon; long enough for a busy machine.
LEASE = 2.0


class Workers:
    """Worker OS processes (worker_proc.py) sharing one Redis prefix, store and model."""

    def __init__(
        self, url: str, prefix: str, model_url: str, store: Path, lease: float = LEASE
    ) -> None:
        self.url, self.prefix, self.model_url, self.store = url, prefix, model_url, store
        self.lease = lease
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self, count: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        for _ in range(count):
            self.processes.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        self.url,
                        self.prefix,
                        self.model_url,
                        str(self.store),
                        str(self.lease),
                    ],
                    env=env,
                    stdin=subprocess.DEVNULL,
                )
            )

    async def ready(self, control: aio.RedisControl, count: int) -> None:
        """Wait until ``count`` workers said they are connected (each says so once)."""
        for _ in range(count):
            popped = await control._client.blpop([f"{self.prefix}:test:ready"], timeout=30)
            assert popped is not None, "a worker process did not start within 30 s"

    async def push(self, control: aio.RedisControl, job: dict[str, Any]) -> None:
        await control._client.rpush(f"{self.prefix}:test:jobs", json.dumps(job))

    def kill(self, index: int) -> None:
        self.processes[index].send_signal(signal.SIGKILL)
        self.processes[index].wait()

    async def stop(self, control: aio.RedisControl) -> None:
        for process in self.processes:
            if process.poll() is None:
                await self.push(control, {"stop": True})
        for process in self.processes:
            try:
                await asyncio.to_thread(process.wait, 20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for process in self.processes:
            assert process.returncode in (0, -signal.SIGKILL), process.returncode


class DurableRedis:
    """A redis-server this test owns, with an fsync'd append-only file: a restart keeps
    what was written, as a production Redis with persistence does."""

    def __init__(self, password: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            services.unavailable("redis-server is not on PATH (needed to restart Redis)")
        self._binary = binary
        self._dir = tempfile.mkdtemp(prefix="aimu-redis-")
        self.port = services.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._auth = [] if password is None else ["--requirepass", password]
        self._process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self._process = subprocess.Popen(
            [
                self._binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--dir",
                self._dir,
                *self._auth,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while not _answers(self.port):
            assert self._process.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not answer within 20 s"
            time.sleep(0.02)

    def kill(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            process.kill()
            process.wait()

    @property
    def running(self) -> bool:
        return self._process is not None

    def forget(self) -> None:
        """Kill it and delete what it kept: the next :meth:`start` comes back empty, as
        a Redis without persistence does."""
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)
        os.makedirs(self._dir)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _answers(port: int) -> bool:
    """Whether a Redis listens on ``port`` (a password-protected one answers -NOAUTH)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
            conn.sendall(b"PING\r\n")
            return conn.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
