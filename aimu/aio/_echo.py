"""Bounded echoes of bad input for error messages.

An error names the value it refused, but a 10 MB role or call id must not become a
10 MB message: :func:`echo` gives a short prefix of the value's repr and its length.
"""

from __future__ import annotations

__all__ = ["ECHO_LIMIT", "echo"]

#: Characters of a value's repr an error message shows at most.
ECHO_LIMIT = 60


def echo(value: object, limit: int = ECHO_LIMIT) -> str:
    """``repr(value)``, or its first ``limit`` characters and the value's size when longer;
    a container is named by its type and length only."""
    if isinstance(value, str | bytes) and len(value) > limit:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{value[:limit]!r}… ({len(value)} {unit})"
    if isinstance(value, list | tuple | dict | set | frozenset):
        return f"<{type(value).__name__} of {len(value)} items>"  # its repr may be huge
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
