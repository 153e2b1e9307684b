"""The clouds' doors (``azure:``, ``azure-responses:``, ``vertex:``) over the loopback
server, which checks each request's credential as Azure OpenAI and Vertex AI do: the
stop sweep of every wire (imported from test_wire_stops and run here once per door),
tool rounds, typed output, usage, retries, the fallback across clouds, the credentials
(an API key, a fixed token, a token provider asked per request, Google's credentials
refreshed in a worker thread) and errors and logs that never show a key or a token."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from google.oauth2.credentials import Credentials
from provider_support import RawServer, assert_key_hidden, http_response
from test_wire_stops import (
    test_a_cancel_mid_stream_closes_it_and_keeps_the_text_so_far,
    test_a_stop_at_every_event_leaves_a_transcript_the_wire_accepts,
)

from aimu import aio
from aimu._extras import MissingExtra
from aimu.aio.errors import ModelConnectionError, ModelHTTPError
from aimu.aio.events import TextChunk
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.clouds import AZURE_KEY, REFRESH_TOKEN, TOKEN, service_account_info

__all__ = [
    "test_a_cancel_mid_stream_closes_it_and_keeps_the_text_so_far",
    "test_a_stop_at_every_event_leaves_a_transcript_the_wire_accepts",
]

CLOUDS = ("azure", "azure-responses", "vertex")
SECRET = "s3cr3t-credential-0123456789"


@pytest.fixture(params=CLOUDS)
def provider(request: pytest.FixtureRequest) -> str:
    """Overrides the wires of tests/aio/conftest.py: make_client builds these doors."""
    return str(request.param)


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@dataclass
class Weather:
    city: str
    degrees: int


def door(provider: str, server: LoopbackServer | str, **options: Any) -> aio.ModelClient:
    """A client of ``provider`` for the loopback server (or a root URL)."""
    root = server if isinstance(server, str) else server.url
    if provider == "vertex":
        options.setdefault("token", TOKEN)
        return aio.client("vertex:gemini-test", project="proj-1", location="europe-west4",
                          base_url=root, **options)
    if not {"token", "azure_ad_token_provider"} & set(options):
        options.setdefault("api_key", AZURE_KEY)
    return aio.client(f"{provider}:my-deployment", base_url=root + "/openai/v1", **options)


async def test_a_tool_round_streams_thinking_text_calls_and_usage(
    make_client: Any, server: LoopbackServer, provider: str
) -> None:
    server.script = [
        Turn(thinking="look it up", text="checking", input_tokens=7,
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="sunny in Oslo", input_tokens=12, output_tokens=4),
    ]
    agent = aio.Agent(make_client(), tools=[lookup])
    assert await agent.run("weather in Oslo?") == "sunny in Oslo"
    messages = agent.model_client.messages
    validate(messages)
    first = messages[1]
    assert first.get("thinking") == "look it up"
    assert first["content"] == "checking"
    assert messages[2] == {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"],
                           "name": "lookup", "content": "sunny in Oslo"}
    assert agent.last_run is not None
    assert agent.last_run.usage["input_tokens"] == 19
    assert messages[-1]["aimu_model"].startswith(f"{provider}:")  # type: ignore[typeddict-item]
    paths = {request.path for request in server.requests}
    if provider == "vertex":
        assert paths == {"/v1/projects/loopback-project/locations/us-central1/publishers/google"
                         "/models/gemini-test:streamGenerateContent"}
    else:
        wire = "chat/completions" if provider == "azure" else "responses"
        assert paths == {f"/openai/v1/{wire}"}
    for request in server.requests:  # the credential went, and was redacted in the records
        assert request.headers.get("api-key") or request.headers.get("authorization")


async def test_typed_output_asks_for_the_schema(
    make_client: Any, server: LoopbackServer, provider: str
) -> None:
    server.script = [Turn(text='{"city": "Oslo", "degrees": 3}')]
    agent = aio.Agent(make_client(), output_type=Weather)
    assert await agent.run("weather?") == Weather("Oslo", 3)
    sent = server.requests[-1].body
    if provider == "vertex":
        assert sent["generationConfig"]["responseJsonSchema"]["required"] == ["city", "degrees"]
    elif provider == "azure":
        assert sent["response_format"]["type"] == "json_schema"
    else:
        assert sent["text"]["format"]["type"] == "json_schema"


async def test_a_429_is_retried(make_client: Any, server: LoopbackServer) -> None:
    server.script = [Turn(fault="http_429", retry_after="0"), Turn(text="after the wait")]
    agent = aio.Agent(make_client(retry_delay=0))
    assert await agent.run("hi") == "after the wait"
    assert len(server.requests) == 2
    assert agent.last_run is not None and agent.last_run.retries == 1


async def test_a_failing_cloud_hands_the_turn_to_another_cloud() -> None:
    script = [Turn(fault="http_503"), Turn(text="from vertex"), Turn(fault="http_503"),
              Turn(text="from azure")]
    async with LoopbackServer(script) as server:
        model = aio.FallbackModel(door("azure", server, retries=0), door("vertex", server))
        agent = aio.Agent(model)
        assert await agent.run("hi") == "from vertex"
        assert model.messages[-1]["aimu_model"] == "vertex:gemini-test"  # type: ignore[typeddict-item]
        back = aio.FallbackModel(door("vertex", server, retries=0),
                                 door("azure-responses", server))
        back_agent = aio.Agent(back)
        back_agent.restore(model.messages)
        assert await back_agent.run("and now?") == "from azure"
        validate(back.messages)
        await model.aclose()
        await back.aclose()


# -- credentials ----------------------------------------------------------------------


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_a_wrong_credential_is_refused_and_the_error_says_what_to_check(
    cloud: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with LoopbackServer([Turn(text="never")]) as server:
        wrong = {"token": SECRET} if cloud == "vertex" else {"api_key": SECRET}
        model = door(cloud, server, **wrong)
        with pytest.raises(ModelHTTPError) as caught:
            await aio.chat(model, "hi")
        await model.aclose()
    error = caught.value
    assert error.status_code == 401
    assert ("application default credentials" if cloud == "vertex"
            else "AZURE_OPENAI_API_KEY") in str(error)
    assert not server.streams  # refused at the door: the wire never answered
    assert_key_hidden([error], SECRET)
    assert SECRET not in caplog.text


@pytest.mark.parametrize(("cloud", "how"), [
    ("azure", "api_key"), ("azure", "token"), ("azure-responses", "azure_ad_token_provider"),
    ("vertex", "token"),
])
async def test_a_credential_a_server_echoes_is_redacted(
    cloud: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    echo = json.dumps({"error": {"code": "401", "message": f"bad credential {SECRET}"}})
    response = http_response(echo.encode(), status="401 Unauthorized",
                             content_type="application/json")
    value: Any = SECRET if how != "azure_ad_token_provider" else (lambda: SECRET)
    async with RawServer(response) as raw:
        model = door(cloud, raw.url, **{how: value})
        with pytest.raises(ModelHTTPError) as caught:
            await aio.chat(model, "hi")
        await model.aclose()
        head = raw.requests[0][0]
    sent = f"api-key: {SECRET}" if how == "api_key" else f"Authorization: Bearer {SECRET}"
    assert sent.lower() in head.lower()
    assert "bad credential ***" in str(caught.value)
    assert_key_hidden([caught.value], SECRET)
    assert repr(model).count(SECRET) == 0
    assert SECRET not in caplog.text


async def test_the_token_provider_is_asked_for_each_request_off_the_loop() -> None:
    """A plain function runs in a worker thread; a rotated token is used at once."""
    asked: list[str] = []
    current = ["old-token-1"]

    def provider() -> str:
        asked.append(threading.current_thread().name)
        return current[0]

    script = [Turn(text="one"), Turn(text="two")]
    async with LoopbackServer(script) as server:
        server.clouds.tokens = {"old-token-1": float("inf")}
        model = door("azure", server, azure_ad_token_provider=provider)
        assert (await aio.chat(model, "a"))["content"] == "one"
        server.clouds.tokens = {"new-token-2": float("inf")}  # the old one expired
        current[0] = "new-token-2"
        assert (await aio.chat(model, "b"))["content"] == "two"
        await model.aclose()
    assert len(asked) == 2
    assert threading.main_thread().name not in asked


async def test_an_async_token_provider_is_awaited_and_its_failure_named() -> None:
    calls = 0

    async def provider() -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the identity endpoint is down")
        return TOKEN

    async with LoopbackServer([Turn(text="ok")]) as server:
        model = door("azure-responses", server, azure_ad_token_provider=provider)
        assert (await aio.chat(model, "a"))["content"] == "ok"
        with pytest.raises(ModelConnectionError, match="azure_ad_token_provider="):
            await aio.chat(model, "b")
        await model.aclose()
    assert len(server.requests) == 1


def test_one_credential_and_a_resource_are_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AZURE_OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("AZURE_OPENAI_BASE_URL", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    with pytest.raises(ValueError, match="AZURE_OPENAI_BASE_URL"):
        aio.client("azure:d", api_key="k")
    with pytest.raises(ValueError, match="AZURE_OPENAI_API_KEY"):
        aio.client("azure:d", base_url="https://r.openai.azure.com/openai/v1")
    with pytest.raises(ValueError, match="one credential"):
        aio.client("azure:d", base_url="https://r.openai.azure.com/openai/v1", api_key="k",
                   token="t")
    with pytest.raises(ValueError, match="GOOGLE_CLOUD_PROJECT"):
        aio.client("vertex:gemini-2.5-flash", token="t")


def test_the_url_comes_from_the_environment_and_the_location(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AZURE_OPENAI_BASE_URL", "https://res.openai.azure.com/openai/v1")
    monkeypatch.setenv("AZURE_OPENAI_API_KEY", "k")
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "my-proj")
    monkeypatch.setenv("GOOGLE_CLOUD_LOCATION", "us-east5")
    azure = aio.client("azure:dep")
    assert azure.host == "https://res.openai.azure.com/openai/v1"
    vertex = aio.client("vertex:gemini-2.5-flash", token="t")
    assert vertex.url_for(True) == (  # type: ignore[attr-defined]
        "https://us-east5-aiplatform.googleapis.com/v1/projects/my-proj/locations/us-east5"
        "/publishers/google/models/gemini-2.5-flash:streamGenerateContent?alt=sse")
    for location, host in (("global", "https://aiplatform.googleapis.com"),
                           ("eu", "https://aiplatform.eu.rep.googleapis.com")):
        placed = aio.client("vertex:m", location=location, token="t")
        assert placed.url_for(True).startswith(f"{host}/v1/projects/my-proj/"  # type: ignore[attr-defined]
                                               f"locations/{location}/")


def adc_file(tmp_path: Path, server: LoopbackServer) -> Path:
    """Application default credentials of a service account whose token endpoint is the
    server's."""
    path = tmp_path / "adc.json"
    path.write_text(json.dumps(service_account_info(server.url + "/token")))
    return path


