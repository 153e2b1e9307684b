"""Workflows: compositions of agents that stop cleanly and resume from the step they were in.

``Chain``, ``Router``, ``Parallel`` and ``EvaluatorOptimizer`` each have ``run(task)``
(``stream=True`` for events), ``interrupt()``, a JSON-serialisable ``state``,
``restore(state)`` and ``resume()``. A step is an :class:`~aimu.aio.Agent` or another
workflow; every step runs in its own session.
"""

from __future__ import annotations

from aimu.aio.workflows._base import STATE_VERSION, Resumable, SlotStatus, Step, Workflow
from aimu.aio.workflows.chain import Chain
from aimu.aio.workflows.evaluator import EvaluatorOptimizer, is_accepted
from aimu.aio.workflows.parallel import Parallel, labelled
from aimu.aio.workflows.router import Router

__all__ = [
    "STATE_VERSION",
    "Chain",
    "EvaluatorOptimizer",
    "Parallel",
    "Resumable",
    "Router",
    "SlotStatus",
    "Step",
    "Workflow",
    "is_accepted",
    "labelled",
]
