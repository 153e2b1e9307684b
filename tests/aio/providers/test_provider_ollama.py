"""What only the Ollama provider does: host resolution, its wire format, options and
think passed through, errors inside a 200 stream."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from provider_support import RawServer, http_response

from aimu import aio
from aimu.aio.client import TextDelta, ThinkingDelta, TurnDone, client
from aimu.aio.errors import ModelHTTPError, ModelProtocolError
from aimu.aio.providers.ollama import DEFAULT_HOST, OllamaClient, resolve_host, to_wire
from aimu.aio.transcript import Message
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("", DEFAULT_HOST),
        ("  ", DEFAULT_HOST),
        ("gpu-box", "http://gpu-box:11434"),
        ("gpu-box:8000", "http://gpu-box:8000"),
        (":8000", "http://127.0.0.1:8000"),
        ("0.0.0.0", "http://0.0.0.0:11434"),
        ("http://gpu-box", "http://gpu-box:80"),
        ("https://gpu-box", "https://gpu-box:443"),
        ("https://gpu-box:9443/ollama/", "https://gpu-box:9443/ollama"),
        ("gpu-box:8000/", "http://gpu-box:8000"),
        ("[::1]:8000", "http://[::1]:8000"),
        ("[::1]", "http://[::1]:11434"),
    ],
)
def test_host_is_normalised_like_ollama_does(given: str, expected: str) -> None:
    assert resolve_host(given) == expected


def test_host_comes_from_the_argument_then_ollama_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OLLAMA_HOST", raising=False)
    assert OllamaClient("m").host == DEFAULT_HOST
    monkeypatch.setenv("OLLAMA_HOST", "gpu-box:1234")
    assert OllamaClient("m").host == "http://gpu-box:1234"
    assert OllamaClient("m", host="other:99").host == "http://other:99"


def test_a_bad_port_is_refused_naming_the_host() -> None:
    with pytest.raises(ValueError, match="gpu-box:notaport"):
        resolve_host("gpu-box:notaport")


def test_the_client_factory_makes_an_ollama_client() -> None:
    model = client("ollama:qwen3:8b", host="h:1", options={"num_ctx": 8192})
    assert isinstance(model, OllamaClient)
    assert model.model == "qwen3:8b"
    assert repr(model) == "<OllamaClient ollama:qwen3:8b at http://h:1>"


def test_importing_aimu_does_not_import_ollama() -> None:
    code = (
        "import sys\nimport aimu\nfrom aimu import aio\naio.ModelClient\n"
        "print('ollama' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_wire_form_of_each_message() -> None:
    assert to_wire({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}
    assert to_wire({
        "role": "assistant", "content": "", "thinking": "hmm", "aimu_partial": True,
        "tool_calls": [{"id": "c1", "type": "function",
                        "function": {"name": "f", "arguments": {"x": [1, {"y": None}]}}}],
    }) == {
        "role": "assistant", "content": "", "thinking": "hmm",
        "tool_calls": [{"function": {"name": "f", "arguments": {"x": [1, {"y": None}]}}}],
    }
    assert to_wire({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}) == {
        "role": "tool", "content": "42", "tool_name": "f"
    }


async def test_options_think_and_keep_alive_are_passed_through(server: LoopbackServer) -> None:
    server.script = [Turn(text="ok")]
    async with OllamaClient(
        "qwen3", host=server.url, options={"temperature": 0.1, "num_ctx": 4096},
        think="high", keep_alive="5m",
    ) as model:
        await aio.chat(model, "hi")
    body = server.requests[-1].body
    assert body["model"] == "qwen3"
    assert body["options"] == {"temperature": 0.1, "num_ctx": 4096}
    assert body["think"] == "high"
    assert body["keep_alive"] == "5m"


async def test_thinking_goes_back_in_its_own_field(server: LoopbackServer) -> None:
    server.script = [Turn(thinking="Let me think.", text="Answer."), Turn(text="Again.")]
    messages: list[Message] = []
    async with OllamaClient("m", host=server.url, think=True) as model:
        reply = await aio.chat(model, "q1", messages=messages)
        assert reply == {"role": "assistant", "content": "Answer.", "thinking": "Let me think."}
        await aio.chat(model, "q2", messages=messages)
    sent = server.requests[-1].body["messages"][1]
    assert sent == {"role": "assistant", "content": "Answer.", "thinking": "Let me think."}


async def test_a_server_that_omits_counts_gives_zero_usage_marked_unreported() -> None:
    lines = [
        {"message": {"role": "assistant", "content": "hi"}, "done": False},
        {"message": {"role": "assistant", "content": ""}, "done": True},
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    async with RawServer(http_response(body, content_type="application/x-ndjson")) as raw:
        model = OllamaClient("m", host=raw.url)
        async with model:
            chunks = [c async for c in model.stream_turn([{"role": "user", "content": "x"}])]
    zero = {"input_tokens": 0, "output_tokens": 0}
    assert chunks == [TextDelta("hi"), TurnDone(zero, None)]  # type: ignore[arg-type]
    assert isinstance(chunks[-1], TurnDone) and chunks[-1].usage_reported is False


async def test_an_error_line_inside_the_stream_is_an_http_error_with_its_text() -> None:
    body = (
        b'{"message": {"role": "assistant", "thinking": "hm"}, "done": false}\n'
        b'{"error": "model runner has unexpectedly stopped"}\n'
    )
    async with RawServer(http_response(body, content_type="application/x-ndjson")) as raw:
        model = OllamaClient("m", host=raw.url)
        seen = []
        async with model:
            with pytest.raises(ModelHTTPError, match="unexpectedly stopped") as caught:
                async for chunk in model.stream_turn([{"role": "user", "content": "x"}]):
                    seen.append(chunk)
    assert seen == [ThinkingDelta("hm")]
    assert "mid-reply" in str(caught.value)
    assert model.host in str(caught.value)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        (b"[1, 2]\n", "could not be understood"),
        (b'{"message": "not an object", "done": false}\n', "could not be understood"),
        (b"\n", "without the final 'done' message"),
    ],
)
async def test_a_line_of_the_wrong_shape_is_a_protocol_error(line: bytes, match: str) -> None:
    async with RawServer(http_response(line, content_type="application/x-ndjson")) as raw:
        model = OllamaClient("m", host=raw.url)
        async with model:
            with pytest.raises(ModelProtocolError, match=match):
                async for _ in model.stream_turn([{"role": "user", "content": "x"}]):
                    pass


@pytest.mark.parametrize(
    "trailer", [b"[1, 2]\n", b'{"error": "late"}\n', b"not json\n", b'{"message": 3}\n']
)
async def test_whatever_follows_the_done_line_is_ignored(trailer: bytes) -> None:
    # The reply is complete at done; a bad line after it only costs the connection.
    lines = [
        {"message": {"role": "assistant", "content": "hi"}, "done": False},
        {"message": {"role": "assistant", "content": ""}, "done": True, "eval_count": 1},
    ]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines) + trailer
    async with RawServer(http_response(body, content_type="application/x-ndjson")) as raw:
        model, messages = OllamaClient("m", host=raw.url), list[Message]()
        async with model:
            reply = await aio.chat(model, "x", messages=messages, stream=True)
            chunks = [chunk async for chunk in reply]
    assert chunks == [TextDelta("hi"), TurnDone({"input_tokens": 0, "output_tokens": 1}, None)]
    assert messages[-1] == {"role": "assistant", "content": "hi"}


async def test_an_http_error_with_a_plain_text_body_keeps_the_text() -> None:
    response = http_response(
        b"model 'nope' not found", status="404 Not Found", content_type="text/plain"
    )
    async with RawServer(response) as raw:
        model = OllamaClient("nope", host=raw.url)
        async with model:
            with pytest.raises(ModelHTTPError, match=r"HTTP 404.*model 'nope' not found") as caught:
                await aio.chat(model, "x")
    assert caught.value.status_code == 404


async def test_the_pool_is_made_on_first_use_and_can_be_reopened(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="a"), Turn(text="b")]
    model = OllamaClient("m", host=server.url)
    assert model._pool.http is None  # nothing bound to a loop before the first request
    await aio.chat(model, "1")
    await model.aclose()
    assert model._pool.http is None
    assert (await aio.chat(model, "2"))["content"] == "b"
    await model.aclose()