async def test_application_default_credentials_are_refreshed_before_they_expire(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """google-auth counts a token that expires within minutes as expired: one that lives
    100 s is refreshed before every request, one that lives an hour once. No token, and
    no part of the signed assertion, reaches a log record (google-auth's own DEBUG
    records of the token exchange included)."""
    caplog.set_level(logging.DEBUG)
    async with LoopbackServer([Turn(text="one"), Turn(text="two"), Turn(text="three")]) as server:
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path, server)))
        server.clouds.tokens = {}  # only tokens the server issues
        server.clouds.token_lifetime = 100
        model = door("vertex", server, token=None)
        assert (await aio.chat(model, "a"))["content"] == "one"
        assert (await aio.chat(model, "b"))["content"] == "two"
        assert server.clouds.issued == ["ya29.loopback-1", "ya29.loopback-2"]
        server.clouds.token_lifetime = 3600
        server.script = [Turn(text="three"), Turn(text="four")]
        assert (await aio.chat(model, "c"))["content"] == "three"
        assert (await aio.chat(model, "d"))["content"] == "four"
        assert len(server.clouds.issued) == 3
        await model.aclose()
    assert [r.path for r in server.requests].count("/token") == 3
    assert "/token" in caplog.text  # the exchange was logged, at DEBUG...
    for token in server.clouds.issued:  # ...without its token
        assert token not in caplog.text
    assert "PRIVATE KEY" not in caplog.text and "assertion=" not in caplog.text


