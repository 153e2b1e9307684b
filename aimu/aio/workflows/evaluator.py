"""EvaluatorOptimizer: draft, evaluate, revise, until accepted or out of rounds."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

from aimu.aio.events import RunStatus
from aimu.aio.scope import RunScope
from aimu.aio.workflows._base import (
    Step,
    Workflow,
    _Slot,
    call_user_function,
    check_step,
    expect_dict,
    function_record,
    interrupted,
    load_function_record,
    step_or_function,
)

__all__ = [
    "EvaluateFunction",
    "EvaluatorOptimizer",
    "evaluate_prompt",
    "is_accepted",
    "revise_prompt",
]

#: Judges a draft: ``(task, draft) -> (accepted, feedback)``; sync or async.
EvaluateFunction: TypeAlias = Callable[
    [str, str], tuple[bool, str] | Awaitable[tuple[bool, str]]
]

# "ACCEPT", "Accepted.", "**ACCEPT**": the first word, whatever decorates it.
_ACCEPT = re.compile(r"[\W_]*accept(?:ed)?\b", re.IGNORECASE)


def is_accepted(reply: str) -> bool:
    """True when an evaluating agent's reply starts with the word ACCEPT (any case)."""
    return _ACCEPT.match(reply) is not None


def evaluate_prompt(task: str, draft: str) -> str:
    """What an evaluating agent is asked about one draft."""
    return (
        f"Task:\n{task}\n\nAnswer to review:\n{draft}\n\n"
        "If the answer does the task well, reply with the single word ACCEPT. "
        "Otherwise reply with feedback saying what to change."
    )


def revise_prompt(task: str, draft: str, feedback: str) -> str:
    """What the generator is asked in every round after the first."""
    return (
        f"{task}\n\nYour previous answer:\n{draft}\n\nFeedback on it:\n{feedback}\n\n"
        "Write an improved answer."
    )


class _Round:
    __slots__ = ("accepted", "evaluate", "feedback", "generate")

    def __init__(self, generate: _Slot, evaluate: _Slot | None) -> None:
        self.generate = generate
        self.evaluate = evaluate
        self.accepted: bool | None = None
        self.feedback: str | None = None


