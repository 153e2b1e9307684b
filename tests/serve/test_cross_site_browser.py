"""Cross-site requests from a real Chromium (issue 21, item 4): a page served by a second
local server, on another port, tries what a hostile page can do without CORS.

A ``no-cors`` fetch starting a run, one resuming a stopped session (no body: only the
origin tells), and a ``<form enctype="text/plain">`` posting a JSON-looking body. Each
request reaches the server (recorded) and is refused; no run starts, no session resumes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aimu.testing.server import LoopbackServer
from tests.serve.harness import make_app, uvicorn_serving
from tests.serve.test_security import assert_untouched, stopped_session

pytestmark = pytest.mark.slow

ATTACK = """<!doctype html><html><body>
<iframe name="sink"></iframe>
<form id="form" method="POST" enctype="text/plain" target="sink"
      action="{target}/sessions/formed/runs">
  <input name='{{"task": "x", "pad": "' value='"}}'>
</form>
<script>
// The responses are unreadable (and Cross-Origin-Resource-Policy fails the fetch): the
// harm would be in the request itself.
const quietly = (promise) => promise.catch(() => null);
window.attack = async () => {{
  await quietly(fetch("{target}/sessions/victim/runs", {{
    method: "POST", mode: "no-cors", body: JSON.stringify({{task: "x"}})
  }}));
  await quietly(fetch("{target}/sessions/stopped/resume", {{method: "POST", mode: "no-cors"}}));
  document.getElementById("form").submit();
  return "sent";
}};
</script></body></html>"""


class Recorder:
    """ASGI middleware outside the app: every request's method, path and status."""

    def __init__(self, app: ASGIApp, seen: list[tuple[str, str, int]]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def reply(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.seen.append((scope["method"], scope["path"], message["status"]))
            await send(message)

        await self.app(scope, receive, reply)


@pytest.fixture
def attacker() -> Iterator[tuple[str, list[str]]]:
    """A second local server on its own port; set ``page[0]`` to the HTML it serves."""
    page = [""]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page[0].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", page
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


async def test_a_page_of_another_origin_cannot_start_or_resume_runs(
    model_server: LoopbackServer,
    tmp_path: Path,
    attacker: tuple[str, list[str]],
    page: Any,
) -> None:
    seen: list[tuple[str, str, int]] = []
    application = make_app(model_server, tmp_path / "s.db")
    application.add_middleware(Recorder, seen=seen)
    with uvicorn_serving(application) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            kept = await stopped_session(http, "stopped")
            origin, html = attacker
            html[0] = ATTACK.format(target=url)
            await page.goto(origin + "/")
            assert await page.evaluate("window.attack()") == "sent"
            posts = {"/sessions/victim/runs", "/sessions/stopped/resume", "/sessions/formed/runs"}
            for _ in range(600):  # until the server answered all three (a provable point)
                if posts <= {path for method, path, _ in seen if method == "POST"}:
                    break
                await asyncio.sleep(0.05)
            answered = {path: status for method, path, status in seen if path in posts}
            assert answered == dict.fromkeys(posts, 403), seen
            for name in ("victim", "formed"):
                await assert_untouched(http, name, None)
            await assert_untouched(http, "stopped", kept)

            # The server's own page may (the same browser, the same requests).
            await page.goto(url + "/")
            status = await page.evaluate(
                """async () => (await fetch("/sessions/stopped/resume",
                                  {method: "POST"})).status"""
            )
            assert status == 202


IMAGES = """<!doctype html><html><body>
<img src="{target}/api/chat/crashed/stream">
<img src="{target}/sessions/crashed">
<img src="{target}/runs/{run_id}/events">
</body></html>"""


async def test_an_image_of_another_origin_revives_no_crashed_run(
    model_server: LoopbackServer,
    tmp_path: Path,
    attacker: tuple[str, list[str]],
    page: Any,
) -> None:
    """A cross-site ``<img>`` (a GET, no Origin, ``Sec-Fetch-Site: cross-site``) at the
    AI SDK's reconnect, a session and a run's events, for a session whose run died with
    its server: each GET reaches the server and nothing runs. The server's own page then
    revives the run with the POST of the same path."""
    from aimu.aio.store import RunRecord, SQLiteStore

    seen: list[tuple[str, str, int]] = []
    run_id = "R" * 22
    store = SQLiteStore(tmp_path / "s.db")
    try:
        writer = await store.open_session("crashed")
        await writer.append({"role": "user", "content": "hello"})
        await writer.record_run(RunRecord(id=run_id, session="crashed", agent="agent",
                                          started=1.0, status="running", messages_from=0))
        await writer.set_status("in_progress")  # as a server killed mid-run leaves it
        await writer.aclose()
    finally:
        await store.aclose()
    application = make_app(model_server, tmp_path / "s.db")
    application.add_middleware(Recorder, seen=seen)
    asked = len(model_server.requests)
    with uvicorn_serving(application) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            origin, html = attacker
            html[0] = IMAGES.format(target=url, run_id=run_id)
            await page.goto(origin + "/")
            gets = {"/api/chat/crashed/stream", "/sessions/crashed", f"/runs/{run_id}/events"}
            for _ in range(600):  # until the server answered all three (a provable point)
                if gets <= {path for method, path, _ in seen if method == "GET"}:
                    break
                await asyncio.sleep(0.05)
            assert gets <= {path for method, path, _ in seen if method == "GET"}, seen
            session = (await http.get("/sessions/crashed")).json()
            assert (session["run_id"], session["status"]) == (None, "in_progress")
            assert len(model_server.requests) == asked  # no model turn ran again

            # The server's own page revives it, by POST.
            await page.goto(url + "/")
            said = await page.evaluate(
                """async () => (await (await fetch("/api/chat/crashed/stream",
                                                    {method: "POST"})).text())"""
            )
            assert '"aimuStatus":"completed"' in said, said
            session = (await http.get("/sessions/crashed")).json()
            assert session["status"] == "completed"
