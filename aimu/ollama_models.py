"""``aimu models`` and ``aimu pull MODEL``: the models of an Ollama server, seen and fetched.

Both talk to Ollama through the official ``ollama`` package's ``AsyncClient`` (the chat
path has its own HTTP client; listing and pulling are what the package is for). A pull
shows a progress bar on a terminal (prompt_toolkit, as the chat uses, when installed)
and plain lines otherwise; Ctrl+C stops it cleanly (the download stops with the
connection; Ollama keeps what it fetched, so a later pull resumes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import httpx

from aimu.aio.providers.ollama import resolve_host

if TYPE_CHECKING:
    import ollama

__all__ = [
    "Lines",
    "ModelInfo",
    "add_models_options",
    "add_pull_options",
    "is_missing",
    "list_models",
    "pull",
    "run_models",
    "run_pull",
]


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model an Ollama server has: its name, size on disk, and context length."""

    name: str
    size: int
    context_length: int | None


class ModelsError(Exception):
    """What went wrong, in one line for the command line."""


def _context_length(info: object) -> int | None:
    if not isinstance(info, dict):
        return None
    for key, value in info.items():
        if key.endswith(".context_length") and isinstance(value, int):
            return value
    return None


def _unreachable(host: str) -> ModelsError:
    return ModelsError(
        f"cannot reach Ollama at {host}: is it running? (--host or OLLAMA_HOST sets the address)"
    )


def _not_ollama(host: str, what: str) -> ModelsError:
    return ModelsError(f"{host} does not answer as Ollama does: {what}")


#: Ollama's own answer to ``/api/show`` for a model it does not have ("model 'x' not
#: found"; older servers: 'model "x" not found, try pulling it first'). Any other 404 is
#: not Ollama saying so: a proxy that passes only /api/chat says "404 page not found".
_MODEL_NOT_FOUND = re.compile(r"model\b.*\bnot found", re.IGNORECASE | re.DOTALL)


async def list_models(host: str | None = None) -> list[ModelInfo]:
    """The models of the Ollama server at ``host`` (default: ``OLLAMA_HOST``), by name."""
    import ollama  # here, not at the top: every aimu command imports this module

    url = resolve_host(host)
    try:
        async with ollama.AsyncClient(host=url) as client:
            found = await _described(client)
    except (httpx.TransportError, ConnectionError):
        raise _unreachable(url) from None
    except ollama.ResponseError as error:
        raise ModelsError(f"Ollama at {url} answered {error.status_code}: {error.error}") from None
    return sorted(found, key=lambda m: m.name)


async def _described(client: ollama.AsyncClient) -> list[ModelInfo]:
    """Each listed model with its context length (one ``show`` each)."""
    listed = await client.list()
    found = []
    for model in listed.models:
        name = model.model or ""
        shown = await client.show(name)
        found.append(ModelInfo(name, model.size or 0, _context_length(shown.modelinfo)))
    return found


