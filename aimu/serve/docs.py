"""The browsable API page, ``/docs``: Swagger UI served by this server, nothing from a CDN.

FastAPI's own page loads Swagger UI from cdn.jsdelivr.net and starts it with an inline
script: offline it is blank, and under a strict Content-Security-Policy it may not run.
Here the page, Swagger UI's files (as the ``fastapi-offline`` package ships them) and
the script that starts it all come from this server, so ``/docs`` works without
internet under a CSP of ``'self'`` only (:data:`aimu.serve.guards.DOCS_POLICY`).
"""

from __future__ import annotations

from html import escape
from importlib.resources import files
from pathlib import Path
from typing import Final

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response

__all__ = ["DOCS_PATH", "add_docs"]

#: Where the page is; its files are under ``/docs/``.
DOCS_PATH: Final = "/docs"
_SWAGGER_UI: Final = Path(str(files("fastapi_offline") / "static"))
#: The only files served under /docs/: a fixed table, no directory to walk.
_FILES: Final = {
    "swagger-ui-bundle.js": _SWAGGER_UI / "swagger-ui-bundle.js",
    "swagger-ui.css": _SWAGGER_UI / "swagger-ui.css",
    "favicon.png": _SWAGGER_UI / "favicon.png",
    "init.js": Path(__file__).with_name("docs_page") / "init.js",
}
_PAGE: Final = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} - Swagger UI</title>
<link rel="icon" type="image/png" href="{docs}/favicon.png">
<link rel="stylesheet" href="{docs}/swagger-ui.css">
</head>
<body>
<div id="swagger-ui"></div>
<script src="{docs}/swagger-ui-bundle.js"></script>
<script src="{docs}/init.js" data-openapi="{openapi}"></script>
</body>
</html>
"""


def add_docs(application: FastAPI) -> None:
    """Serve ``/docs`` (the page) and ``/docs/<file>`` (Swagger UI and its start script)
    on ``application``, which must have been built with ``docs_url=None``."""
    title = escape(application.title)
    openapi_url = application.openapi_url or "/openapi.json"

    async def page(request: Request) -> Response:
        root = request.scope.get("root_path", "").rstrip("/")
        html = _PAGE.format(
            title=title, docs=escape(root + DOCS_PATH), openapi=escape(root + openapi_url)
        )
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    async def asset(name: str) -> Response:
        path = _FILES.get(name)
        if path is None:
            raise HTTPException(404)
        return FileResponse(path, headers={"Cache-Control": "no-cache"})

    application.add_api_route(DOCS_PATH, page, methods=["GET"], include_in_schema=False)
    application.add_api_route(
        DOCS_PATH + "/{name}", asset, methods=["GET"], include_in_schema=False
    )
