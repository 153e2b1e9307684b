"""Fixtures for the agent and provider tests: the loopback server and clients of every
wire it speaks (``make_client`` runs a test once per provider)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from aimu.aio.client import ModelClient
from aimu.aio.client import client as aio_client
from aimu.aio.providers.anthropic import AnthropicClient
from aimu.aio.providers.bedrock import BedrockClient
from aimu.aio.providers.gemini import GeminiClient
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.providers.openai_responses import OpenAIResponsesClient
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import CREDENTIALS, REGION, TEST_KEY_ID
from aimu.testing.server.clouds import AZURE_KEY, TOKEN


@pytest.fixture
async def server() -> AsyncIterator[LoopbackServer]:
    async with LoopbackServer() as loopback:
        yield loopback


@pytest.fixture(params=["ollama", "openai", "gemini", "openai-responses", "anthropic", "bedrock"])
def provider(request: pytest.FixtureRequest) -> str:
    """The wire (a module may override this fixture with the clouds' doors, ``azure``,
    ``azure-responses``, ``vertex``, which ``make_client`` builds too)."""
    return str(request.param)


@pytest.fixture
async def make_client(
    provider: str, server: LoopbackServer
) -> AsyncIterator[Callable[..., ModelClient]]:
    """Builds clients of ``provider`` pointed at ``server``; all are closed at teardown."""
    made: list[ModelClient] = []

    def make(**options: Any) -> ModelClient:
        options.setdefault("connect_timeout", 2.0)
        made_client: ModelClient
        if provider == "ollama":
            made_client = OllamaClient("llama-test", host=server.url, **options)
        elif provider == "anthropic":
            made_client = AnthropicClient(
                "claude-test", base_url=server.url, api_key="sk-ant-test", **options
            )
        elif provider == "openai-responses":
            made_client = OpenAIResponsesClient(
                "gpt-test", base_url=server.openai_base_url, api_key="sk-test", **options
            )
        elif provider in ("azure", "azure-responses"):
            made_client = aio_client(
                f"{provider}:gpt-test", base_url=server.azure_base_url, api_key=AZURE_KEY,
                **options,
            )
        elif provider == "vertex":
            made_client = aio_client(
                "vertex:gemini-test", project="loopback-project", location="us-central1",
                base_url=server.url, token=TOKEN, **options,
            )
        elif provider == "bedrock":
            made_client = BedrockClient(
                "anthropic.claude-test-v1:0", region=REGION, base_url=server.url,
                aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=CREDENTIALS[TEST_KEY_ID],
                **options,
            )
        elif provider == "gemini":
            made_client = GeminiClient(
                "gemini-test", base_url=server.gemini_base_url, api_key="AIza-test", **options
            )
        else:
            made_client = OpenAIClient(
                "gpt-test", base_url=server.openai_base_url, api_key="sk-test", **options
            )
        made.append(made_client)
        return made_client

    yield make
    for made_client in made:
        await made_client.aclose()
