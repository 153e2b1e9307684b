"""Parallel: the same task to every branch at once, under one TaskGroup."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeAlias

from aimu.aio.events import RunStatus
from aimu.aio.scope import RunScope
from aimu.aio.workflows._base import (
    Step,
    Workflow,
    _Slot,
    call_for_text,
    check_steps,
    expect_dict,
    function_record,
    interrupted,
    load_function_record,
    load_numbered_slots,
    numbered_slots,
    step_or_function,
)

__all__ = ["CombineFunction", "Parallel", "labelled"]

#: Merges the branch answers (in branch order) into one; sync or async.
CombineFunction: TypeAlias = Callable[[list[str]], str | Awaitable[str]]


def labelled(names: Sequence[str], answers: Sequence[str]) -> str:
    """The default combine: each answer under a ``[n] name`` label, in branch order."""
    return "\n\n".join(
        f"[{i + 1}] {name}:\n{answer}"
        for i, (name, answer) in enumerate(zip(names, answers, strict=True))
    )


def combine_prompt(task: str, text: str) -> str:
    """What a combining agent is asked."""
    return f"Task:\n{task}\n\nAnswers to combine into one:\n\n{text}"


class Parallel(Workflow):
    """Run ``branches`` concurrently on the same task; ``combine`` merges their answers.

    ``combine`` is an agent or workflow (asked with the task and the labelled answers),
    a function of the answers list, or None for :func:`labelled`. A branch that fails
    cancels the others; the error is raised as is when one branch failed, and as the
    ``ExceptionGroup`` when several did. A cancel cancels every branch.
    """

    kind = "parallel"

    def __init__(
        self,
        branches: Sequence[Step],
        *,
        combine: Step | CombineFunction | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        self._branches = check_steps(branches, "Parallel", "branch", "branches")
        self._combine_step: Step | None = None
        self._combine_function: CombineFunction | None = None
        if combine is not None:
            self._combine_step, self._combine_function = step_or_function(
                combine, "combine", "of the answers"
            )
        self._combine_arg = combine
        self._fresh()

    @property
    def branches(self) -> tuple[Step, ...]:
        return self._branches

    def start(self) -> Parallel:
        return Parallel(self._branches, combine=self._combine_arg, name=self._name)

    def _fresh(self) -> None:
        self._lanes = numbered_slots(self._branches, "branch")
        step = self._combine_step
        self._combiner = None if step is None else _Slot(step, "combine")
        self._combined: str | None = None

    def _slots(self) -> list[_Slot]:
        return self._lanes if self._combiner is None else [*self._lanes, self._combiner]

    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        pending = [slot for slot in self._lanes if not slot.finished]
        if pending:
            if scope.interrupt_requested:
                return interrupted(scope)
            await self._run_branches(pending, task, scope)
            if not all(slot.finished for slot in self._lanes):
                return interrupted(scope)
        answers = [slot.answer for slot in self._lanes]
        combiner = self._combiner
        if combiner is not None:
            text = labelled([s.step.name for s in self._lanes], answers)
            if not await self._step(combiner, combine_prompt(task, text), scope):
                return interrupted(scope)
            return self._answered(combiner.answer, combiner)
        if self._combined is None:
            if self._combine_function is None:
                self._combined = labelled([s.step.name for s in self._lanes], answers)
            else:
                self._combined = await call_for_text(
                    self._combine_function, answers,
                    must=f"{self._where()}: combine must return a string",
                )
        return self._answered(self._combined, *self._lanes)

    async def _run_branches(self, pending: list[_Slot], task: str, scope: RunScope) -> None:
        async def branch(slot: _Slot) -> None:
            if await slot.run(task) is not None:
                self._step_finished(scope)

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(branch(slot), name=f"{self._name} {slot.label}")
                         for slot in pending]
                # Waited for here, not in the group's __aexit__: on Python 3.11 a branch
                # failing during __aexit__ leaves the group's own cancel of this task
                # counted in cancelling(), which would then read as a cancel from outside.
                await asyncio.wait(tasks)
        except BaseExceptionGroup as failures:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # A cancel from outside came too: it wins over the branch errors, which
                # stay on record in each branch's state ("error").
                raise asyncio.CancelledError() from failures
            if len(failures.exceptions) == 1:
                raise failures.exceptions[0] from None
            raise

    def _progress(self) -> dict[str, Any]:
        combiner = self._combiner
        combine = function_record(self._combined) if combiner is None else combiner.record()
        return {"branches": [slot.record() for slot in self._lanes], "combine": combine}

    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        where = self._where()
        lanes = load_numbered_slots(self._branches, state, "branches", "branch", where)
        combine = expect_dict(state.get("combine"), f"{where}: 'combine'")
        combiner: _Slot | None = None
        combined: str | None = None
        if self._combine_step is not None:
            combiner = _Slot.load(self._combine_step, "combine", combine, f"{where} combine")
        else:
            combined = load_function_record(combine, where, "combines", "combine")

        def commit() -> None:
            self._lanes, self._combiner, self._combined = lanes, combiner, combined

        return commit
