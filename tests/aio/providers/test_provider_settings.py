"""The settings every HTTP client takes, carried as one value; and the providers' sizes.

The keywords stay the public API (``aio.client(...)`` and each client's constructor):
each client takes the ones it took before and refuses the others as Python would; what
it was given is one frozen :class:`ClientSettings` that its forks share.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.providers._settings import ClientSettings

PROVIDERS = Path(__file__).resolve().parents[3] / "aimu" / "aio" / "providers"

#: Each client with the keywords of its own it needs, and one of the shared keywords it
#: does not take.
CLIENTS: list[tuple[str, dict[str, Any], str]] = [
    ("openai:m", {"base_url": "http://127.0.0.1:9/v1", "api_key": "k"}, "safety_settings"),
    ("anthropic:m", {"base_url": "http://127.0.0.1:9", "api_key": "k"}, "host"),
    ("gemini:m", {"base_url": "http://127.0.0.1:9", "api_key": "k"}, "merge_roles"),
    ("openai-responses:m", {"base_url": "http://127.0.0.1:9/v1", "api_key": "k"},
     "continues_partial"),
    ("ollama:m", {"host": "http://127.0.0.1:9"}, "api_key"),
    ("bedrock:m", {"region": "us-east-1", "base_url": "http://127.0.0.1:9",
                   "aws_access_key_id": "AKIDEXAMPLE", "aws_secret_access_key": "secret"},
     "api_key"),
    ("azure:d", {"base_url": "http://127.0.0.1:9/openai/v1", "api_key": "k"}, "project"),
    ("vertex:g", {"project": "p", "location": "l", "token": "t", "base_url": "http://127.0.0.1:9"},
     "merge_roles"),
]


@pytest.mark.parametrize(("spec", "own", "refused"), CLIENTS)
async def test_the_shared_keywords_are_carried_as_one_value(
    spec: str, own: dict[str, Any], refused: str
) -> None:
    model: Any = aio.client(spec, **own, timeout=7.0, connect_timeout=2.0, retries=1,
                            retry_delay=0.25, concurrency=3, context_window=4096,
                            options={"temperature": 0})
    settings = model.settings
    assert isinstance(settings, ClientSettings)
    assert (settings.timeout, settings.connect_timeout, settings.retries,
            settings.retry_delay, settings.concurrency, settings.context_window) == (
        7.0, 2.0, 1, 0.25, 3, 4096)
    assert model._pool.timeout.read == 7.0 and model._pool.timeout.connect == 2.0
    assert model._pool.concurrency == 3 and model.context_window == 4096
    assert model.options == {"temperature": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout = 1.0
    secret = "s3cr3t"
    shown = repr(ClientSettings(base_url=f"http://u:{secret}@h/?key={secret}", api_key=secret,
                                headers={"x-api-key": secret}))
    assert secret not in shown and "timeout=300.0" in shown  # what may hold a secret left out
    twin = model.fork()
    assert twin.settings is settings
    twin.options["temperature"] = 1  # a fork's options are its own
    assert model.options == {"temperature": 0}
    await model.aclose()
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{refused}'"):
        aio.client(spec, **own, **{refused: True})


def test_the_defaults_stay_each_clients_own() -> None:
    ollama: Any = aio.client("ollama:m", host="http://127.0.0.1:9")
    openai: Any = aio.client("openai:m", base_url="http://127.0.0.1:9/v1", api_key="k")
    assert ollama.continues_partial is True and openai.continues_partial is False
    assert ollama.merge_roles is True and openai.merge_roles is True
    anthropic: Any = aio.client("anthropic:m", base_url="http://127.0.0.1:9", api_key="k",
                                merge_roles=True, continues_partial=True)
    assert anthropic.merge_roles is False  # its own encoder merges: always
    assert anthropic.continues_partial is True


def test_no_provider_module_over_800_lines_nor_function_over_60() -> None:
    """Issue 43's sizes, held for aimu/aio/providers/."""
    long = []
    for path in sorted(PROVIDERS.glob("*.py")):
        text = path.read_text()
        if text.count("\n") > 800:
            long.append(f"{path.name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path.name}: {node.name} at {node.lineno}")
    assert long == [], long
