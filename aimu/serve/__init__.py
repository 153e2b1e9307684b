"""``aimu serve``: the runs API over HTTP and a web chat with a Stop button.

``aimu.serve.app(...)`` builds the ASGI application (FastAPI) to run under any ASGI
server or mount in another application; ``aimu serve`` runs it under Uvicorn. Needs the
``serve`` extra; the application is imported on first use, so the ``aimu`` command
line works without it.

Why FastAPI and Uvicorn: the routes, their pydantic request and answer models and the
OpenAPI document (``/openapi.json``, browsable at ``/docs``) are one table
(:mod:`aimu.serve.routes`), so the contract the fuzzer checks is what the server does;
it is what Python users expect, on the Starlette it is built on (middleware, streaming
responses that notice a client going away, which is all Server-Sent Events need).
Uvicorn is the common production ASGI server and starts in-process for tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aimu._extras import missing_extra

if TYPE_CHECKING:
    from aimu.serve.application import DEFAULT_MAX_BODY, ServeApp, app

__all__ = ["DEFAULT_MAX_BODY", "ServeApp", "app"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'aimu.serve' has no attribute {name!r}")
    try:
        module = importlib.import_module("aimu.serve.application")
    except ImportError as missing:
        top = str(missing.name).partition(".")[0]
        if top not in ("fastapi", "pydantic", "starlette", "uvicorn"):
            raise
        raise missing_extra("aimu.serve", "serve", missing) from missing
    value = getattr(module, name)
    globals()[name] = value
    return value
