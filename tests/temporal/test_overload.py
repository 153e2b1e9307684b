"""An overloaded Temporal: ``aimu serve --temporal`` answers a start that Temporal did
not take in time 503 with ``Retry-After`` and a message without internals (never 500),
and a run whose start timed out is cancelled, not left to run unseen."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from aimu.temporal import _client
from aimu.testing.server import LoopbackServer
from tests.serve.harness import make_app, uvicorn_serving
from tests.serve.harness import model_server as threaded_model_server

__all__ = ["threaded_model_server"]


async def test_a_start_temporal_does_not_take_in_time_is_a_503_with_retry_after(
    temporal: str, queue: str, tmp_path: Path, threaded_model_server: LoopbackServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    application = make_app(threaded_model_server, tmp_path / "sessions.db",
                           temporal=temporal, task_queue=queue)
    with uvicorn_serving(application) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            # No server is that quick (raising=False: before the fix there was no limit).
            monkeypatch.setattr(_client, "START_SECONDS", 1e-6, raising=False)
            refused = await http.post("/sessions/s1/runs", json={"task": "hello"})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "5"
            detail = refused.json()["error"]
            assert "try again" in detail and "RPCError" not in detail, detail
            monkeypatch.setattr(_client, "START_SECONDS", 10.0)
            started = await http.post("/sessions/s1/runs", json={"task": "hello"})
            assert started.status_code == 202, started.text
