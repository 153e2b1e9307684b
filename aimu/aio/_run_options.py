"""What one call of ``run()`` / ``resume()`` gives a run (:class:`RunOptions`), found by
the runs inside it through the scopes around them (:func:`options_in`), and when a run
started (:class:`RunClock`): what :class:`~aimu.aio.runnable.Runnable` and the steps of
an agent's run share, below both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aimu.aio.limits import SharedBudget, UsageLimits
from aimu.aio.scope import RunScope

__all__ = ["NO_DEPS", "NO_OPTIONS", "RunClock", "RunOptions", "options_in"]


class _NoDeps:
    """The ``deps`` of a run given none: the agent's own apply."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_DEPS"


NO_DEPS: Any = _NoDeps()


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What one call of ``run()`` / ``resume()`` adds to the configuration: its limits
    (for a workflow: the total of every agent run inside it), deps (for a workflow, every
    agent run inside uses them), images beside the task, and whether a resume continues
    a cut answer."""

    limits: UsageLimits | None = None
    deps: object = NO_DEPS
    #: The images beside the task, checked, as ``data:`` URLs.
    images: tuple[str, ...] = ()
    continue_partial: bool = False
    #: A workflow run's ``limits``, with what the agent runs inside spend together.
    shared: SharedBudget | None = None


NO_OPTIONS = RunOptions()


def options_in(scope: RunScope | None) -> RunOptions:
    """The options of the nearest run around ``scope`` that was given some."""
    while scope is not None:
        options = scope.options
        if isinstance(options, RunOptions) and options is not NO_OPTIONS:
            return options
        scope = scope.parent
    return NO_OPTIONS


class RunClock:
    """When a run started, on the monotonic clock and the wall clock."""

    __slots__ = ("monotonic", "wall")

    def __init__(self) -> None:
        self.monotonic = time.monotonic()
        self.wall = time.time()

    def span(self) -> tuple[float, float, float]:
        """``(duration, started_at, ended_at)`` as of now: seconds, then wall-clock times."""
        duration = time.monotonic() - self.monotonic
        return duration, self.wall, self.wall + duration