async def test_the_refresh_runs_in_a_worker_thread(tmp_path: Path) -> None:
    threads: list[str] = []

    class Watched(Credentials):  # type: ignore[misc]
        def refresh(self, request: Any) -> None:
            threads.append(threading.current_thread().name)
            super().refresh(request)

    async with LoopbackServer([Turn(text="ok")] * 3) as server:
        credentials = Watched(None, refresh_token=REFRESH_TOKEN, client_id="c",
                              client_secret="s", token_uri=server.url + "/token")
        model = door("vertex", server, token=None, credentials=credentials)
        replies = await asyncio.gather(*(aio.chat(model.fork(), "hi") for _ in range(3)))
        assert [reply["content"] for reply in replies] == ["ok"] * 3
        await model.aclose()
    assert len(threads) == 1  # three requests at once: one refresh
    assert threads != [threading.current_thread().name]


async def test_a_refused_refresh_names_the_credentials_to_check(tmp_path: Path) -> None:
    async with LoopbackServer([Turn(text="never")]) as server:
        credentials = Credentials(None, refresh_token="revoked", client_id="c",
                                  client_secret="s", token_uri=server.url + "/token")
        model = door("vertex", server, token=None, credentials=credentials)
        with pytest.raises(ModelConnectionError, match="GOOGLE_APPLICATION_CREDENTIALS"):
            await aio.chat(model, "hi")
        await model.aclose()
    assert not server.streams


def test_vertex_without_google_auth_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "google.auth.transport.requests", None)
    with pytest.raises(MissingExtra, match=r"vertex extra .*\[vertex\]"):
        aio.client("vertex:m", project="p")
    assert aio.client("vertex:m", project="p", token="t").provider == "vertex"


