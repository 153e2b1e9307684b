"""Run every code block of one Markdown page, in order, in the current directory.

Each ``python`` block runs as its own script (``python -c CODE``, this directory first
on ``sys.path``), as a reader who saves and runs it would: no top-level ``await``, no
name from an earlier block. A block fenced ``python file=NAME.py`` is saved as
``NAME.py`` first, for later blocks to import. ``sh`` blocks run under bash with stdin
closed. A block fenced as ``python no-run`` is the only kind left out, and the docs
test refuses more than a few.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)
FILE = re.compile(r"\bfile=(\S+)")


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, code, line number) for each fenced block of ``page``."""
    return [(language, code, line) for language, code, line, _ in fenced(page)]


def fenced(page: Path) -> list[tuple[str, str, int, str | None]]:
    """(language, code, line number, file name to save it as) for each block to run."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, flags, code = match.group(1), match.group(2), match.group(3)
        if "no-run" in flags:
            continue
        line = text.count("\n", 0, match.start()) + 2
        named = FILE.search(flags)
        found.append((language, code, line, named.group(1) if named else None))
    return found


async def run_block(where: str, *command: str) -> None:
    """Run one block in its own process group; if it fails, end what it left running in
    the background (a server started with ``&``), whose hold on this runner's output
    kept the docs test waiting out its whole timeout before it could report the failure."""
    process = await asyncio.create_subprocess_exec(
        *command, stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        status = await asyncio.wait_for(process.wait(), 120)
    finally:
        if process.returncode != 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    if status != 0:
        raise SystemExit(f"{where}: exited {status}")


async def run_page(page: Path, *, python_only: bool = False) -> None:
    for language, code, line, file_name in fenced(page):
        if python_only and language != "python":
            continue
        if file_name is not None:
            Path(file_name).write_text(code)  # noqa: ASYNC240 - a small file, before it runs
        if language == "python":
            await run_block(f"{page}:{line}: script", sys.executable, "-W",
                            "error::ResourceWarning", "-c", code)
        elif language in ("sh", "bash", "shell"):
            await run_block(f"{page}:{line}: shell block", "bash", "-euo", "pipefail", "-c", code)


if __name__ == "__main__":
    asyncio.run(run_page(Path(sys.argv[1]), python_only="--python-only" in sys.argv[2:]))
