"""An agent called as a tool, for ``aimu serve --tool tests.serve.tree_tools:helper`` in
the recovery tests: ``helper`` runs on the loopback model (``OPENAI_BASE_URL``, which
:func:`tests.serve.harness.aimu_serve` sets) with the tools of
:mod:`tests.serve.recover_tools`, under its own name and system prompt. Imported only by
the server processes (building the agent makes a model client)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from aimu import aio
from tests.serve.recover_tools import held, held_once


@aio.tool(idempotent=True)
async def step(n: int) -> str:
    """Take step n (safe to take again after a crash): writes ``entered-step-N`` into the
    directory ``AIMU_TEST_HELD`` names, then waits for the file ``gate-N`` there."""
    where = Path(os.environ["AIMU_TEST_HELD"])
    (where / f"entered-step-{n}").touch()
    gate = where / f"gate-{n}"
    opened = gate.exists()
    while not opened:  # a file another process writes: no event to wait on
        await asyncio.sleep(0.02)
        opened = gate.exists()
    return f"step {n} taken"


HELPER_SYSTEM = "You are the helper agent."

helper = aio.Agent(
    aio.client("openai:loop"), [held, held_once, step], name="helper", system=HELPER_SYSTEM
).as_tool(name="helper")
