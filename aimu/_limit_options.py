"""The budget options of ``aimu chat`` and ``aimu serve``: ``--max-requests`` and kin."""

from __future__ import annotations

import argparse

from aimu.aio._numbers import MAX_COUNT
from aimu.aio.limits import UsageLimits

__all__ = ["add_limit_options", "limits_from"]


def _shown(text: str) -> str:
    """``text`` as an error line shows it: a long one cut short."""
    return text if len(text) <= 30 else f"{text[:20]}... ({len(text)} characters)"


def _count(text: str) -> int:
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


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """Add the per-run budget options (see aio.UsageLimits) to ``parser``."""
    group = parser.add_argument_group(
        "budgets", "limits of each run: one reached ends the run 'limited'; resume goes on"
    )
    group.add_argument("--max-requests", type=_count, metavar="N",
                       help="model requests a run may make")
    group.add_argument("--max-tool-calls", type=_count, metavar="N",
                       help="tool calls a run may make")
    group.add_argument("--max-tokens", type=_count, metavar="N",
                       help="input and output tokens a run may use")
    group.add_argument("--max-seconds", type=_seconds, metavar="S",
                       help="seconds a run may take: reached mid-reply or mid-tool-call, "
                       "it stops the run at once (the partial reply kept)")


def limits_from(options: argparse.Namespace) -> UsageLimits | None:
    """The limits the options give, or None when none was given."""
    values = {
        "requests": getattr(options, "max_requests", None),
        "tool_calls": getattr(options, "max_tool_calls", None),
        "total_tokens": getattr(options, "max_tokens", None),
        "wall": getattr(options, "max_seconds", None),
    }
    given = {name: value for name, value in values.items() if value is not None}
    return UsageLimits(**given) if given else None
