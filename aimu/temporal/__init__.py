"""aimu runs on Temporal: workers on any host, stops that land in milliseconds.

:class:`AgentWorker` executes runs from a Temporal task queue (``aimu worker`` on the
command line); :class:`RunsClient` starts them and steers them by run id from any
process (``aimu serve --temporal`` on top of it). A run is one workflow; the agent loop
runs in an activity; the transcript lives in aimu's store, so a worker that dies
hands its run to another one that resumes it from the store. Needs ``aimu[temporal]``.
See docs/how-to/temporal.md.
"""

from __future__ import annotations

from aimu._extras import needs_extra

with needs_extra("aimu.temporal", "temporal"):
    import temporalio  # noqa: F401

from aimu.temporal._client import RequestRefused, RunsClient
from aimu.temporal._worker import AgentWorker

__all__ = ["AgentWorker", "RequestRefused", "RunsClient"]
