"""The loopback server's clouds, driven by the vendors' own SDKs (test-only dependencies):
the ``openai`` SDK's ``AsyncAzureOpenAI`` client (chat completions on the dated API it
calls, the Responses API on the v1 API, background mode and its cancel) and
``google-genai`` with ``vertexai=True`` (its URL shape, its google-auth credentials
refreshed against the server's token endpoint). Each reads what a scripted turn says,
and each is refused (401) with a wrong credential, as Azure and Vertex refuse it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from google import genai
from google.genai import errors, types
from google.oauth2.credentials import Credentials

from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.clouds import AZURE_KEY, REFRESH_TOKEN, TOKEN

API_VERSION = "2024-10-21"
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}


def azure(server: LoopbackServer, **auth: Any) -> openai.AsyncAzureOpenAI:
    """The SDK's Azure client on the dated API (``azure_endpoint=``), retrying nothing."""
    auth = auth or {"api_key": AZURE_KEY}
    return openai.AsyncAzureOpenAI(azure_endpoint=server.url, api_version=API_VERSION,
                                   max_retries=0, **auth)


def azure_v1(server: LoopbackServer, **auth: Any) -> openai.AsyncAzureOpenAI:
    """The SDK's Azure client on the v1 API (``base_url=.../openai/v1``)."""
    auth = auth or {"api_key": AZURE_KEY}
    return openai.AsyncAzureOpenAI(base_url=server.azure_base_url, api_version="preview",
                                   max_retries=0, **auth)


