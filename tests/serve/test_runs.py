"""The runs service and its backends without HTTP: what the routes rely on and cannot
show from outside."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.run_handle import RunHandle
from aimu.serve.backends.launcher import Launcher
from aimu.serve.backends.local import LocalBackend
from aimu.serve.backends.redis import RedisBackend
from aimu.serve.runs import Runs, RunsBackend


def test_both_backends_implement_the_protocol() -> None:
    for backend in (LocalBackend, RedisBackend):
        missing = [
            name for name in ("start", "view", "latest", "check_follow", "follow", "request",
                              "decide", "begin_shutdown", "aclose")
            if not callable(getattr(backend, name, None))
        ]
        assert not missing, (backend, missing)
    assert RunsBackend.__doc__ and "Conflict" in RunsBackend.__doc__


async def test_a_run_whose_handle_cannot_start_releases_its_session(tmp_path: Path) -> None:
    class Closed:
        """A run control that refuses every run, as when the server's control has closed."""

        def run_id(self, wanted: str | None) -> str:
            raise RuntimeError("no handle today")

        def attach(self, handle: RunHandle[Any]) -> None:
            raise AssertionError("never attached: the run was refused its id")

    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        client = aio.client("test")
        agents = lambda s: aio.Agent(client.fork(), store=store, session=s)  # noqa: E731
        launcher = Launcher(agents)
        with pytest.raises(RuntimeError, match="no handle today"):
            await launcher.start(await launcher.open("s", "hello", None), control=Closed())
        runs = Runs(LocalBackend(agents, store), store, agents)
        assert await runs.session_run("s") is None
        writer = await store.open_session("s")  # the lock was released
        await writer.aclose()
        await client.aclose()


async def test_a_run_cancelled_before_it_began_releases_its_session(tmp_path: Path) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        client = aio.client("test")
        agents = lambda s: aio.Agent(client.fork(), store=store, session=s)  # noqa: E731
        launcher = Launcher(agents)

        handle = await launcher.start(await launcher.open("s", "hello", None))
        handle.cancel("before it began")  # start() returned before the run's task ran
        await launcher.settled(handle)
        assert handle.status == "cancelled"
        writer = await store.open_session("s")  # released though the run never began
        await writer.aclose()
        await client.aclose()


async def test_a_run_opened_then_started_is_the_backends_downward_call(tmp_path: Path) -> None:
    """open() hands the backend the session's size before the run; start() runs it under
    the handle it names; a cancel before it began releases the session."""
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        client = aio.client("test")
        agents = lambda s: aio.Agent(client.fork(), store=store, session=s)  # noqa: E731
        launcher = Launcher(agents)
        done = await launcher.start(await launcher.open("s", "hello", None), run_id="r-1")
        assert await done == "You said: hello"
        await launcher.settled(done)
        launch = await launcher.open("s", "again", None)
        assert launch.messages_from == 2  # the first run's task and answer
        handle = await launcher.start(launch, name="run r-2", run_id="r-2")
        assert (handle.run_id, handle.name) == ("r-2", "run r-2")
        handle.cancel("before it began")
        await launcher.settled(handle)
        assert handle.status == "cancelled"
        writer = await store.open_session("s")  # released though the run never began
        await writer.aclose()
        await launcher.aclose()
        await client.aclose()