class EvaluatorOptimizer(Workflow):
    """The generator drafts; the evaluator accepts the draft or gives feedback for the next.

    Each round runs a fresh generator session (from round 2 it is asked with the task,
    its previous draft and the feedback) and a fresh evaluator session. An evaluating
    agent accepts with a reply starting with ACCEPT; anything else is the feedback. A
    function evaluator returns ``(accepted, feedback)``. The answer is the accepted
    draft, or the last one after ``max_rounds`` (status ``max_rounds``).
    """

    kind = "evaluator_optimizer"

    def __init__(
        self,
        generator: Step,
        evaluator: Step | EvaluateFunction,
        *,
        max_rounds: int = 3,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        if isinstance(max_rounds, bool) or not isinstance(max_rounds, int) or max_rounds < 1:
            raise ValueError(f"max_rounds must be a positive int, got {max_rounds!r}")
        self._generator = check_step(generator, "EvaluatorOptimizer generator")
        self._evaluator_step, self._evaluator_function = step_or_function(
            evaluator, "evaluator", "(task, draft) -> (accepted, feedback)"
        )
        self._evaluator_arg = evaluator
        self.max_rounds = max_rounds
        self._rounds: list[_Round] = []

    def start(self) -> EvaluatorOptimizer:
        return EvaluatorOptimizer(self._generator, self._evaluator_arg,
                                  max_rounds=self.max_rounds, name=self._name)

    @property
    def rounds(self) -> int:
        """Rounds begun in the current or last run."""
        return len(self._rounds)

    def _new_round(self, index: int) -> _Round:
        step = self._evaluator_step
        return _Round(
            _Slot(self._generator, f"round {index + 1} generator"),
            None if step is None else _Slot(step, f"round {index + 1} evaluator"),
        )

    def _fresh(self) -> None:
        self._rounds = []

    def _slots(self) -> list[_Slot]:
        slots: list[_Slot] = []
        for round_ in self._rounds:
            slots.append(round_.generate)
            if round_.evaluate is not None:
                slots.append(round_.evaluate)
        return slots

    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        for index in range(self.max_rounds):
            if index == len(self._rounds):
                if scope.interrupt_requested:
                    return interrupted(scope)
                self._rounds.append(self._new_round(index))
            round_ = self._rounds[index]
            generate = round_.generate
            if index == 0:
                prompt = task
            else:
                previous = self._rounds[index - 1]
                prompt = revise_prompt(task, previous.generate.answer, previous.feedback or "")
            if not await self._step(generate, prompt, scope):
                return interrupted(scope)
            draft = generate.answer
            if round_.accepted is None:
                evaluate = round_.evaluate
                if evaluate is not None:
                    if scope.interrupt_requested:
                        return interrupted(scope)
                    verdict = await evaluate.run(evaluate_prompt(task, draft))
                    if verdict is None:
                        return interrupted(scope)
                    round_.accepted, round_.feedback = is_accepted(verdict), verdict.strip()
                    self._step_finished(scope)
                else:
                    assert self._evaluator_function is not None
                    round_.accepted, round_.feedback = self._check_verdict(
                        await call_user_function(self._evaluator_function, task, draft)
                    )
            if round_.accepted:
                return self._answered(draft, generate)
        last = self._rounds[-1].generate
        self._reply_slots = (last,)  # its stop reason is the run's
        return "max_rounds", last.answer

    def _check_verdict(self, verdict: object) -> tuple[bool, str]:
        if (
            not isinstance(verdict, tuple)
            or len(verdict) != 2
            or not isinstance(verdict[0], bool)
            or not isinstance(verdict[1], str)
        ):
            raise TypeError(
                f"{self._where()}: the evaluator must return (accepted: bool, feedback: str), "
                f"got {verdict!r}"
            )
        return verdict[0], verdict[1]

    def _progress(self) -> dict[str, Any]:
        rounds = []
        for round_ in self._rounds:
            evaluate = round_.evaluate
            rounds.append({
                "generate": round_.generate.record(),
                "evaluate": (
                    function_record(round_.feedback) if evaluate is None else evaluate.record()
                ),
                "accepted": round_.accepted,
                "feedback": round_.feedback,
            })
        return {"max_rounds": self.max_rounds, "rounds": rounds}

    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        where = self._where()
        if state.get("max_rounds") != self.max_rounds:
            raise ValueError(
                f"{where} has max_rounds={self.max_rounds} and the state has "
                f"max_rounds={state.get('max_rounds')!r}; build it with the same max_rounds"
            )
        records = state.get("rounds")
        if not isinstance(records, list) or len(records) > self.max_rounds:
            raise ValueError(f"{where}: 'rounds' must be a list of at most "
                             f"{self.max_rounds} rounds")
        rounds: list[_Round] = []
        for index, raw in enumerate(records):
            at = f"{where} round {index + 1}"
            record = expect_dict(raw, at)
            fresh = self._new_round(index)
            generate = _Slot.load(self._generator, fresh.generate.label, record.get("generate"),
                                  f"{at} generator")
            evaluate_record = expect_dict(record.get("evaluate"), f"{at}: 'evaluate'")
            evaluate: _Slot | None = None
            if fresh.evaluate is not None:
                evaluate = _Slot.load(fresh.evaluate.step, fresh.evaluate.label,
                                      evaluate_record, f"{at} evaluator")
            else:
                load_function_record(evaluate_record, at, "evaluates", "evaluator")
            round_ = _Round(generate, evaluate)
            accepted, feedback = record.get("accepted"), record.get("feedback")
            if accepted is not None:
                if not isinstance(accepted, bool) or not isinstance(feedback, str):
                    raise ValueError(f"{at}: 'accepted' must be a bool and 'feedback' a string")
                round_.accepted, round_.feedback = accepted, feedback
            rounds.append(round_)

        def commit() -> None:
            self._rounds = rounds

        return commit
