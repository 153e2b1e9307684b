"""``client("provider:model")``: a small registry of provider factories.

Each factory imports its provider module when called, so ``from aimu import aio`` loads
no provider and no SDK; a provider's SDK is imported when its first client is built,
outside any event loop turn that matters. The base types live in
:mod:`aimu.aio.providers.base` and are re-exported here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, cast

from aimu.aio._echo import echo
from aimu.aio.providers.base import (
    Chunk,
    ModelClient,
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnAssembler,
    TurnDone,
    TurnRequest,
    TurnRetry,
)

__all__ = [
    "PROVIDERS",
    "Chunk",
    "ModelClient",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallDelta",
    "TurnAssembler",
    "TurnDone",
    "TurnRequest",
    "TurnRetry",
    "client",
    "register_provider",
]

#: Builds a client from the model name (the part after ``provider:``) and the options.
ProviderFactory = Callable[..., ModelClient]


def _imported(module: str, name: str) -> ProviderFactory:
    """A factory building ``name`` of ``aimu.aio.providers.<module>``, imported when it
    builds its first client."""

    def build(model: str, **options: Any) -> ModelClient:
        provider = getattr(importlib.import_module(f"aimu.aio.providers.{module}"), name)
        return cast(ModelClient, provider(model, **options))

    return build


def _test(model: str, **options: Any) -> ModelClient:
    from aimu.aio.providers.test import TestModelClient

    return TestModelClient(model or "test", **options)


# provider name -> (factory, whether a model name is required)
_REGISTRY: dict[str, tuple[ProviderFactory, bool]] = {
    "ollama": (_imported("ollama", "OllamaClient"), True),
    "openai": (_imported("openai", "OpenAIClient"), True),
    "gemini": (_imported("gemini", "GeminiClient"), True),
    "openai-responses": (_imported("openai_responses", "OpenAIResponsesClient"), True),
    "anthropic": (_imported("anthropic", "AnthropicClient"), True),
    "azure": (_imported("azure", "AzureOpenAIClient"), True),
    "azure-responses": (_imported("azure", "AzureResponsesClient"), True),
    "vertex": (_imported("vertex", "VertexClient"), True),
    "bedrock": (_imported("bedrock", "BedrockClient"), True),
    "test": (_test, False),
}

PROVIDERS = (
    "ollama:", "openai:", "openai-responses:", "gemini:", "anthropic:",
    "azure:", "azure-responses:", "vertex:", "bedrock:", "test",
)


def register_provider(name: str, factory: ProviderFactory, *, needs_model: bool = True) -> None:
    """Make ``client(f"{name}:<model>")`` call ``factory(model, **options)``."""
    if not name or ":" in name:
        raise ValueError(f"a provider name is a non-empty word without ':', got {name!r}")
    _REGISTRY[name] = (factory, needs_model)


def client(spec: str, **options: Any) -> ModelClient:
    """Make a model client from ``"provider:model"``.

    ``ollama:<model>`` (an Ollama server; ``host=`` or ``OLLAMA_HOST``),
    ``openai:<model>`` (any OpenAI-compatible server; ``base_url=``/``OPENAI_BASE_URL``,
    ``api_key=``/``OPENAI_API_KEY``), ``openai-responses:<model>`` (OpenAI's Responses
    API, the same settings, ``background=True`` for background responses),
    ``gemini:<model>`` (Google's Gemini API; ``api_key=``/``GEMINI_API_KEY``/
    ``GOOGLE_API_KEY``, ``base_url=``/``GEMINI_BASE_URL``), ``azure:<deployment>`` and
    ``azure-responses:<deployment>`` (Azure OpenAI's v1 API; ``base_url=``/
    ``AZURE_OPENAI_BASE_URL``, ``api_key=``/``AZURE_OPENAI_API_KEY``, ``token=`` or
    ``azure_ad_token_provider=``), ``vertex:<model>`` (Gemini on Vertex AI; ``project=``/
    ``GOOGLE_CLOUD_PROJECT``, ``location=``/``GOOGLE_CLOUD_LOCATION``, ``token=``, else the
    application default credentials), ``bedrock:<modelId>`` (Amazon Bedrock's Converse
    API, SigV4-signed; ``region=``/``AWS_REGION``, credentials from botocore's standard
    chain; the ``bedrock`` extra) and ``test`` (the embedded offline model).
    """
    if not isinstance(spec, str):
        raise TypeError(f"client() takes a 'provider:model' string, got {type(spec).__name__}")
    provider, _, model = spec.partition(":")
    entry = _REGISTRY.get(provider)
    if entry is None:
        known = ", ".join(
            repr(f"{name}:" if needs else name) for name, (_, needs) in _REGISTRY.items()
        )
        raise ValueError(f"unknown model provider in {echo(spec)}; known: {known}")
    factory, needs_model = entry
    if needs_model and not model:
        raise ValueError(f"{echo(spec)} names no model; write it as '{provider}:<model>'")
    return factory(model, **options)

