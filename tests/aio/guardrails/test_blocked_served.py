"""The ``blocked`` status through ``aimu serve``: the runs API and its SSE, the stored run
record and session, the A2A task state, the AI SDK and AG-UI streams, and ``aimu runs``."""

from __future__ import annotations

import json
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
from tests.serve.test_ag_ui import ag_ui_events, run_input, user

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
        # A2A: the task is rejected (read from the store)
        got = await http.post("/a2a", json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                            "params": {"id": "s1:0"}})
        status = got.json()["result"]["status"]
        assert status["state"] == "TASK_STATE_REJECTED"
        # The AI SDK: the message finishes with content-filter, the reason in its metadata
        body = {"id": "sdk-secret", "trigger": "submit-message", "messages": [
            {"id": "u1", "role": "user", "parts": [{"type": "text", "text": "a secret"}]}]}
        seen = []
        async with http.stream("POST", "/api/chat", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    seen.append(json.loads(line[6:]))
        finish = seen[-1]
        assert finish["type"] == "finish" and finish["finishReason"] == "content-filter"
        assert finish["messageMetadata"]["aimuStatus"] == "blocked"
        assert "no_secrets" in finish["messageMetadata"]["aimuReason"]
        # AG-UI (each event checked by the protocol's own models): the run ends with the
        # cancelled outcome (AG-UI has no blocked one), the metadata says by what
        events = await ag_ui_events(http, run_input("agui-secret", "r1", user("a secret")))
        (finished,) = [e for e in events if e["type"] == "RUN_FINISHED"]
        assert finished["outcome"] == {"type": "cancelled"}
        assert finished["metadata"]["aimuStatus"] == "blocked"
        assert "no_secrets" in finished["metadata"]["reason"]
        assert "RUN_ERROR" not in [e["type"] for e in events]


def test_mcp_says_a_guardrail_blocked_the_run() -> None:
    from mcp.server.mcpserver.exceptions import ToolError

    from aimu.serve.mcp_agent import _result

    with pytest.raises(ToolError, match="a guardrail blocked the run: guardrail 'g': no"):
        _result("s", "blocked", "Run blocked", None, "guardrail 'g': no")
