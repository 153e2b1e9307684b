"""What one ``aimu chat`` runs with: :class:`ChatSettings`, from its command-line options."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from aimu._limit_options import add_limit_options, limits_from
from aimu._logs import add_log_level_option
from aimu._mcp_options import add_mcp_options
from aimu.aio.limits import UsageLimits

__all__ = ["ChatSettings", "add_chat_options", "default_home"]


def default_home() -> Path:
    """Where state lives: ``$AIMU_HOME``, else ``~/.aimu``."""
    return Path(os.environ.get("AIMU_HOME") or "~/.aimu").expanduser()


def _default_model() -> str:
    return os.environ.get("AIMU_MODEL") or "test"


@dataclass(frozen=True, slots=True)
class ChatSettings:
    """What one chat runs with; ``home`` holds the session store (``sessions.db``)."""

    model: str = field(default_factory=_default_model)
    session: str = "default"
    system: str | None = None
    home: Path = field(default_factory=default_home)
    tools: bool = True
    log_level: str | None = None
    """Send the "aimu" loggers' records at this level and above to stderr (None: off)."""
    plain: bool = False
    """Plain line input even on a terminal (no line editing, history or colour)."""
    join: bool = False
    """Lines typed during a turn join it (``agent.send``) instead of queueing after it."""
    mcp: tuple[str, ...] = ()
    """MCP servers to start over stdio (``"COMMAND ARGS"``), their tools offered too."""
    mcp_urls: tuple[str, ...] = ()
    """MCP servers to reach over Streamable HTTP."""
    limits: UsageLimits | None = None
    """The budget of each turn's run (``--max-requests`` and kin)."""

    @property
    def store_path(self) -> Path:
        return self.home / "sessions.db"

    @property
    def history_path(self) -> Path:
        """The lines typed at a terminal, for Up and Ctrl+R (readable by the user only)."""
        return self.home / "history"

    @classmethod
    def from_options(cls, options: argparse.Namespace) -> ChatSettings:
        """Settings from options parsed by a parser that :func:`add_chat_options` set up."""
        return cls(
            model=options.model or _default_model(),
            session=options.session,
            system=options.system,
            tools=not options.no_tools,
            log_level=options.log_level,
            plain=options.plain,
            join=options.join,
            mcp=tuple(getattr(options, "mcp", ())),
            mcp_urls=tuple(getattr(options, "mcp_url", ())),
            limits=limits_from(options),
        )


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """Add ``--model``, ``--session``, ``--system`` and ``--no-tools`` to ``parser``."""
    parser.add_argument(
        "--model",
        metavar="SPEC",
        default=None,
        help="the model: test (embedded, offline), ollama:NAME, openai:NAME or "
        "openai-responses:NAME, anthropic:NAME, gemini:NAME, azure:DEPLOYMENT or "
        "azure-responses:DEPLOYMENT, vertex:NAME, bedrock:MODEL_ID (default: $AIMU_MODEL, "
        "else test)",
    )
    parser.add_argument(
        "--session",
        metavar="NAME",
        default="default",
        help="the conversation to continue or start (default: default); "
        "kept in $AIMU_HOME/sessions.db ($AIMU_HOME defaults to ~/.aimu)",
    )
    parser.add_argument("--system", metavar="TEXT", default=None, help="the system prompt")
    parser.add_argument(
        "--no-tools", action="store_true", help="offer the model no tools (for models without)"
    )
    parser.add_argument(
        "--join",
        action="store_true",
        help="lines typed during a turn join that turn at its next step, instead of "
        "being queued and answered after it (/join switches while chatting)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain line input on a terminal too: no line editing, history, colour or spinner",
    )
    add_log_level_option(parser, default=None)
    add_mcp_options(parser)
    add_limit_options(parser)
