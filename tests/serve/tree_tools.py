"""An agent called as a tool, for ``aimu serve --tool tests.serve.tree_tools:helper`` in
the recovery tests: ``helper`` runs on the loopback model (``OPENAI_BASE_URL``, which
:func:`tests.serve.harness.aimu_serve` sets) with the tools of
:mod:`tests.serve.recover_tools`, under its own name and system prompt. Imported only by
the server processes (building the agent makes a model client)."""

from __future__ import annotations

from aimu import aio
from tests.serve.recover_tools import held, held_once

HELPER_SYSTEM = "You are the helper agent."

helper = aio.Agent(
    aio.client("openai:loop"), [held, held_once], name="helper", system=HELPER_SYSTEM
).as_tool(name="helper")
