"""The budget options of ``aimu chat`` and ``aimu serve``: ``--max-requests`` and kin,
and ``aimu serve``'s ``--session-max-requests`` and kin."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from aimu.aio._numbers import MAX_COUNT
from aimu.aio.limits import UsageLimits

__all__ = [
    "add_limit_options", "add_session_limit_options", "limits_from", "session_limits_from",
]


def _shown(text: str) -> str:
    """``text`` as an error line shows it: a long one cut short."""
    return text if len(text) <= 30 else f"{text[:20]}... ({len(text)} characters)"


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()):  # int() takes '٣', ' 3' and '1_0' too
        raise argparse.ArgumentTypeError(f"must be a whole number like 10, got {_shown(text)}")
    value = int(text)
    if not 0 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**63-1, got {_shown(text)}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds, 0 or more, got {_shown(text)}"
        )
    return value


#: Each budget: its option (``--max-`` or ``--session-max-`` before it), its
#: :class:`UsageLimits` field, its type and metavar, its help for a run and for a session.
_BUDGETS: tuple[tuple[str, str, Callable[[str], float], str, str, str], ...] = (
    ("requests", "requests", _count, "N", "model requests a run may make",
     "model requests a session may make in all its runs"),
    ("tool-calls", "tool_calls", _count, "N", "tool calls a run may make",
     "tool calls a session may make in all its runs"),
    ("tokens", "total_tokens", _count, "N", "input and output tokens a run may use",
     "input and output tokens a session may use in all its runs"),
    ("seconds", "wall", _seconds, "S", "seconds a run may take: reached mid-reply or "
     "mid-tool-call, it stops the run at once (the partial reply kept)",
     "seconds a session's runs may take in all"),
)


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """Add the per-run budget options (see aio.UsageLimits) to ``parser``."""
    group = parser.add_argument_group(
        "budgets", "limits of each run: one reached ends the run 'limited'; resume goes on"
    )
    for option, _, kind, metavar, run_help, _ in _BUDGETS:
        group.add_argument(f"--max-{option}", type=kind, metavar=metavar, help=run_help)


def add_session_limit_options(parser: argparse.ArgumentParser) -> None:
    """Add the per-session budget options (``Agent(session_limits=)``) to ``parser``."""
    group = parser.add_argument_group(
        "session budgets",
        "limits of each session, all its runs together: its spend is kept in the store "
        "before each model request, so restarts, crashes and --recover cannot pass them; "
        "one reached ends the run 'limited'",
    )
    for option, _, kind, metavar, _, session_help in _BUDGETS:
        group.add_argument(
            f"--session-max-{option}", type=kind, metavar=metavar, help=session_help
        )


def limits_from(options: argparse.Namespace) -> UsageLimits | None:
    """The limits of each run the options give, or None when none was given."""
    return _limits(options, "max_")


def session_limits_from(options: argparse.Namespace) -> UsageLimits | None:
    """The limits of each session the options give, or None when none was given."""
    return _limits(options, "session_max_")


def _limits(options: argparse.Namespace, prefix: str) -> UsageLimits | None:
    values = {
        field: getattr(options, prefix + option.replace("-", "_"), None)
        for option, field, *_ in _BUDGETS
    }
    given = {name: value for name, value in values.items() if value is not None}
    return UsageLimits(**given) if given else None
