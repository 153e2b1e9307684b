"""The ``blocked`` status through ``aimu serve``: the runs API and its SSE, the stored run
record and session, the A2A task state, the AI SDK stream, and ``aimu runs``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu import aio
from aimu.aio.instructions import RunContext
from aimu.serve import app
from aimu.testing.server import LoopbackServer
from tests.serve.harness import collect, model_server, start, uvicorn_serving

__all__ = ["model_server"]


def no_secrets(ctx: RunContext[Any], text: str) -> None:
    if "secret" in text:
        raise aio.Tripwire("the answer mentions a secret")


@pytest.fixture
def url(model_server: LoopbackServer, tmp_path: Path) -> Iterator[str]:
    store = aio.SQLiteStore(tmp_path / "s.db")
    client = aio.client("openai:loop", base_url=model_server.openai_base_url,
                        api_key="sk-test")

    def agents(session: str) -> aio.Agent[str]:
        return aio.Agent(client.fork(), store=store, session=session,
                         output_guardrails=[no_secrets])

    application = app(client, store=store, agents=agents)
    with uvicorn_serving(application) as served:
        yield served


async def test_a_blocked_run_is_reported_blocked_everywhere(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=20) as http:
        run_id = await start(http, "s1", "the secret")
        events = await collect(http, run_id)
        assert [e.data["status"] for e in events[-2:]] == ["blocked", "blocked"]
        run = (await http.get(f"/runs/{run_id}")).json()
        assert run["status"] == "blocked"
        assert "no_secrets" in run["reply"]
        session = (await http.get("/sessions/s1")).json()
        assert session["status"] == "blocked"
        assert session["messages"][-1].get("aimu_partial") is True
        listed = (await http.get("/runs", params={"status": "blocked"})).json()
        assert [r["id"] for r in listed["runs"]] == [run_id]
