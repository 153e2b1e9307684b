"""Chain: steps in order, each step's answer the next step's task."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aimu.aio.events import RunStatus
from aimu.aio.scope import RunScope
from aimu.aio.workflows._base import Step, Workflow, _Slot, check_step, interrupted

__all__ = ["Chain"]


class Chain(Workflow):
    """Run ``steps`` in order: the task goes to the first, each answer to the next.

    The final answer is the last step's. Each step runs in its own session of its agent
    (or its own copy of a nested workflow), so one agent may appear in several steps.
    """

    kind = "chain"

    def __init__(self, steps: Sequence[Step], *, name: str | None = None) -> None:
        super().__init__(name)
        if isinstance(steps, str | bytes) or not isinstance(steps, Sequence):
            raise TypeError(f"Chain takes a list of steps, got {type(steps).__name__}")
        if not steps:
            raise ValueError("Chain needs at least one step")
        self._steps = tuple(check_step(s, f"Chain step {i + 1}") for i, s in enumerate(steps))
        self._chain = self._new_slots()

    @property
    def steps(self) -> tuple[Step, ...]:
        return self._steps

    def start(self) -> Chain:
        return Chain(self._steps, name=self._name)

    def _new_slots(self) -> list[_Slot]:
        return [_Slot(step, f"step {i + 1}") for i, step in enumerate(self._steps)]

    def _fresh(self) -> None:
        self._chain = self._new_slots()

    def _slots(self) -> list[_Slot]:
        return self._chain

    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        text = task
        for slot in self._chain:
            if not slot.finished:
                if scope.interrupt_requested:
                    return interrupted(scope)
                if await slot.run(text) is None:
                    return interrupted(scope)
                self._step_finished(scope)
            text = slot.answer
        return "completed", text

    def _progress(self) -> dict[str, Any]:
        return {"steps": [slot.record() for slot in self._chain]}

    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        records = state.get("steps")
        if not isinstance(records, list):
            raise ValueError(f"{self._where()}: the state has no 'steps' list")
        if len(records) != len(self._steps):
            raise ValueError(
                f"{self._where()} has {len(self._steps)} steps and the state has "
                f"{len(records)}; restore it into a chain of the same shape"
            )
        slots = [
            _Slot.load(step, f"step {i + 1}", record, f"{self._where()} step {i + 1}")
            for i, (step, record) in enumerate(zip(self._steps, records, strict=True))
        ]

        def commit() -> None:
            self._chain = slots

        return commit
