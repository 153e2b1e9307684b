"""The options ``aimu serve`` and ``aimu worker`` share: which agent runs, where its
sessions live, how a SIGTERM drains. Neither command imports the other: both add these."""

from __future__ import annotations

import argparse
import importlib
import math
import os
from collections.abc import Callable
from typing import Any, Final, cast

from aimu._bounded_exit import DRAIN_MARGIN
from aimu._limit_options import add_limit_options
from aimu._logs import add_log_level_option
from aimu._mcp_options import add_mcp_options

__all__ = [
    "DEFAULT_DRAIN", "add_agent_options", "add_drain_options", "agent_tools", "import_tool",
    "seconds",
]

#: Seconds a SIGTERM gives the runs in progress to stop at a step boundary (--drain).
DEFAULT_DRAIN: Final = 30.0


def seconds(what: str, *, zero: bool = True) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, 0 or more (above 0 unless
    ``zero``); the error names the option ``what``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            least = "0 or more" if zero else "above 0"
            raise argparse.ArgumentTypeError(
                f"{what} takes a finite number of seconds, {least}; got {text!r:.40}"
            )
        return value

    return parse


def add_drain_options(parser: argparse.ArgumentParser, command: str) -> None:
    """``--drain S`` and ``--recover``, which ``aimu serve`` and ``aimu worker`` share."""
    parser.add_argument(
        "--drain", type=seconds("--drain"), default=DEFAULT_DRAIN, metavar="SECONDS",
        help="on SIGTERM, start no run, interrupt those in progress at their next step, "
        f"cancel what is left after SECONDS, then exit 0 (default {DEFAULT_DRAIN:g}; "
        "a second SIGTERM or Ctrl+C cancels at once); the process exits by SECONDS + "
        f"{DRAIN_MARGIN:g}, whatever still runs (a sync tool's thread is left behind)",
    )
    if command == "serve":
        parser.add_argument(
            "--recover", action="store_true",
            help="go on with the runs whose process died or that a drain stopped, each "
            "exactly once (a lease: the session's write lock); off by default",
        )
        parser.add_argument(
            "--recover-every", type=seconds("--recover-every", zero=False), default=None,
            metavar="SECONDS",
            help="with --recover: how often to look for runs to go on with (default 5; "
            "each look is two indexed queries on the store)",
        )
        parser.add_argument(
            "--max-crashes", type=int, default=None, metavar="N",
            help="with --recover: leave a run failed once its process died N times in a "
            "row with no progress (default 3)",
        )


def add_agent_options(
    parser: argparse.ArgumentParser, logs: str, log_level: str = "info"
) -> None:
    """Add the options that say which agent runs and where its sessions live.

    ``aimu serve`` and ``aimu worker`` share them, so both run the same agent;
    :func:`agent_tools` reads the tools they name.
    """
    parser.add_argument(
        "--model",
        default=os.environ.get("AIMU_MODEL") or "test",
        help="model spec, e.g. ollama:qwen3:8b (default: $AIMU_MODEL, else the test model)",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="PATH-OR-URL",
        help="the sessions: a SQLite file, or a postgresql:// URL for a store every host "
        "reaches (default: sessions.db in $AIMU_HOME, else in ~/.aimu: the store of aimu chat)",
    )
    parser.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="Redis URL shared by several server processes (runs stop and stream across them)",
    )
    parser.add_argument(
        "--redis-prefix",
        default="aimu",
        metavar="PREFIX",
        help="key prefix in Redis; servers that work together use the same one (default aimu)",
    )
    parser.add_argument("--system", default=None, help="system prompt for every session")
    add_limit_options(parser)
    parser.add_argument(
        "--tool",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="a tool the agents may call: a function or aio.tool importable as MODULE:NAME "
        "(repeatable; replaces the demo tools)",
    )
    parser.add_argument(
        "--no-tools",
        action="store_true",
        help="offer the model no tools (without --tool, it gets the demo tools of aimu chat)",
    )
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="answer requests for this host name too (repeatable; '*.example.com' for its "
        "subdomains). Default: loopback names only without a token, any with one",
    )
    add_mcp_options(parser)
    add_log_level_option(parser, default=log_level, what=logs)


def agent_tools(options: argparse.Namespace) -> list[Callable[..., Any]]:
    """The tools of ``--tool`` (else the demo tools of ``aimu chat``, unless
    ``--no-tools``); ValueError saying which option is wrong."""
    if not options.tool and not options.no_tools:
        from aimu.assistant import DEMO_TOOLS  # the same harmless tools as `aimu chat`

        return list(DEMO_TOOLS)
    return [import_tool(spec) for spec in options.tool]


def import_tool(spec: str) -> Callable[..., Any]:
    """The function or tool named ``MODULE:NAME``; ValueError saying what is wrong."""
    module_name, colon, name = spec.partition(":")
    if not (colon and module_name and name):
        raise ValueError(f"--tool {spec!r}: give MODULE:NAME, like mypackage.tools:search")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--tool {spec!r}: cannot import it ({error})") from error
    if not callable(found):
        raise ValueError(f"--tool {spec!r} is a {type(found).__name__}, not a function or tool")
    return cast(Callable[..., Any], found)
