"""AgentWorker: runs the aimu runs of a Temporal task queue in this process.

Any number of workers on any hosts share a task queue; each takes runs up to its
``concurrency``. The workers and the servers that start runs must share the store
(PostgreSQL across hosts) and, for stops that land at once, the Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Final

from temporalio.client import Client
from temporalio.worker import UnsandboxedWorkflowRunner, Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from aimu._hosting import AgentFactory
from aimu.aio._numbers import finite
from aimu.temporal._activities import Activities
from aimu.temporal._connect import connect
from aimu.temporal._workflow import RunWorkflow

if TYPE_CHECKING:
    from aimu.aio.control import RedisControl
    from aimu.aio.store import Store

__all__ = ["AgentWorker"]

#: The workflow runs in Temporal's sandbox, but aimu's modules pass through it: the
#: workflow module is deterministic and keeps no module state, and importing the
#: ``aimu`` package (its client, worker and agent modules) afresh in the sandbox for
#: every workflow run cost about a second a run on a loaded 2-core machine.
_RUNNER: Final = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules("aimu")
)

_log = logging.getLogger("aimu.temporal")
#: Workflows a worker keeps cached at least (Temporal's default), twice its concurrency
#: if more.
_CACHED_WORKFLOWS: Final = 1000
#: Seconds past the drain a cancelled turn gets to settle before Temporal's own cancel.
_SETTLE_SECONDS: Final = 30.0


class AgentWorker:
    """Executes aimu runs from ``task_queue`` on the Temporal server at ``temporal``.

    ``agents`` builds the agent of a session's run on ``store`` (see
    :func:`aimu.serve.agents.agent_factory`); ``redis`` (a RedisControl) registers each
    run so a cancel, interrupt or stop lands at once. ``heartbeat`` is how often a running
    turn heartbeats and reads its controls (interrupt, stop, send): a cancel through
    Temporal alone lands within about that. With many turns running each does both less
    often: the turns of one worker read their controls 100 times a second at most
    together, and heartbeat 200 times (but at least three times a heartbeat timeout).
    ``drain``: when the worker stops (:meth:`aclose`) it takes no new task, interrupts
    its runs at their next step boundary, gives them ``drain`` seconds to get there, then
    cancels what is left (:meth:`hurry`: at once); each run goes on from there on another
    worker. ``sandboxed=False`` runs aimu's workflow outside Temporal's sandbox (which
    checks workflow code for non-deterministic calls each time it runs): 3 ms less of
    the worker's CPU a one-turn run, measured (``bench_temporal_throughput.py``); the
    workflow is aimu's own and holds no module state. Use ``async with
    AgentWorker(...) as worker:`` or ``await worker.run()`` (until cancelled).
    """

    def __init__(
        self,
        agents: AgentFactory,
        store: Store,
        *,
        temporal: str | Client,
        task_queue: str,
        namespace: str = "default",
        redis: RedisControl | None = None,
        concurrency: int = 10,
        heartbeat: float = 0.25,
        drain: float = 0.0,
        sandboxed: bool = True,
    ) -> None:
        if not task_queue:
            raise ValueError("AgentWorker needs a task_queue: the queue its runs are started on")
        if concurrency < 1:
            raise ValueError(f"AgentWorker(concurrency={concurrency!r}): give 1 or more")
        if not (finite(heartbeat) and heartbeat > 0):
            raise ValueError(f"AgentWorker(heartbeat={heartbeat!r}): give seconds above 0")
        if not (finite(drain) and drain >= 0):
            raise ValueError(f"AgentWorker(drain={drain!r}): give seconds, 0 or more")
        self._temporal = temporal
        self.task_queue = task_queue
        self.namespace = namespace
        self.concurrency = concurrency
        self.heartbeat = heartbeat
        self.drain = drain
        self.sandboxed = sandboxed
        self._activities = Activities(agents, store, control=redis, tick=heartbeat)
        self._worker: Worker | None = None
        self._running: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect (a clear error naming the address if Temporal does not answer), then
        poll the task queue in the background."""
        client = await connect(self._temporal, self.namespace)
        self._worker = Worker(
            client,
            task_queue=self.task_queue,
            workflows=[RunWorkflow],
            activities=list(self._activities.all()),
            max_concurrent_activities=self.concurrency,
            # Every run's workflow stays cached (the SDK's default is 1,000: at 1,000 runs
            # each query or signal of one evicted replayed its whole history).
            max_cached_workflows=max(_CACHED_WORKFLOWS, 2 * self.concurrency),
            max_heartbeat_throttle_interval=timedelta(seconds=self.heartbeat),
            default_heartbeat_throttle_interval=timedelta(seconds=self.heartbeat),
            # The drain (aclose) interrupts, then cancels, the turns itself: Temporal's own
            # cancel at shutdown is the backstop for a turn that would not end.
            graceful_shutdown_timeout=timedelta(seconds=self.drain + _SETTLE_SECONDS),
            workflow_runner=_RUNNER if self.sandboxed else UnsandboxedWorkflowRunner(),
        )
        self._running = asyncio.create_task(self._worker.run(), name="aimu temporal worker")

    async def run(self) -> None:
        """Start (unless started), then work until cancelled; then drain (see
        :meth:`aclose`)."""
        if self._running is None:
            await self.start()
        assert self._running is not None
        try:
            await asyncio.shield(self._running)
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Drain: take no new task, interrupt the runs in progress at their next step
        boundary, cancel those still going ``drain`` seconds later (or at :meth:`hurry`),
        and return once each ended; each goes on from there on another worker."""
        worker, self._worker = self._worker, None
        running, self._running = self._running, None
        if worker is not None:
            shutdown = asyncio.ensure_future(worker.shutdown())  # polls no more at once
            try:
                await self._activities.drain(self.drain)
            finally:
                with contextlib.suppress(Exception):
                    await shutdown
        if running is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await running

    def hurry(self) -> None:
        """Cancel the runs in progress now (a second signal during :meth:`aclose`'s drain,
        or before it): they go on on another worker, from where they were cancelled."""
        self._activities.hurry()

    async def __aenter__(self) -> AgentWorker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

