"""Numbers from callers, checked before they are used: finite, and in range.

``math.isfinite(10**400)`` raises ``OverflowError`` (the int has no float), and a float
that is finite but huge overflows later (``int(1e308 * 1000)``, a cost of ``inf`` that
no store takes). Every seconds, amount or count a caller gives is checked here first,
so such a value gets the same clear ``ValueError`` as a NaN or a negative one.
"""

from __future__ import annotations

import math
from typing import Final, TypeGuard

from aimu.aio._echo import echo

__all__ = ["MAX_COUNT", "finite", "grace_seconds", "is_count", "is_number"]

#: The largest count a limit or a usage may hold: what a store's integer column takes.
MAX_COUNT: Final = 2**63 - 1


def is_number(value: object) -> TypeGuard[int | float]:
    """True for an int or a float; a bool is not a number here."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def is_count(value: object) -> TypeGuard[int]:
    """True for an int from 0 to MAX_COUNT (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def finite(value: object) -> TypeGuard[int | float]:
    """True for a number that is finite as a float: not NaN, not infinite, and not an int
    too large for a float."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def grace_seconds(grace: object) -> float:
    """``grace`` (a stop's seconds from its interrupt to its cancel) if it is a finite
    number, 0 or more; else ``ValueError``. Every stop checks its grace here."""
    if not finite(grace) or grace < 0:
        raise ValueError(f"stop(grace={echo(grace)}): give a finite number of seconds, 0 or more")
    return float(grace)
