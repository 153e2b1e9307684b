"""The web chat and a server that died mid-run (issue 42, item 4): the page reconnects to
the server that comes back in its place and revives the run by a POST, never a GET.

Real ``aimu serve`` processes on one port and one store, a real Chromium page: the first
server is killed with SIGKILL while the reply streams; the page retries, finds that the new
server does not know the run it followed, resumes the session (``POST .../resume``) and
follows the run to its end, showing the reply once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from aimu.aio.store import SQLiteStore
from aimu.aio.transcript import validate
from aimu.testing.server import LoopbackServer
from tests.serve.harness import LONG, aimu_serve, last_user
from tests.services import free_port

pytestmark = pytest.mark.slow


async def test_the_page_revives_a_run_whose_server_died_by_a_post(
    page: Any, model_server: LoopbackServer, tmp_path: Path
) -> None:
    from playwright.async_api import Page, expect

    assert isinstance(page, Page)
    requests: list[tuple[str, str]] = []
    page.on("request", lambda request: requests.append((request.method, request.url)))
    port, store = free_port(), tmp_path / "s.db"
    served = ("--store", str(store))
    asked = sum(1 for r in model_server.requests if last_user(r.body) == "long crash")
    async with aimu_serve(model_server, tmp_path, *served, port=port, name="one") as one:
        await page.goto(f"{one.url}/?session=crash")
        await page.locator("#input").fill("long crash")
        await page.locator("#input").press("Enter")
        await expect(page.locator(".msg.assistant").last).to_contain_text("w5 ")
        one.process.kill()  # mid-reply: the run dies with its server
        await one.process.wait()
    revives = [(m, u) for m, u in requests if u.endswith("/sessions/crash/resume")]
    assert revives == []
    async with aimu_serve(model_server, tmp_path, *served, port=port, name="two"):
        await expect(page.locator("#status")).to_have_text("completed", timeout=60_000)
        await expect(page.locator(".msg.assistant")).to_have_count(1)
        await expect(page.locator(".msg.assistant").last).to_have_text(LONG)
        await expect(page.locator(".msg")).to_have_count(2)  # the task, the reply: once each
    revives = [(m, u) for m, u in requests if u.endswith("/sessions/crash/resume")]
    assert [m for m, _ in revives] == ["POST"]
    assert sum(1 for r in model_server.requests if last_user(r.body) == "long crash") == asked + 2
    opened = SQLiteStore(store)
    try:
        stored = await opened.load("crash")
    finally:
        await opened.aclose()
    validate(stored)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[-1]["content"] == LONG
