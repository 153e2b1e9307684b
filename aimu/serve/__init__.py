"""``aimu serve``: the runs API over HTTP and a web chat with a Stop button.

``aimu.serve.app(...)`` builds the ASGI application (Starlette) to run under any ASGI
server or mount in another application; ``aimu serve`` runs it under Uvicorn. Needs the
``aimu[serve]`` extra; the application is imported on first use, so the ``aimu`` command
line works without it.

Why Starlette and Uvicorn: Starlette is a small ASGI toolkit with no opinion on models
or validation, so the API stays ours (a hand-written OpenAPI document, plain-dict JSON
like the rest of aimu) with nothing generated behind it; under Uvicorn its streaming
response watches for the client going away, which is all Server-Sent Events need, so no
SSE package is added. Uvicorn is the common production ASGI server and starts
in-process for tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aimu.serve.application import DEFAULT_MAX_BODY, ServeApp, app

__all__ = ["DEFAULT_MAX_BODY", "ServeApp", "app"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'aimu.serve' has no attribute {name!r}")
    try:
        module = importlib.import_module("aimu.serve.application")
    except ImportError as missing:
        if missing.name not in ("starlette", "uvicorn") and not str(missing.name).startswith(
            ("starlette.", "uvicorn.")
        ):
            raise
        raise ImportError(
            f"aimu.serve needs the serve extra ({missing.name} is missing): "
            "pip install 'aimu[serve]'"
        ) from missing
    value = getattr(module, name)
    globals()[name] = value
    return value
