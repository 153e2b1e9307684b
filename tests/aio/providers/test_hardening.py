"""Defects found outside trials (issue 10), each pinned over the real wire: unencodable
text, restore that changes nothing when it fails, an agent across two event loops,
credentials in logs and chained errors, the SDK import, Ollama arguments as a string,
the stop reason, and strict chat templates."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from provider_support import RawServer, client_at, http_response

from aimu import aio
from aimu.aio.client import ModelClient, ToolCallDelta, TurnAssembler, TurnDone
from aimu.aio.errors import ModelHTTPError, ModelProtocolError
from aimu.aio.events import RunFinished, TextChunk
from aimu.aio.providers.ollama import OllamaClient
from aimu.aio.providers.openai import OpenAIClient
from aimu.aio.transcript import validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer

SECRET = "sk-very-secret-0123456789"


def make(provider: str, server: LoopbackServer, **options: Any) -> ModelClient:
    return client_at(provider, server.url, "k", **options)


def chain(error: BaseException) -> list[BaseException]:
    """``error`` and every exception chained to it, as cause or context."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [error]
    while todo:
        item = todo.pop()
        if item is None or any(item is seen for seen in found):
            continue
        found.append(item)
        todo += [item.__cause__, item.__context__]
    return found


def texts_of(error: BaseException) -> str:
    parts = [repr(error), str(error), repr(error.args)]
    parts += [repr(value) for value in getattr(error, "__dict__", {}).values()]
    return "\n".join(parts)


# -- 1. unencodable text from a server --------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_lone_and_split_surrogates_leave_an_encodable_transcript_and_store(
    provider: str, tmp_path: Path, stream: bool
) -> None:
    script = [
        Turn(text="bad \ud800 end", chunks=1),
        Turn(text="a\ud83d\ude00b", chunks=2),  # the pair split across two chunks
        Turn(text="fine"),
    ]
    async with LoopbackServer(script) as server:
        model = make(provider, server)
        store = aio.JSONLStore(tmp_path)
        agent = aio.Agent(model, store=store, session="s")
        seen: list[str] = []
        for task in ("one", "two", "three"):
            if stream:
                async for event in agent.run(task, stream=True):
                    if isinstance(event, TextChunk):
                        seen.append(event.text)
            else:
                await agent.run(task)
        messages = agent.model_client.messages
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert replies == ["bad \ufffd end", "a\U0001f600b", "fine"]
        if stream:
            assert "".join(seen) == "".join(replies)
        assert await store.load("s") == messages
        validate(messages)
        await agent.aclose()
        await model.aclose()


# -- 2, 3. restore validates everything before it changes anything ---------------------


def deep(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"v": value}
    return value


def cyclic() -> dict[str, Any]:
    value: dict[str, Any] = {"a": []}
    value["a"].append(value)
    return value


@pytest.mark.parametrize(
    "bad",
    [
        [{"role": "user", "content": "bad \ud800"}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": cyclic()}}]}],
        [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep(50_000)}}
        ]}],
    ],
    ids=["lone-surrogate", "cyclic-arguments", "50000-deep-arguments"],
)
async def test_a_bad_restore_is_a_value_error_and_changes_neither_memory_nor_store(
    tmp_path: Path, bad: list[Any]
) -> None:
    store = aio.JSONLStore(tmp_path)
    agent = aio.Agent(aio.client("test"), store=store, session="s")
    await agent.run("hello")
    before = [dict(m) for m in agent.model_client.messages]
    with pytest.raises(ValueError, match=r"message 1|message 0"):
        agent.restore(bad)
    assert agent.model_client.messages == before
    assert await store.load("s") == before
    await agent.aclose()


# -- 7. one agent, two event loops ------------------------------------------------------


def test_one_agent_serves_two_successive_asyncio_runs(provider: str) -> None:
    with LoopbackServer.in_thread([Turn(text="one"), Turn(text="two")]) as server:
        model = make(provider, server)
        agent = aio.Agent(model)
        assert asyncio.run(agent.run("first")) == "one"
        # The first loop is closed now; its connections were closed with it.
        assert asyncio.run(agent.run("second")) == "two"
        asyncio.run(model.aclose())
        assert server.connections_accepted == 2


# -- 9. credentials ---------------------------------------------------------------------


