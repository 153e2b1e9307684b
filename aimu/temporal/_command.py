"""The ``aimu worker`` command: an AgentWorker with the agent options of ``aimu serve``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from aimu._agent_options import add_agent_options, add_drain_options, agent_tools, seconds
from aimu._bounded_exit import DRAIN_MARGIN, exit_deadline, owning_the_exit
from aimu._extras import has_extra, missing_extra
from aimu._hosting import AgentFactory, Closer, agent_factory, open_store
from aimu._limit_options import add_session_limit_options, limits_from, session_limits_from
from aimu._logs import logging_to
from aimu._mcp_options import mcp_servers, open_all
from aimu.aio.errors import ControlConnectionError, MCPServerError
from aimu.aio.tools import Toolset

if TYPE_CHECKING:
    from aimu.aio.store import Store
    from aimu.temporal._worker import AgentWorker

__all__ = ["add_worker_options", "run_worker"]


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``aimu worker`` to ``parser``."""
    parser.add_argument("--temporal", required=True, metavar="HOST:PORT",
                        help="the Temporal server (frontend) to take runs from")
    parser.add_argument("--task-queue", required=True, metavar="QUEUE",
                        help="the task queue `aimu serve --temporal` starts runs on")
    parser.add_argument("--namespace", default="default", help="Temporal namespace (default)")
    add_agent_options(parser, "aimu's log records")
    parser.add_argument("--concurrency", type=int, default=10, metavar="N",
                        help="runs this worker executes at once (default 10)")
    parser.add_argument("--heartbeat", type=seconds("--heartbeat", zero=False), default=0.25,
                        metavar="SECONDS",
                        help="how often a run heartbeats and reads its controls (default 0.25)")
    parser.add_argument("--no-sandbox", dest="sandboxed", action="store_false",
                        help="run aimu's workflow outside Temporal's sandbox (less CPU a run; "
                             "the sandbox's checks of workflow code are skipped)")
    add_drain_options(parser, "worker")
    add_session_limit_options(parser)


def run_worker(options: argparse.Namespace) -> int:
    """Work until SIGINT or SIGTERM; return the exit status."""
    if not has_extra("temporal"):
        print(f"{missing_extra('aimu worker', 'temporal')}", file=sys.stderr)
        return 2
    try:
        tools: list[Any] = [*agent_tools(options), *mcp_servers(options.mcp, options.mcp_url)]
    except ValueError as error:
        print(f"aimu worker: {error}", file=sys.stderr)
        return 2
    if options.concurrency < 1:
        print(f"aimu worker: --concurrency {options.concurrency} must be 1 or more",
              file=sys.stderr)
        return 2
    try:
        with logging_to(sys.stderr, options.log_level):
            # A sync tool's thread still running once the worker is done holds no exit.
            return asyncio.run(owning_the_exit(_work(options, tools), "aimu worker"))
    except KeyboardInterrupt:
        return 130
    except (ControlConnectionError, MCPServerError) as error:
        print(f"aimu worker: {error}", file=sys.stderr)
        return 1


def worker_agents(
    options: argparse.Namespace, store: Store, tools: Sequence[Any]
) -> tuple[AgentFactory, Closer]:
    """The agents a worker runs: its model, tools, system prompt and budgets (each
    run's --max-*, each session's --session-max-*)."""
    return agent_factory(options.model, store, tools=tools, system=options.system,
                         limits=limits_from(options),
                         session_limits=session_limits_from(options))


async def _work(options: argparse.Namespace, tools: Sequence[Any]) -> int:
    from aimu.temporal._worker import AgentWorker

    store, close_store = open_store(options.store)
    agents, close_model = worker_agents(options, store, tools)
    control = None
    toolsets = [t for t in tools if isinstance(t, Toolset)]
    try:
        await open_all(toolsets)  # --mcp, --mcp-url: one that cannot start ends it here
        if options.redis:
            from aimu.aio.control import RedisControl

            control = RedisControl(options.redis, options.redis_prefix)
            await control.connect()
        worker = AgentWorker(
            agents, store, temporal=options.temporal, task_queue=options.task_queue,
            namespace=options.namespace, redis=control, concurrency=options.concurrency,
            heartbeat=options.heartbeat, drain=options.drain, sandboxed=options.sandboxed,
        )
        with _signals(worker, options.drain):
            await worker.start()
            print(f"aimu worker: taking runs from {options.temporal} queue "
                  f"{options.task_queue!r}", file=sys.stderr, flush=True)
            with contextlib.suppress(asyncio.CancelledError):
                await worker.run()
        return 0
    finally:
        for toolset in toolsets:
            await toolset.aclose()
        if control is not None:
            await control.aclose()
        await close_model()
        if close_store is not None:
            await close_store()


@contextlib.contextmanager
def _signals(worker: AgentWorker, drain: float) -> Iterator[None]:
    """SIGTERM drains the worker (its runs stop at their next step boundary, those left
    after ``drain`` seconds are cancelled); SIGINT, or a second signal, cancels them at
    once. Either way the worker then exits 0 and its runs go on on another worker."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    signalled: list[int] = []
    deadline: list[Callable[[], None]] = []

    def on_signal(sig: int) -> None:
        if signalled or sig != signal.SIGTERM or drain == 0:
            worker.hurry()
            print("aimu worker: stopping: the runs in progress are cancelled now",
                  file=sys.stderr, flush=True)
        else:
            print(f"aimu worker: draining: no new runs; the runs in progress stop within "
                  f"{drain:g} s", file=sys.stderr, flush=True)
            # Whatever holds it then (a run that does not settle), the process exits.
            deadline.append(exit_deadline(drain + DRAIN_MARGIN, "aimu worker"))
        if not signalled:
            task.cancel()  # worker.run() ends by draining the worker
        signalled.append(sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        for cancel in deadline:  # the worker is done (a caller in a test goes on)
            cancel()
