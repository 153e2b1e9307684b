"""Chain: steps in order, each step's answer the next step's task."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aimu.aio.events import RunStatus
from aimu.aio.scope import RunScope
from aimu.aio.workflows._base import (
    Step,
    Workflow,
    _Slot,
    check_steps,
    interrupted,
    load_numbered_slots,
    numbered_slots,
)

__all__ = ["Chain"]


class Chain(Workflow):
    """Run ``steps`` in order: the task goes to the first, each answer to the next.

    The final answer is the last step's. Each step runs in its own session of its agent
    (or its own copy of a nested workflow), so one agent may appear in several steps.
    """

    kind = "chain"

    def __init__(self, steps: Sequence[Step], *, name: str | None = None) -> None:
        super().__init__(name)
        self._steps = check_steps(steps, "Chain", "step", "steps")
        self._fresh()

    @property
    def steps(self) -> tuple[Step, ...]:
        return self._steps

    def start(self) -> Chain:
        return Chain(self._steps, name=self._name)

    def _fresh(self) -> None:
        self._chain = numbered_slots(self._steps, "step")

    def _slots(self) -> list[_Slot]:
        return self._chain

    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        text = task
        for slot in self._chain:
            if not await self._step(slot, text, scope):
                return interrupted(scope)
            text = slot.answer
        return self._answered(text, self._chain[-1])

    def _progress(self) -> dict[str, Any]:
        return {"steps": [slot.record() for slot in self._chain]}

    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        slots = load_numbered_slots(self._steps, state, "steps", "step", self._where())

        def commit() -> None:
            self._chain = slots

        return commit
