"""Router: a classifier names a route; the task goes to that route only."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeAlias

from aimu.aio.events import RunStatus
from aimu.aio.scope import RunScope
from aimu.aio.workflows._base import (
    Step,
    Workflow,
    _Slot,
    call_for_text,
    check_step,
    expect_dict,
    function_record,
    interrupted,
    load_function_record,
    step_or_function,
)

__all__ = ["ClassifierFunction", "Router", "classifier_prompt"]

#: Names the route for a task; sync or async.
ClassifierFunction: TypeAlias = Callable[[str], str | Awaitable[str]]

_DECORATION = " \t\r\n\"'`*."


def classifier_prompt(task: str, routes: list[str]) -> str:
    """What a classifying agent is asked: the route names, then the task."""
    names = ", ".join(routes)
    return (
        f"Which route fits this task best? Reply with only the route's name, one of: "
        f"{names}.\n\nTask:\n{task}"
    )


class Router(Workflow):
    """Send the task to the one route ``classifier`` names; its answer is the answer.

    ``classifier`` is an agent or workflow (its answer, stripped of spaces, quotes and
    a final period, names the route; case is ignored when no name matches exactly) or
    a function ``(task) -> str``. An unknown name goes to ``default``, or raises
    ``ValueError`` listing the routes.
    """

    kind = "router"

    def __init__(
        self,
        routes: Mapping[str, Step],
        *,
        classifier: Step | ClassifierFunction,
        default: str | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name)
        if not isinstance(routes, Mapping):
            raise TypeError(f"Router takes routes as a dict of name to step, got "
                            f"{type(routes).__name__}")
        if not routes:
            raise ValueError("Router needs at least one route")
        for key in routes:
            if not isinstance(key, str) or not key.strip():
                raise ValueError(f"route names must be non-empty strings, got {key!r}")
        self._routes = {key: check_step(step, f"Router route {key!r}")
                        for key, step in routes.items()}
        if default is not None and default not in self._routes:
            raise ValueError(
                f"default={default!r} is not a route; routes: {self._route_list()}"
            )
        self._default = default
        self._classifier_step, self._classifier_function = step_or_function(
            classifier, "classifier", "(task) -> route name"
        )
        self._classifier_arg = classifier
        self._fresh()

    @property
    def routes(self) -> dict[str, Step]:
        return dict(self._routes)

    @property
    def route(self) -> str | None:
        """The route the current or last run took (None until the classifier answered)."""
        return self._route

    def start(self) -> Router:
        return Router(self._routes, classifier=self._classifier_arg, default=self._default,
                      name=self._name)

    def _route_list(self) -> str:
        return ", ".join(repr(key) for key in self._routes)

    def _fresh(self) -> None:
        step = self._classifier_step
        self._classifier = None if step is None else _Slot(step, "classifier")
        self._choice: str | None = None
        self._route: str | None = None
        self._lanes = {key: _Slot(step, f"route {key!r}") for key, step in self._routes.items()}

    def _slots(self) -> list[_Slot]:
        slots = list(self._lanes.values())
        return slots if self._classifier is None else [self._classifier, *slots]

    def resolve(self, choice: str) -> str:
        """The route that the classifier's answer ``choice`` names; ValueError if none."""
        cleaned = choice.strip(_DECORATION)
        if cleaned in self._routes:
            return cleaned
        folded = [key for key in self._routes if key.casefold() == cleaned.casefold()]
        if len(folded) == 1:
            return folded[0]
        if self._default is not None:
            return self._default
        raise ValueError(
            f"{self._where()}: the classifier chose {choice!r}, which is not a route; "
            f"valid routes: {self._route_list()} (give default= to send such tasks to one)"
        )

    async def _execute(self, task: str, scope: RunScope) -> tuple[RunStatus, str]:
        if self._route is None:
            if self._choice is None:
                classifier = self._classifier
                if classifier is not None:
                    prompt = classifier_prompt(task, list(self._routes))
                    if not await self._step(classifier, prompt, scope):
                        return interrupted(scope)
                    self._choice = classifier.answer
                else:
                    assert self._classifier_function is not None
                    self._choice = await call_for_text(
                        self._classifier_function, task,
                        must=f"{self._where()}: the classifier must return a route name "
                        "(a string)",
                    )
            self._route = self.resolve(self._choice)
        lane = self._lanes[self._route]
        if not await self._step(lane, task, scope):
            return interrupted(scope)
        return self._answered(lane.answer, lane)

    def _progress(self) -> dict[str, Any]:
        classifier = self._classifier
        record = function_record(self._choice) if classifier is None else classifier.record()
        return {
            "classifier": record,
            "route": self._route,
            "routes": {key: slot.record() for key, slot in self._lanes.items()},
        }

    def _load(self, state: Mapping[str, Any]) -> Callable[[], None]:
        where = self._where()
        records = expect_dict(state.get("routes"), f"{where}: 'routes'")
        if set(records) != set(self._routes):
            raise ValueError(
                f"{where} has routes {sorted(self._routes)} and the state has "
                f"{sorted(records)}; restore it into a Router with the same routes"
            )
        lanes = {
            key: _Slot.load(step, f"route {key!r}", records[key], f"{where} route {key!r}")
            for key, step in self._routes.items()
        }
        record = expect_dict(state.get("classifier"), f"{where}: 'classifier'")
        classifier: _Slot | None = None
        choice: str | None = None
        if self._classifier_step is not None:
            classifier = _Slot.load(self._classifier_step, "classifier", record,
                                    f"{where} classifier")
            choice = classifier.answer if classifier.finished else None
        else:
            choice = load_function_record(record, where, "classifies", "classifier")
        route = state.get("route")
        if route is not None and route not in self._routes:
            raise ValueError(f"{where}: the state's route {route!r} is not one of "
                             f"{self._route_list()}")

        def commit() -> None:
            self._classifier, self._choice, self._route, self._lanes = (
                classifier, choice, route, lanes,
            )

        return commit
