"""What the stores tell the application: a torn record, a repair, an unfinished run, a
refused lock. Log records go to ``aimu.aio.store``; each names the session and where it
is stored, never a message's contents."""

from __future__ import annotations

import logging
import warnings

__all__ = ["log", "note_locked", "note_unfinished", "warn_torn"]

log = logging.getLogger("aimu.aio.store")


def warn_torn(where: str, what: str, *, repaired: bool = False) -> None:
    """Warn that the last record at ``where`` was cut short: ignored, or (``repaired``) cut
    off by the writer that opened the session."""
    warnings.warn(
        f"{where}: ignoring a torn last record ({what}); it was cut short when the writing "
        "process died, and the next writer of this session removes it",
        RuntimeWarning,
        stacklevel=4,
    )
    done = "removed" if repaired else "ignored (the next writer removes it)"
    log.warning(
        "%s: a torn last record, cut short when its writer died, was %s: %s", where, done, what
    )


def note_unfinished(where: str, session: str, status: str | None) -> None:
    """A writer opened a session whose last run never settled: its process stopped mid-run."""
    if status == "in_progress":
        log.warning(
            "session %r in %s: its last run did not finish (the process stopped mid-run); "
            "loading it settles the transcript, and resume() continues it",
            session,
            where,
        )


def note_locked(session: str, holder: str) -> None:
    """A writer was refused: ``holder`` has the session open for writing."""
    log.info("session %r: refused the write lock, held by %s", session, holder)
