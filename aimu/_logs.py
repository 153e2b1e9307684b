"""The ``--log-level`` option of ``aimu chat`` and ``aimu serve``, and where it sends records.

One definition, so both commands accept the same levels and describe them alike. The
``aimu`` logger has only a ``NullHandler`` in a library; a command that runs aimu attaches
a stream handler for as long as it runs (:func:`logging_to`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator
from typing import Final, TextIO

__all__ = ["LOG_LEVELS", "add_log_level_option", "logging_to"]

#: The levels ``--log-level`` accepts, most verbose first.
LOG_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
_FORMAT: Final = "%(levelname)s %(name)s: %(message)s"


def add_log_level_option(
    parser: argparse.ArgumentParser, *, default: str | None, what: str = "aimu's log records"
) -> None:
    """Add ``--log-level`` to ``parser``: one of :data:`LOG_LEVELS`, or ``default``.

    ``what`` names the records it sends to stderr (the server adds its own to aimu's).
    """
    shown = default or "none (silent)"
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        help=f"send {what} at this level and above to stderr; debug shows message "
        f"contents (default: {shown})",
    )


@contextlib.contextmanager
def logging_to(stream: TextIO, level: str | None) -> Iterator[None]:
    """While the block runs, the ``aimu`` loggers' records at ``level`` and above go to
    ``stream`` (nothing changes for ``None``)."""
    if level is None:
        yield
        return
    logger = logging.getLogger("aimu")
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(_FORMAT))
    previous = logger.level
    logger.setLevel(level.upper())
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
