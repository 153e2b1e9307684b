"""Optional dependencies ("extras"): a missing one becomes the exact command that installs it.

``with needs_extra("aimu serve", "serve"): import uvicorn`` turns the bare
``No module named 'uvicorn'`` into :class:`MissingExtra` saying
``aimu serve needs the serve extra (uvicorn is not installed): pip install 'aimu-agents[serve]'``.
An ImportError from a module that is not part of the extra passes through unchanged.

The distribution is :data:`DISTRIBUTION` (``aimu`` on PyPI is another project); the
import name stays ``aimu``. Run from a checkout (an editable install, or the source tree
on the path), the command installs from that checkout: ``pip install -e '.[serve]'``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shlex
import tomllib
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "DISTRIBUTION",
    "EXTRAS",
    "MissingExtra",
    "has_extra",
    "install_command",
    "missing_extra",
    "needs_extra",
]

#: The name pip installs aimu by (``pip install aimu`` would bring another project).
DISTRIBUTION = "aimu-agents"

#: Each extra of pyproject.toml and the top-level modules it installs.
EXTRAS: dict[str, tuple[str, ...]] = {
    "chat": ("prompt_toolkit",),
    "mcp": ("mcp",),
    "otel": ("opentelemetry",),
    "postgres": ("asyncpg",),
    "redis": ("redis",),
    "serve": ("fastapi", "starlette", "uvicorn", "fastapi_offline"),
    "temporal": ("temporalio",),
    "vertex": ("google.auth", "requests"),
    "bedrock": ("botocore",),
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message says how to install it."""


def checkout() -> Path | None:
    """The source checkout this ``aimu`` is imported from (its ``pyproject.toml`` names
    :data:`DISTRIBUTION`), or None for an installed copy."""
    root = Path(__file__).parent.parent  # not resolved: a copy linked elsewhere is a copy
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return root if project.get("project", {}).get("name") == DISTRIBUTION else None


def install_command(extra: str) -> str:
    """The shell command that installs ``extra`` (quoted for every shell), from the
    checkout when aimu runs from one, else from PyPI."""
    if extra not in EXTRAS:
        raise ValueError(f"aimu has no extra {extra!r}; the extras are {', '.join(EXTRAS)}")
    source = checkout()
    if source is None:
        return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"
    here = os.path.realpath(source) == os.path.realpath(os.getcwd())
    where = "." if here else str(source)
    return f"pip install -e {shlex.quote(f'{where}[{extra}]')}"


def _belongs(module: str | None, extra: str) -> bool:
    """``module`` is one of ``extra``'s, a submodule of one, or a package one lives in
    (``google`` for ``google.auth``)."""
    name = module or ""
    return bool(name) and any(
        name == mine or name.startswith(mine + ".") or mine.startswith(name + ".")
        for mine in EXTRAS[extra]
    )


def has_extra(extra: str) -> bool:
    """True when every module of ``extra`` can be imported (checked without importing)."""
    install_command(extra)  # an unknown extra is a programming error: say so
    return all(importlib.util.find_spec(module) is not None for module in EXTRAS[extra])


def missing_extra(feature: str, extra: str, error: ImportError | None = None) -> MissingExtra:
    """The error to raise when ``feature`` cannot run without ``extra`` (``error``: the
    failed import, if there was one; else the first module of the extra not found)."""
    if error is not None:
        name = error.name or ""
        mine = (m for m in EXTRAS[extra] if name == m or name.startswith(m + "."))
        missing = next(mine, name.partition(".")[0])
    else:
        absent = (m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None)
        missing = next(absent, "")
    because = f" ({missing} is not installed)" if missing else ""
    return MissingExtra(
        f"{feature} needs the {extra} extra{because}: {install_command(extra)}",
        name=error.name if error is not None else None,
    )


@contextlib.contextmanager
def needs_extra(feature: str, extra: str) -> Iterator[None]:
    """Imports in the block that fail for a module of ``extra`` raise :class:`MissingExtra`.

    ``feature`` names what the user ran ("aimu serve", "PostgresStore").
    """
    install_command(extra)
    try:
        yield
    except MissingExtra:
        raise
    except ImportError as error:
        if not _belongs(error.name, extra):
            raise
        raise missing_extra(feature, extra, error) from error
