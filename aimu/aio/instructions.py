"""Instructions per run: ``system=`` as text, or a function giving it at each run start.

The function (sync or async) receives a :class:`RunContext` and returns the system
prompt; the agent evaluates it before anything of the run is recorded, and puts the
text it sent first in the transcript. A function that raises fails the run before
its first request, with nothing stored.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias

from typing_extensions import TypeVar

__all__ = ["Instructions", "RunContext", "check_instructions", "instructions_text"]

DepsT = TypeVar("DepsT", default=Any)


@dataclass(frozen=True, slots=True)
class RunContext(Generic[DepsT]):
    """What a ``system=`` function knows of the run starting: the agent's name, its
    store session (if any), the task (None for a resume) and the run's ``deps``."""

    agent: str
    session: str | None
    task: str | None
    deps: DepsT
    #: The session's shared state (``agent.set_shared_state()``), if it has one.
    shared_state: dict[str, Any] | None = None


#: ``system=``: the text, or a function of the run's context returning it (or awaitable).
Instructions: TypeAlias = str | Callable[[RunContext[Any]], str | Awaitable[str]]


def check_instructions(system: object) -> None:
    """TypeError unless ``system`` is None, text, or a callable."""
    if system is not None and not isinstance(system, str) and not callable(system):
        raise TypeError(
            "system must be a string, a function of the run's context returning one, or "
            f"None; got {type(system).__name__}"
        )


async def instructions_text(
    system: Callable[[RunContext[Any]], str | Awaitable[str]],
    context: RunContext[Any],
    agent: str,
) -> str:
    """The text ``system`` gives for ``context``; its own error (noted with the agent's
    name) if it raises, TypeError if it gives no text."""
    try:
        text = system(context)
        if inspect.isawaitable(text):
            text = await text
    except Exception as error:
        error.add_note(f"raised by the system= function of agent {agent!r} at the run's start")
        raise
    if not isinstance(text, str):
        raise TypeError(
            f"agent {agent!r}: the system= function must return the text (str), got "
            f"{type(text).__name__}"
        )
    return text
