"""aimu runs on Temporal: workers on any host, stops that land in milliseconds.

:class:`AgentWorker` executes runs from a Temporal task queue (``aimu worker`` on the
command line); :class:`RunsClient` starts them and steers them by run id from any
process (``aimu serve --temporal`` on top of it). A run is one workflow; the agent loop
runs in an activity; the transcript lives in aimu's store, so a worker that dies
hands its run to another one that resumes it from the store. Needs ``aimu-agents[temporal]``.
See docs/how-to/temporal.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aimu._extras import needs_extra

if TYPE_CHECKING:
    from aimu.temporal._client import RequestRefused, RunsClient
    from aimu.temporal._worker import AgentWorker

__all__ = ["AgentWorker", "RequestRefused", "RunsClient"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `aimu worker`'s options (aimu.temporal._command) load without the
    # extra: `aimu --help` and `aimu chat` must work on a plain install.
    if name not in __all__:
        raise AttributeError(f"module 'aimu.temporal' has no attribute {name!r}")
    with needs_extra("aimu.temporal", "temporal"):
        import temporalio  # noqa: F401
    from aimu.temporal import _client, _worker

    return {"AgentWorker": _worker.AgentWorker, "RequestRefused": _client.RequestRefused,
            "RunsClient": _client.RunsClient}[name]