def _size(size: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000  # type: ignore[assignment]
    return f"{size} B"


async def is_missing(model: str, host: str | None = None) -> bool:
    """True when the Ollama server says it does not have ``model`` (its own 404 "model
    not found"); False when it has it, or cannot say (down, an error of its own, or a
    proxy's 404 for the path: the chat request itself says what is wrong)."""
    import ollama

    url = resolve_host(host)
    try:
        async with ollama.AsyncClient(host=url) as client:
            await client.show(model)
    except ollama.ResponseError as error:
        return error.status_code == 404 and _MODEL_NOT_FOUND.match(error.error) is not None
    except (httpx.TransportError, ConnectionError):
        return False
    return False


async def pull(
    model: str,
    host: str | None = None,
    on_progress: Callable[[str, int, int], None] = lambda status, done, total: None,
) -> None:
    """Pull ``model`` onto the Ollama server, calling ``on_progress(status, completed,
    total)`` as it goes; ModelsError when the model does not exist or the server is down."""
    import ollama

    url = resolve_host(host)
    try:
        async with ollama.AsyncClient(host=url) as client:
            stream: AsyncIterator[ollama.ProgressResponse] = await client.pull(model, stream=True)
            async for part in _checked(stream, url):
                on_progress(part.status or "", part.completed or 0, part.total or 0)
    except (httpx.TransportError, ConnectionError):
        raise _unreachable(url) from None
    except ollama.ResponseError as error:
        raise ModelsError(f"cannot pull {model!r} from {url}: {error.error}") from None


async def _checked(
    stream: AsyncIterator[ollama.ProgressResponse], url: str
) -> AsyncIterator[ollama.ProgressResponse]:
    """The progress lines of a pull, each one Ollama could have sent: a line that is not a
    JSON object, or a count that is not a whole number of bytes, is ModelsError naming
    the server (not a traceback, nor "-50% of -10 B")."""
    import pydantic

    while True:
        try:
            part = await anext(stream)
        except StopAsyncIteration:
            return
        except json.JSONDecodeError:
            raise _not_ollama(url, "a progress line is not JSON") from None
        except pydantic.ValidationError as error:
            wrong = error.errors()[0]
            field = ".".join(str(at) for at in wrong["loc"])
            raise _not_ollama(
                url, f"a progress line's {field} is {wrong['input']!r}, not a count of bytes"
            ) from None
        except (AttributeError, TypeError):  # the package reads each line as an object
            raise _not_ollama(url, "a progress line is not a JSON object") from None
        for field, value in (("total", part.total), ("completed", part.completed)):
            if value is not None and value < 0:
                raise _not_ollama(url, f"a progress line's {field} is {value}, not a count")
        yield part


class Lines:
    """Progress as plain lines: each status once, a download every 10 %."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.last: tuple[str, int] = ("", -1)

    def __call__(self, status: str, done: int, total: int) -> None:
        tenth = done * 10 // total if total else -1
        if (status, tenth) == self.last:
            return
        self.last = (status, tenth)
        shown = f"{status} {tenth * 10}% of {_size(total)}" if total else status
        print(shown, file=self.out, flush=True)


class _Bar:
    """Progress as a prompt_toolkit progress bar (the chat's terminal library)."""

    def __init__(self, model: str) -> None:
        from prompt_toolkit.shortcuts import ProgressBar

        self.bar = ProgressBar(title=f"pulling {model}")
        self.counters: dict[str, Any] = {}

    def __enter__(self) -> _Bar:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.bar.__exit__(*exc_info)

    def __call__(self, status: str, done: int, total: int) -> None:
        if not total:
            return
        counter = self.counters.get(status)
        if counter is None:
            counter = self.counters[status] = self.bar(label=status[:40], total=total)
        counter.items_completed = done
        if done >= total:
            counter.done = True
        self.bar.invalidate()


def add_models_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="the Ollama server (default: OLLAMA_HOST, else local)")


def add_pull_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="the model to pull, e.g. qwen3:8b")
    add_models_options(parser)


def run_models(options: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``aimu models``: a table of the server's models; 1 with one line when it fails."""
    out = out or sys.stdout
    try:
        models = asyncio.run(list_models(options.host))
    except ModelsError as error:
        print(f"aimu models: {error}", file=sys.stderr)
        return 1
    if not models:
        print("no models yet: aimu pull MODEL fetches one", file=out)
        return 0
    width = max(len(m.name) for m in models)
    print(f"{'MODEL':{width}}  {'SIZE':>9}  CONTEXT", file=out)
    for m in models:
        context = f"{m.context_length:,}" if m.context_length else "?"
        print(f"{m.name:{width}}  {_size(m.size):>9}  {context}", file=out)
    return 0


def run_pull(options: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``aimu pull MODEL``: 0 once pulled; 1 with one line when it fails; 130 on Ctrl+C."""
    out = out or sys.stdout
    progress: Callable[[str, int, int], None]
    shown: AbstractContextManager[Any]
    if out.isatty() and _has_prompt_toolkit():
        bar = _Bar(options.model)
        progress, shown = bar, bar
    else:
        progress, shown = Lines(out), nullcontext()
    try:
        with shown:
            asyncio.run(pull(options.model, options.host, progress))
    except ModelsError as error:
        print(f"aimu pull: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"aimu pull: stopped; pull {options.model} again to resume", file=sys.stderr)
        return 130
    print(f"pulled {options.model}", file=out)
    return 0


def _has_prompt_toolkit() -> bool:
    try:
        import prompt_toolkit  # noqa: F401
    except ImportError:
        return False
    return True
