"""``aimu serve --http/--loop``: on httptools and uvloop when they are installed (auto), or
on h11 and asyncio's own loop; a stop crosses the server on either, end to end."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvloop

from aimu._extras import MissingExtra
from aimu.serve._uvicorn import Engine, engine
from aimu.serve.slow_clients import DeadlineH11Protocol, DeadlineHttpToolsProtocol
from aimu.testing.server import LoopbackServer
from tests.serve.harness import ROOT, aimu_serve, clean_env, collect, first_text, start

WITHOUT_HTTPTOOLS = """
import sys
sys.modules["httptools"] = None  # not installed
from aimu.serve._uvicorn import Engine, engine
from aimu.serve.slow_clients import DeadlineHttpToolsProtocol
assert engine() == Engine("h11", "uvloop"), engine()
try:
    DeadlineHttpToolsProtocol()
except ImportError as error:
    print(error)
"""


def test_auto_takes_httptools_and_uvloop_when_they_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = engine()
    assert fast == Engine("httptools", "uvloop") and str(fast) == "httptools on uvloop"
    assert fast.protocol is DeadlineHttpToolsProtocol
    loop = fast.new_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()

    for module in ("httptools", "uvloop"):  # neither installed: an import of it fails
        monkeypatch.setitem(sys.modules, module, None)
    plain = engine("auto", "auto")
    assert plain == Engine("h11", "asyncio") and plain.protocol is DeadlineH11Protocol
    loop = plain.new_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_without_httptools_the_server_imports_and_runs_on_h11() -> None:
    done = subprocess.run([sys.executable, "-c", WITHOUT_HTTPTOOLS], cwd=ROOT, env=clean_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("DeadlineHttpToolsProtocol needs httptools ("), done.stdout


def test_one_asked_for_by_name_that_does_not_import_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert engine("h11", "asyncio") == Engine("h11", "asyncio")  # installed or not
    for option, module in (("--http", "httptools"), ("--loop", "uvloop")):
        monkeypatch.setitem(sys.modules, module, None)
        with pytest.raises(MissingExtra) as refused:
            engine(**{option.removeprefix("--"): module})
        assert str(refused.value).startswith(
            f"{option} {module} needs the serve extra ({module} is not installed): pip install"
        )
    assert engine("h11", "asyncio") == Engine("h11", "asyncio")


@pytest.mark.parametrize(("http", "loop"), [("httptools", "uvloop"), ("h11", "asyncio")])
async def test_a_stop_of_a_served_run_reaches_the_model_on_either(
    model_server: LoopbackServer, tmp_path: Path, http: str, loop: str
) -> None:
    abandoned = sum(stream.abandoned for stream in model_server.streams)
    async with aimu_serve(model_server, tmp_path, "--http", http, "--loop", loop) as served:
        assert f"  server uvicorn, {http} on {loop}\n" in served.log.read_text()
        async with httpx.AsyncClient(base_url=served.url, timeout=30) as client:
            run_id = await start(client, "stopped", "long story")
            await first_text(client, run_id)  # the model is streaming the reply now
            assert (await client.post(f"/runs/{run_id}/cancel")).status_code == 202
            assert (await collect(client, run_id))[-1].data["status"] == "cancelled"
            await model_server.wait_abandoned(abandoned + 1)  # its stream closed at the model
            kept = (await client.get("/sessions/stopped")).json()["messages"][-1]
            assert kept["role"] == "assistant" and kept["content"], kept  # the partial reply
    assert served.process.returncode == 0  # SIGTERM: a clean exit
