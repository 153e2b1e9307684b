"""The /docs page in a real Chromium (issue 22): Swagger UI served by this server works
offline and under its own strict Content-Security-Policy.

Every request the page makes is recorded: none may leave the server's origin (no CDN,
no validator, no font host). Every CSP violation (``securitypolicyviolation``, seen by
a script Playwright adds before the page's own) and every console error fails the test.
The operations list shows the routes, and "Try it out" calls the API from the page.
"""

from __future__ import annotations

import httpx
import pytest

from aimu.serve.guards import DOCS_POLICY
from tests.serve.harness import Served

pytestmark = pytest.mark.slow

WATCH_CSP = """
window.__violations = [];
document.addEventListener("securitypolicyviolation", (event) => {
  window.__violations.push(`${event.violatedDirective} ${event.blockedURI}`);
});
"""


async def test_docs_load_offline_under_the_strict_policy(page: object, served: Served) -> None:
    from playwright.async_api import ConsoleMessage, Page, Request, expect

    assert isinstance(page, Page)
    requested: list[str] = []
    errors: list[str] = []

    def record(request: Request) -> None:
        requested.append(request.url)

    def console(message: ConsoleMessage) -> None:
        if message.type in ("error", "warning"):
            errors.append(f"{message.type}: {message.text}")

    page.on("request", record)
    page.on("console", console)
    page.on("pageerror", lambda error: errors.append(f"pageerror: {error}"))
    await page.add_init_script(WATCH_CSP)

    response = await page.goto(served.url + "/docs")
    assert response is not None and response.status == 200
    assert response.headers["content-security-policy"] == DOCS_POLICY
    assert "unsafe-inline" not in DOCS_POLICY and "http" not in DOCS_POLICY

    # The operations list, written from /openapi.json: a known route is there.
    start = page.locator(".opblock-post", has_text="/sessions/{session}/runs").first
    await expect(start.locator(".opblock-summary-method")).to_have_text("POST")
    await expect(page.locator(".opblock-get", has_text="/health")).to_have_count(1)

    # "Try it out" on GET /health: the page calls this server (connect-src 'self').
    health = page.locator(".opblock-get", has_text="/health")
    await health.locator(".opblock-summary").click()
    await health.get_by_role("button", name="Try it out").click()
    await health.get_by_role("button", name="Execute").click()
    await expect(health.locator(".live-responses-table tr.response .response-col_status").first
                 ).to_have_text("200")

    assert await page.evaluate("window.__violations") == []
    assert errors == []
    origin = served.url + "/"
    assert requested and all(
        url.startswith(origin) or url.startswith("data:") for url in requested
    ), requested
    paths = {url.removeprefix(served.url) for url in requested}
    assert {"/docs", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/docs/init.js",
            "/openapi.json", "/health"} <= paths, paths


async def test_the_docs_files_are_served_with_the_docs_policy(served: Served) -> None:
    async with httpx.AsyncClient(base_url=served.url) as http:
        for path in ("/docs", "/docs/init.js", "/docs/swagger-ui-bundle.js",
                     "/docs/swagger-ui.css", "/docs/favicon.png"):
            answer = await http.get(path)
            assert answer.status_code == 200, path
            assert answer.headers["content-security-policy"] == DOCS_POLICY, path
            assert answer.headers["x-frame-options"] == "DENY", path
            assert answer.headers["x-content-type-options"] == "nosniff", path
        page = (await http.get("/docs")).text
        assert "<script>" not in page and "style=" not in page  # nothing inline
        assert "cdn" not in page and "https://" not in page
        for path in ("/docs/redoc.standalone.js", "/docs/..%2Fdocs.py", "/docs/nothing.js"):
            missing = await http.get(path)
            assert missing.status_code == 404, path
            assert missing.json()["status"] == 404
