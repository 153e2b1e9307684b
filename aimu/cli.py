"""The ``aimu`` command line: ``aimu chat`` (also ``python -m aimu chat``).

``aimu chat`` runs the assistant of :mod:`aimu.assistant` on stdin and stdout: type a
message, watch the reply stream, ``/stop`` it midway, come back later to the same
``--session``. It runs offline on the embedded ``test`` model unless told otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from aimu import __version__
from aimu.aio.tools import Tool
from aimu.assistant import ChatSettings, add_chat_options, run_chat
from aimu.ollama_models import add_models_options, add_pull_options, run_models, run_pull
from aimu.runs_command import add_runs_options, run_runs
from aimu.serve.command import add_serve_options, run_serve
from aimu.serve.mcp_command import add_mcp_command_options, run_mcp

__all__ = ["build_parser", "main"]


def build_parser(prog: str = "aimu") -> argparse.ArgumentParser:
    """The parser for ``aimu``: ``chat``, ``serve`` and the commands of :data:`_COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Agent runs you can stop, interrupt and resume.",
    )
    parser.add_argument("--version", action="version", version=f"aimu {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary, description, add_options in _COMMANDS:
        add_options(commands.add_parser(name, help=summary, description=description))
    return parser


def _add_worker_options(parser: argparse.ArgumentParser) -> None:
    from aimu.temporal._command import add_worker_options  # temporalio only once it runs

    add_worker_options(parser)


def _run_worker(options: argparse.Namespace) -> int:
    from aimu.temporal._command import run_worker

    return run_worker(options)


#: Each command: its name, its line in ``aimu --help``, its description, its options.
_COMMANDS: tuple[tuple[str, str, str, Callable[[argparse.ArgumentParser], None]], ...] = (
    (
        "chat",
        "chat with an assistant (offline on the embedded test model by default)",
        "Chat with an assistant whose turns you can /stop, /interrupt and /resume. "
        "Type /help once it runs. Ctrl+C interrupts the running turn (twice: stops "
        "it now), or exits when idle; Ctrl+D exits. On a terminal, with "
        "aimu-agents[chat] installed, lines can be edited and recalled (Up, Ctrl+R).",
        add_chat_options,
    ),
    (
        "serve",
        "serve the runs API and the web chat over HTTP (needs the serve extra)",
        "Serve the runs API and the web chat at http://HOST:PORT/.",
        add_serve_options,
    ),
    (
        "mcp",
        "serve the agent as an MCP server on stdin/stdout (needs the mcp extra)",
        "Serve the agent as an MCP server over stdio: one tool, run_agent (a "
        "task in, the agent's answer out); cancelling the call stops the run.",
        add_mcp_command_options,
    ),
    (
        "worker",
        "execute the runs of a Temporal task queue (needs the temporal extra)",
        "Take aimu runs from a Temporal task queue and execute them here.",
        _add_worker_options,
    ),
    (
        "models",
        "list the Ollama server's models, with size and context length",
        "List the models of the Ollama server (OLLAMA_HOST, or --host).",
        add_models_options,
    ),
    (
        "pull",
        "pull a model onto the Ollama server, showing its progress",
        "Pull MODEL onto the Ollama server; Ctrl+C stops (a later pull resumes).",
        add_pull_options,
    ),
    (
        "runs",
        "the run records of a store: list them, show one",
        "The runs a store recorded (aimu chat's, aimu serve's, any agent's).",
        add_runs_options,
    ),
)


#: What runs each command but ``chat`` (which :func:`main` runs with its ``tools``).
_RUNS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": run_serve,
    "mcp": run_mcp,
    "worker": _run_worker,
    "models": run_models,
    "pull": run_pull,
    "runs": run_runs,
}


def main(
    argv: Sequence[str] | None = None,
    *,
    tools: Sequence[Callable[..., Any] | Tool] | None = None,
) -> int:
    """Run the ``aimu`` command with ``argv`` (default: ``sys.argv[1:]``); return its status.

    ``tools`` replaces the demo tools that ``aimu chat`` offers the model.
    """
    parser = build_parser()
    try:
        options = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version and usage errors
        return exit_.code if isinstance(exit_.code, int) else 2
    if options.command is None:  # bare `aimu`: say what it can do
        parser.print_help()
        return 0
    run = _RUNS.get(options.command)
    if run is not None:
        return run(options)
    settings = ChatSettings.from_options(options)
    try:
        return asyncio.run(run_chat(settings, tools=tools))
    except KeyboardInterrupt:  # Ctrl+C before the chat was listening for it
        return 130
    except BrokenPipeError:
        # The reader went away (`aimu chat | head`): stop quietly, also at exit's flush.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