async def test_a_background_response_is_re_attached_and_cancelled_with_a_fresh_token() -> None:
    """azure-responses: background=True with a token provider: the create, the re-attach
    after a dropped stream (GET) and the cancel a stop sends (POST .../cancel) each carry
    the provider's current token, and the server takes each one."""
    tokens = iter(f"entra-{n}" for n in range(1, 10))
    given: list[str] = []

    async def provider() -> str:
        given.append(next(tokens))
        return given[-1]

    long = " ".join(f"w{n}" for n in range(80))
    script = [Turn(text=long, delay=0.02, fault="drop", fault_after=2)]
    async with LoopbackServer(script) as server:
        server.clouds.tokens = {f"entra-{n}": float("inf") for n in range(1, 10)}
        model = door("azure-responses", server, azure_ad_token_provider=provider,
                     background=True)
        handle = aio.RunHandle.start(aio.Agent(model).run("go"))
        seen = 0
        async for event in handle.events():
            if isinstance(event, TextChunk):
                seen += 1
                if seen == 4:  # past the drop: the stream was re-attached
                    handle.cancel()
                    break
        with pytest.raises(asyncio.CancelledError):
            await handle
        (response_id,) = server.background.cancelled
        await model.aclose()
    calls = [(r.method, r.path) for r in server.requests]
    assert calls == [("POST", "/openai/v1/responses"),
                     ("GET", f"/openai/v1/responses/{response_id}"),
                     ("POST", f"/openai/v1/responses/{response_id}/cancel")]
    assert given == ["entra-1", "entra-2", "entra-3"]
    assert model.messages[-1].get("aimu_partial") is True


@pytest.mark.parametrize("cloud", ["azure", "vertex"])
async def test_cached_input_tokens_are_read_as_each_cloud_reports_them(cloud: str) -> None:
    """Azure reports ``prompt_tokens_details.cached_tokens``, Vertex AI
    ``cachedContentTokenCount``: both become ``cached_input_tokens``."""
    if cloud == "azure":
        events = [
            {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]},
            {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 32}}},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    else:
        event = {"candidates": [{"content": {"role": "model", "parts": [{"text": "ok"}]},
                                 "finishReason": "STOP"}],
                 "usageMetadata": {"promptTokenCount": 40, "candidatesTokenCount": 1,
                                   "cachedContentTokenCount": 32}, "responseId": "r1"}
        body = f"data: {json.dumps(event)}\n\n"
    response = http_response(body.encode(), content_type="text/event-stream")
    async with RawServer(response) as raw:
        model = door(cloud, raw.url)
        chunks = [chunk async for chunk in model.stream_turn([{"role": "user", "content": "hi"}])]
        await model.aclose()
    assert chunks[-1].usage == {  # type: ignore[union-attr]
        "input_tokens": 40, "output_tokens": 1, "cached_input_tokens": 32}


async def test_the_credentials_quota_project_goes_as_google_s_sdks_send_it() -> None:
    async with LoopbackServer([Turn(text="ok"), Turn(text="ok")]) as server:
        billed = door("vertex", server, token=None,
                      credentials=Credentials(TOKEN, quota_project_id="billing-project"))
        plain = door("vertex", server, token=None, credentials=Credentials(TOKEN))
        await aio.chat(billed, "a")
        await aio.chat(plain, "b")
        await billed.aclose()
        await plain.aclose()
    assert [r.headers.get("x-goog-user-project") for r in server.requests] == [
        "billing-project", None]


@pytest.mark.parametrize(("spec", "options"), [
    ("azure:d", {"token": "t"}),
    ("azure:d", {"azure_ad_token_provider": lambda: "t"}),
    ("azure-responses:d", {"token": "t"}),
    ("vertex:m", {"project": "p", "token": "t"}),
    ("vertex:m", {"project": "p", "credentials": Credentials("t")}),
])
def test_a_cloud_credential_other_than_a_key_gets_no_missing_key_warning(
    spec: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The no-key warning (a keyed wire sending no key) is not for a client that
    authenticates another way: Azure with a token warned 'set AZURE_OPENAI_API_KEY', and
    Vertex 'set GEMINI_API_KEY'."""
    import warnings

    from aimu.aio.providers import _report

    monkeypatch.setattr(_report, "_KEYLESS", set())  # each case its own first time
    monkeypatch.delenv("AZURE_OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("GEMINI_API_KEY", raising=False)
    monkeypatch.delenv("GOOGLE_API_KEY", raising=False)
    host = {"base_url": "https://r.openai.azure.com/openai/v1"} if spec.startswith("azure") \
        else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aio.client(spec, **host, **options)