async def test_azure_chat_streams_text_tool_calls_and_usage() -> None:
    script = [Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})], input_tokens=4),
              Turn(text="sunny in Oslo", input_tokens=9)]
    async with LoopbackServer(script) as server:
        client = azure(server)
        stream = await client.chat.completions.create(
            model="my-deployment", messages=[{"role": "user", "content": "weather?"}],
            tools=[LOOKUP], stream=True, stream_options={"include_usage": True},  # type: ignore[list-item]
        )
        chunks = [chunk async for chunk in stream]
        calls = [call for chunk in chunks if chunk.choices
                 for call in chunk.choices[0].delta.tool_calls or ()]
        assert calls[0].function is not None and calls[0].function.name == "lookup"
        arguments = "".join(call.function.arguments or "" for call in calls if call.function)
        assert arguments == '{"city": "Oslo"}'
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 4
        reply = await client.chat.completions.create(
            model="my-deployment", tools=[LOOKUP],  # type: ignore[list-item]
            messages=[
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "tool_calls": [{"id": calls[0].id or "", "type": "function",
                 "function": {"name": "lookup", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": calls[0].id or "", "content": "sunny"},
            ],
        )
        assert reply.choices[0].message.content == "sunny in Oslo"
        await client.close()
    assert [r.path for r in server.requests] == [
        "/openai/deployments/my-deployment/chat/completions"] * 2
    assert all(r.headers["api-key"] == "***" for r in server.requests)  # sent, then redacted


async def test_azure_refuses_a_wrong_key_or_token_and_a_dated_path_without_its_version() -> None:
    async with LoopbackServer([Turn(text="never")]) as server:
        for client in (azure(server, api_key="wrong"),
                       azure(server, azure_ad_token="expired-token"),
                       azure_v1(server, api_key="wrong")):
            with pytest.raises(openai.AuthenticationError) as caught:
                await client.chat.completions.create(
                    model="d", messages=[{"role": "user", "content": "hi"}])
            assert caught.value.status_code == 401
            await client.close()
        async with httpx.AsyncClient() as http:
            answer = await http.post(
                f"{server.url}/openai/deployments/d/chat/completions",
                headers={"api-key": AZURE_KEY}, json={"messages": []})
        assert answer.status_code == 404
        assert not server.streams


async def test_azure_responses_with_a_token_provider_background_and_cancel() -> None:
    asked = 0

    async def token_provider() -> str:
        nonlocal asked
        asked += 1
        return TOKEN

    async with LoopbackServer([Turn(text="hello from azure"),
                               Turn(text=" ".join(["word"] * 50), delay=0.05)]) as server:
        client = azure_v1(server, azure_ad_token_provider=token_provider)
        stream = await client.responses.create(model="my-deployment", input="hi", stream=True)
        events = [event async for event in stream]
        assert events[-1].type == "response.completed"
        assert events[-1].response.output_text == "hello from azure"  # type: ignore[union-attr]
        background = await client.responses.create(
            model="my-deployment", input="go", background=True, stream=True)
        created = await anext(aiter(background))  # response.created: its id
        response_id = created.response.id  # type: ignore[union-attr]
        await background.close()  # the stream goes; the response is still being made
        cancelled = await client.responses.cancel(response_id)
        assert cancelled.status == "cancelled"
        assert server.background.cancelled == [response_id]
        await client.close()
    assert asked == 3  # the SDK asks its provider before every request
    assert [r.path for r in server.requests] == [
        "/openai/v1/responses", "/openai/v1/responses",
        f"/openai/v1/responses/{response_id}/cancel"]


@contextlib.asynccontextmanager
async def vertex(server: LoopbackServer, credentials: Credentials,
                 api_version: str = "v1") -> AsyncIterator[genai.Client]:
    """google-genai on Vertex AI, pointed at the loopback server, retrying nothing."""
    options = types.HttpOptions(base_url=server.url, api_version=api_version,
                                retry_options=types.HttpRetryOptions(attempts=1))
    client = genai.Client(vertexai=True, project="proj-1", location="us-central1",
                          credentials=credentials, http_options=options)
    try:
        yield client
    finally:
        await client.aio.aclose()
        client.close()


async def test_vertex_streams_and_round_trips_a_function_call() -> None:
    script = [Turn(thinking="look", tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
              Turn(text="sunny in Oslo", input_tokens=6)]
    tool = types.Tool(function_declarations=[types.FunctionDeclaration(
        name="lookup", description="The weather in a city.",
        parameters_json_schema={"type": "object", "properties": {"city": {"type": "string"}}},
    )])
    async with LoopbackServer(script) as server, vertex(server, Credentials(TOKEN)) as client:
        chat = client.aio.chats.create(
            model="gemini-test", config=types.GenerateContentConfig(tools=[tool]))
        asked = await chat.send_message("weather?")
        calls = asked.function_calls or []
        assert [(c.name, c.args) for c in calls] == [("lookup", {"city": "Oslo"})]
        answer = types.Part.from_function_response(name="lookup", response={"output": "sun"})
        chunks = [c async for c in await chat.send_message_stream([answer])]
        assert "".join(c.text or "" for c in chunks) == "sunny in Oslo"
        usage = chunks[-1].usage_metadata
        assert usage is not None and usage.prompt_token_count == 6
    assert {r.path for r in server.requests} == {
        "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-test"
        ":generateContent",
        "/v1/projects/proj-1/locations/us-central1/publishers/google/models/gemini-test"
        ":streamGenerateContent"}


async def test_vertex_refreshes_its_credentials_at_the_token_endpoint() -> None:
    async with LoopbackServer([Turn(text="ok")]) as server:
        server.clouds.tokens = {}  # only what the token endpoint issues
        credentials = Credentials(None, refresh_token=REFRESH_TOKEN, client_id="c",
                                  client_secret="s", token_uri=server.url + "/token")
        async with vertex(server, credentials, api_version="v1beta1") as client:
            reply = await client.aio.models.generate_content(model="gemini-test", contents="hi")
        assert reply.text == "ok"
        assert server.clouds.issued == [credentials.token]
        assert server.requests[-1].path.startswith("/v1beta1/projects/proj-1/")


async def test_vertex_refuses_a_wrong_token() -> None:
    async with LoopbackServer([Turn(text="never")]) as server, vertex(
        server, Credentials("ya29.not-issued")
    ) as client:
        with pytest.raises(errors.ClientError) as caught:
            await client.aio.models.generate_content(model="gemini-test", contents="hi")
        assert caught.value.code == 401
        assert caught.value.status == "UNAUTHENTICATED"
        assert not server.streams
