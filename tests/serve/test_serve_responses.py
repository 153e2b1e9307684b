"""``aimu serve`` on the Responses wire: runs answered over the Responses API, and a Stop
that closes the model's stream (the loopback server sees it abandoned)."""

from __future__ import annotations

from pathlib import Path

import httpx

from aimu import aio
from aimu.serve import app
from aimu.testing.server import LoopbackServer
from tests.serve.harness import collect, first_text, lookup, start, uvicorn_serving


async def test_serve_runs_and_stops_on_the_responses_wire(
    model_server: LoopbackServer, tmp_path: Path
) -> None:
    client = aio.client("openai-responses:loop", base_url=model_server.openai_base_url,
                        api_key="sk-serve-secret")
    application = app(client, store=tmp_path / "sessions.db", tools=[lookup])
    with uvicorn_serving(application) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            run_id = await start(http, "answered", "hello")
            events = await collect(http, run_id)
            assert "answer to hello" in str([e.data for e in events])
            abandoned = len([s for s in model_server.streams if s.abandoned])
            run_id = await start(http, "stopped", "long tale")
            await first_text(http, run_id)
            cancel = await http.post(f"/runs/{run_id}/cancel", json={"reason": "Stop"})
            assert cancel.status_code in (200, 202), cancel.text
            record = (await model_server.wait_abandoned(abandoned + 1))[abandoned]
            assert record.path == "/v1/responses"
            session = await http.get("/sessions/stopped")
            assert session.status_code == 200 and "sk-serve-secret" not in session.text