async def test_credentials_in_the_url_never_reach_the_httpx_log(
    provider: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with LoopbackServer([Turn(text="hi")]) as server:
        url = server.url.replace("http://", f"http://user:{SECRET}@")
        model: ModelClient
        if provider == "ollama":
            model = OllamaClient("m", host=url)
        else:
            model = OpenAIClient("m", base_url=url + "/v1")
        with caplog.at_level(logging.DEBUG):
            assert (await aio.chat(model, "x"))["content"] == "hi"
        await model.aclose()
    assert "HTTP Request: POST" in caplog.text  # the line exists, without the secret
    assert SECRET not in caplog.text
    assert SECRET not in repr(model)
    assert server.requests[-1].headers["authorization"] == "***"  # sent, as Basic auth


@pytest.mark.parametrize("stream", [True, False])
async def test_a_key_echoed_in_a_malformed_line_survives_nowhere_in_the_error(
    provider: str, stream: bool
) -> None:
    if provider == "ollama":
        body, kind = b'{"message": {"content": "' + SECRET.encode() + b'"\n', "x-ndjson"
    else:
        body, kind = b'data: {"choices": "' + SECRET.encode() + b'\n\n', "event-stream"
    if not stream:
        body = body.replace(b"data: ", b"")
    async with RawServer(http_response(body, content_type=f"application/{kind}")) as raw:
        model: ModelClient
        if provider == "ollama":
            model = OllamaClient("m", host=raw.url.replace("http://", f"http://u:{SECRET}@"))
        else:
            model = OpenAIClient("m", base_url=raw.url + "/v1", api_key=SECRET)
        with pytest.raises(ModelProtocolError) as caught:
            async for _ in model.stream_turn([{"role": "user", "content": "x"}], stream=stream):
                pass
        await model.aclose()
    assert "***" in str(caught.value)  # the line is quoted, the key redacted
    for error in chain(caught.value):
        assert SECRET not in texts_of(error)
        assert SECRET not in str(getattr(error, "doc", ""))


# -- 11. the SDK is imported when a client is built, never inside the loop --------------


def test_a_provider_loads_its_http_stack_when_its_client_is_built() -> None:
    code = (
        "import sys\n"
        "from aimu import aio\n"
        "assert 'httpx' not in sys.modules and 'ollama' not in sys.modules\n"
        "model = aio.client('ollama:m')\n"
        "assert 'httpx' in sys.modules\n"
        "from aimu.aio.providers._pool import ssl_context\n"
        "assert ssl_context.cache_info().currsize == 1  # the TLS context exists already\n"
        "assert model._pool.http is None  # bound to a loop only when one uses it\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- 12. Ollama arguments sent as a JSON string ------------------------------------------


def ollama_lines(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def tool_call_reply(arguments: object) -> bytes:
    call = {"function": {"name": "weather", "arguments": arguments}}
    return http_response(
        ollama_lines(
            {"message": {"role": "assistant", "content": "", "tool_calls": [call]}, "done": False},
            {"message": {"role": "assistant", "content": ""}, "done": True},
        ),
        content_type="application/x-ndjson",
    )


@pytest.mark.parametrize(
    ("arguments", "expected", "error"),
    [
        ('{"city": "Oslo"}', {"city": "Oslo"}, None),
        ('{"city": ', {}, "were not valid JSON"),
        ("[1, 2]", {}, "expected a JSON object, got list"),
        (42, {}, "must be a JSON object, got int"),
    ],
)
async def test_ollama_arguments_as_a_string_are_parsed_or_become_a_tool_error(
    arguments: object, expected: dict[str, Any], error: str | None
) -> None:
    async with RawServer(tool_call_reply(arguments)) as raw, OllamaClient(
        "m", host=raw.url
    ) as model:
        chunks = [c async for c in model.stream_turn([{"role": "user", "content": "x"}])]
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.call["function"]["arguments"] == expected
    if error is None:
        assert call.error is None
    else:
        assert call.error is not None and error in call.error


async def test_an_agent_hands_bad_ollama_arguments_to_the_model_as_a_tool_error() -> None:
    def weather(city: str) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    async with RawServer(tool_call_reply('{"city": ')) as raw:
        agent = aio.Agent(OllamaClient("m", host=raw.url), tools=[weather], max_rounds=1)
        events = [event async for event in agent.run("weather?", stream=True)]
        await agent.model_client.aclose()
    finished = events[-1]
    assert isinstance(finished, RunFinished) and finished.status == "max_rounds"
    (result, *_) = [m for m in agent.model_client.messages if m["role"] == "tool"]
    assert "were not valid JSON" in result["content"]
    second = json.loads(raw.requests[1][1])
    assert any("were not valid JSON" in m["content"] for m in second["messages"])


# -- 13. the stop reason -----------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_a_reply_cut_off_by_the_token_limit_says_length(
    provider: str, stream: bool
) -> None:
    async with LoopbackServer([Turn(text="cut sho", stop_reason="length")]) as server:
        model = make(provider, server)
        assembler = TurnAssembler()
        async for chunk in model.stream_turn([{"role": "user", "content": "x"}], stream=stream):
            assembler.add(chunk)
        await model.aclose()
    assert assembler.done and assembler.stop_reason == "length"
    assert assembler.text == "cut sho"


async def test_every_turn_done_carries_its_stop_reason(provider: str) -> None:
    script = [Turn(text="a"), Turn(tool_calls=[ScriptedCall("f", {})])]
    async with LoopbackServer(script) as server:
        model = make(provider, server)
        reasons = []
        for _ in script:
            async for chunk in model.stream_turn([{"role": "user", "content": "x"}]):
                if isinstance(chunk, TurnDone):
                    reasons.append(chunk.stop_reason)
        await model.aclose()
    # Ollama says "stop" after tool calls too; OpenAI-compatible servers say "tool_calls".
    assert reasons == ["stop", "stop" if provider == "ollama" else "tool_calls"]


# -- 16. strict chat templates -----------------------------------------------------------


def answer(request: dict[str, Any]) -> Turn:
    said = [m for m in request["messages"] if m["role"] == "user"][-1]["content"]
    if said.endswith("fail"):
        return Turn(fault="http_500")
    return Turn(text="one two three four five six", delay=0.01)


async def stop_after_first_text(agent: aio.Agent, task: str | None) -> None:
    """Close the run's stream at its first text chunk: a stop mid-reply."""
    events = agent.run(task, stream=True) if task is not None else agent.resume(stream=True)
    async for event in events:
        if isinstance(event, TextChunk):
            break
    await events.aclose()


async def every_stop_and_resume_path(agent: aio.Agent) -> None:
    await stop_after_first_text(agent, "first")  # user, assistant (partial)
    await agent.resume()  # ... assistant (partial), assistant
    await agent.run("second")  # ... assistant, user
    with pytest.raises(ModelHTTPError, match="HTTP 500"):
        await agent.run("now fail")  # a failed turn leaves its user message
    await agent.run("third")  # ... user, user
    await stop_after_first_text(agent, "fourth")
    await stop_after_first_text(agent, None)  # a resume stopped mid-reply too
    await agent.run("fifth")


# The chat wires (and Gemini's and Anthropic's turns) send adjacent same-role messages as
# one. The Responses API takes input items, where a cut reply and its continuation are two
# assistant items, which OpenAI's API accepts: no strict template applies to that wire.
@pytest.mark.parametrize("provider", ["ollama", "openai", "gemini", "anthropic"])
async def test_every_stop_and_resume_path_passes_a_strict_alternation_template(
    provider: str,
) -> None:
    async with LoopbackServer(answer, strict_alternation=True) as server:
        model = make(provider, server)
        agent = aio.Agent(model)
        await every_stop_and_resume_path(agent)
        roles = [m["role"] for m in agent.model_client.messages]
        assert ["assistant", "assistant"] in [roles[i : i + 2] for i in range(len(roles))]
        assert ["user", "user"] in [roles[i : i + 2] for i in range(len(roles))]
        assert len(server.requests) == 8  # each run above would have raised on a 400
        body = server.requests[-1].body
        last = body["contents"] if provider == "gemini" else body["messages"]
        assert all(a["role"] != b["role"] for a, b in itertools.pairwise(last))
        await model.aclose()


# Gemini's client always sends adjacent same-role turns as one content (no merge_roles).
@pytest.mark.parametrize("provider", ["ollama", "openai"])
async def test_without_merging_a_strict_template_refuses_adjacent_turns(provider: str) -> None:
    async with LoopbackServer(answer, strict_alternation=True) as server:
        model = make(provider, server, merge_roles=False)
        agent = aio.Agent(model)
        with pytest.raises(ModelHTTPError, match="HTTP 500"):
            await agent.run("fail")
        with pytest.raises(ModelHTTPError, match=r"HTTP 400.*roles must alternate"):
            await agent.run("again")
        await model.aclose()


def test_forks_starting_together_in_a_new_loop_share_one_pool(provider: str) -> None:
    with LoopbackServer.in_thread([Turn(text="a")] * 4) as server:
        model = make(provider, server)
        forks = [model.fork() for _ in range(3)]

        async def together() -> list[str]:
            replies = await asyncio.gather(*(aio.chat(f, "x") for f in [model, *forks]))
            return [reply["content"] for reply in replies]

        assert asyncio.run(together()) == ["a"] * 4
        assert all(f._pool.http is model._pool.http for f in forks)  # type: ignore[attr-defined]
        asyncio.run(model.aclose())


# -- issue 29 item 5: numbers too large for a float ----------------------------------------------


@pytest.mark.parametrize("option", ["timeout", "connect_timeout"])
@pytest.mark.parametrize("seconds", [10**400, float("nan"), 0], ids=["10**400", "nan", "0"])
def test_a_client_timeout_that_is_not_a_positive_finite_number_is_refused(
    provider: str, option: str, seconds: float
) -> None:
    with pytest.raises(ValueError, match=f"{option} must be a positive number of seconds"):
        aio.client(f"{provider}:m", **{option: seconds})
    with pytest.raises(ValueError, match="context_window"):
        aio.client(f"{provider}:m", context_window=10**400)


@pytest.mark.parametrize("stream", [True, False])
async def test_a_token_count_too_large_for_a_store_is_not_taken(
    provider: str, stream: bool
) -> None:
    """A server that reports 10**400 tokens: the count is not taken (and so not priced
    into an OverflowError); the reply itself is."""
    async with LoopbackServer([Turn(text="hi", input_tokens=10**400)]) as server:
        model = make(provider, server)
        assembler = TurnAssembler()
        async for chunk in model.stream_turn([{"role": "user", "content": "x"}], stream=stream):
            assembler.add(chunk)
        await model.aclose()
    assert assembler.text == "hi" and assembler.done
    assert assembler.usage["input_tokens"] == 0 and not assembler.usage_reported
