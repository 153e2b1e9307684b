"""The loopback server's Bedrock wire, driven by boto3's ``bedrock-runtime`` client.

boto3 signs every request with its own code and reads the event stream with botocore's
parser, which checks each message's prelude and CRC32 checksums: if it reads our streams
and errors as it reads Bedrock's, and our signature check takes its requests and refuses
what AWS refuses, the server is faithful enough to prove aimu's provider against.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import boto3
import botocore
import botocore.config
import botocore.exceptions
import pytest
from botocore.eventstream import ChecksumMismatch, EventStreamBuffer

from aimu.aio.providers import _eventstream
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import (
    CREDENTIALS,
    REGION,
    SESSION_TOKEN,
    TEMPORARY_KEY_ID,
    TEST_KEY_ID,
    frame,
)

MODEL = "anthropic.claude-test-v1:0"
SECRET = CREDENTIALS[TEST_KEY_ID]


@pytest.fixture
def server() -> Iterator[LoopbackServer]:
    with LoopbackServer.in_thread() as loopback:  # boto3 blocks: the server has its own loop
        yield loopback


_made: list[Any] = []


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _made:
        _made.pop().close()  # its pooled connections, else a ResourceWarning at GC


def runtime(server: LoopbackServer, **settings: Any) -> Any:
    """boto3's bedrock-runtime client for the loopback server (no retries of its own)."""
    settings.setdefault("aws_access_key_id", TEST_KEY_ID)
    settings.setdefault("aws_secret_access_key", SECRET)
    config = settings.pop("config", botocore.config.Config(retries={"total_max_attempts": 1}))
    client = boto3.client("bedrock-runtime", region_name=settings.pop("region_name", REGION),
                          endpoint_url=server.url, config=config, **settings)
    _made.append(client)
    return client


def ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"text": text}]}]


def events(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """Every event of a converse_stream reply; the stream closed however it ends."""
    seen: list[dict[str, Any]] = []
    try:
        seen.extend(reply["stream"])
    finally:
        reply["stream"].close()
    return seen


def test_streamed_text_reasoning_usage_and_stop_reason(server: LoopbackServer) -> None:
    server.script = [Turn(thinking="a greeting", text="hello there you", input_tokens=12,
                          output_tokens=3)]
    seen = events(runtime(server).converse_stream(modelId=MODEL, messages=ask("hi")))
    assert [next(iter(event)) for event in seen] == [
        "messageStart", "contentBlockDelta", "contentBlockDelta", "contentBlockStop",
        "contentBlockDelta", "contentBlockDelta", "contentBlockDelta", "contentBlockStop",
        "messageStop", "metadata",
    ]
    texts = [e["contentBlockDelta"]["delta"].get("text") for e in seen if "contentBlockDelta" in e]
    assert "".join(filter(None, texts)) == "hello there you"
    reasoning = seen[1]["contentBlockDelta"]["delta"]["reasoningContent"]
    assert reasoning == {"text": "a greeting"}
    assert seen[2]["contentBlockDelta"]["delta"]["reasoningContent"]["signature"]
    assert seen[-2] == {"messageStop": {"stopReason": "end_turn"}}
    usage = seen[-1]["metadata"]["usage"]
    assert (usage["inputTokens"], usage["outputTokens"]) == (12, 3)
    request = server.requests[-1]
    assert request.protocol == "bedrock"
    assert request.path == "/model/anthropic.claude-test-v1%3A0/converse-stream"
    assert request.headers["authorization"] == "***"  # recorded redacted
    assert server.streams[-1].completed


def test_a_tool_use_streams_its_input_and_the_result_goes_back(server: LoopbackServer) -> None:
    server.script = [
        Turn(tool_calls=[ScriptedCall("weather", {"city": "Oslo", "days": [1, 2]})]),
        Turn(text="snowing"),
    ]
    tools = {"tools": [{"toolSpec": {"name": "weather", "description": "Weather.",
                                     "inputSchema": {"json": {"type": "object"}}}}]}
    client = runtime(server)
    seen = events(client.converse_stream(modelId=MODEL, messages=ask("weather?"),
                                         toolConfig=tools))
    start = next(e["contentBlockStart"] for e in seen if "contentBlockStart" in e)
    use = start["start"]["toolUse"]
    assert use["name"] == "weather"
    raw = "".join(e["contentBlockDelta"]["delta"]["toolUse"]["input"]
                  for e in seen if "contentBlockDelta" in e)
    assert raw == '{"city": "Oslo", "days": [1, 2]}'
    assert seen[-2] == {"messageStop": {"stopReason": "tool_use"}}
    follow = [
        *ask("weather?"),
        {"role": "assistant", "content": [{"toolUse": {
            "toolUseId": use["toolUseId"], "name": "weather", "input": {"city": "Oslo"}}}]},
        {"role": "user", "content": [{"toolResult": {
            "toolUseId": use["toolUseId"], "content": [{"text": "snow"}]}}]},
    ]
    whole = client.converse(modelId=MODEL, messages=follow, toolConfig=tools)
    assert whole["output"]["message"]["content"] == [{"text": "snowing"}]
    assert whole["stopReason"] == "end_turn"
    assert server.requests[-1].path.endswith("/converse")
    assert server.requests[-1].messages[-1] == {
        "role": "tool", "tool_call_id": use["toolUseId"], "name": "weather", "content": "snow",
    }


def test_temporary_credentials_sign_with_their_session_token(server: LoopbackServer) -> None:
    server.script = [Turn(text="ok")]
    client = runtime(server, aws_access_key_id=TEMPORARY_KEY_ID,
                     aws_secret_access_key=CREDENTIALS[TEMPORARY_KEY_ID],
                     aws_session_token=SESSION_TOKEN)
    assert events(client.converse_stream(modelId=MODEL, messages=ask("hi")))
    assert server.requests[-1].headers["x-amz-security-token"] == "***"  # recorded redacted


@pytest.mark.parametrize(
    ("settings", "code", "words"),
    [
        ({"aws_secret_access_key": "not-the-secret"}, "InvalidSignatureException",
         "does not match"),
        ({"aws_access_key_id": "AKIAUNKNOWNKEY000000"}, "UnrecognizedClientException",
         "security token included in the request is invalid"),
        ({"aws_access_key_id": TEMPORARY_KEY_ID,
          "aws_secret_access_key": CREDENTIALS[TEMPORARY_KEY_ID],
          "aws_session_token": "a-token-it-was-not-given"}, "UnrecognizedClientException",
         "security token"),
        ({"region_name": "eu-west-1"}, "InvalidSignatureException", "valid region"),
        ({"config": botocore.config.Config(signature_version=botocore.UNSIGNED)},
         "MissingAuthenticationTokenException", "Missing Authentication Token"),
    ],
    ids=["wrong-secret", "unknown-key", "wrong-token", "wrong-region", "unsigned"],
)
def test_a_request_not_signed_as_aws_wants_is_refused_403(
    server: LoopbackServer, settings: dict[str, Any], code: str, words: str
) -> None:
    server.script = [Turn(text="never")]
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        runtime(server, **settings).converse_stream(modelId=MODEL, messages=ask("hi"))
    error = caught.value.response
    assert error["Error"]["Code"] == code and words in error["Error"]["Message"]
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert not server.streams  # refused before any turn


def test_a_body_changed_after_signing_is_refused(server: LoopbackServer) -> None:
    """The signature covers the body's hash: a body changed on the way does not match."""
    client = runtime(server)

    def tamper(request: Any, **_: Any) -> None:
        request.body = request.body.replace(b'"hi"', b'"hI"')

    client.meta.events.register_first("before-send.bedrock-runtime.ConverseStream", tamper)
    with pytest.raises(botocore.exceptions.ClientError, match="InvalidSignatureException"):
        client.converse_stream(modelId=MODEL, messages=ask("hi"))


def test_throttling_is_aws_s_throttling_exception_before_and_during_the_stream(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="x", fault="http_429"),
                     Turn(text="one two three", fault="overloaded_event", fault_after=1)]
    client = runtime(server)
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        client.converse_stream(modelId=MODEL, messages=ask("hi"))
    assert caught.value.response["Error"]["Code"] == "ThrottlingException"
    assert caught.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429
    with pytest.raises(botocore.exceptions.EventStreamError) as mid:
        events(client.converse_stream(modelId=MODEL, messages=ask("hi")))
    assert mid.value.response["Error"]["Code"] == "throttlingException"
    assert "Too many requests" in mid.value.response["Error"]["Message"]
    assert server.streams[-1].chunks_sent == 2  # one text piece, then the exception


def test_a_bad_checksum_mid_stream_is_caught_by_botocore(server: LoopbackServer) -> None:
    server.script = [Turn(text="a b c", fault="bad_json", fault_after=1)]
    with pytest.raises(ChecksumMismatch):
        events(runtime(server).converse_stream(modelId=MODEL, messages=ask("hi")))


@pytest.mark.parametrize(
    ("messages", "words"),
    [
        ([{"role": "assistant", "content": [{"text": "hi"}]}], "must start with a user message"),
        ([*ask("a"), *ask("b")], "must alternate between user and assistant"),
        ([{"role": "user", "content": [{"text": "  "}]}], "is blank"),
        ([*ask("a"), {"role": "assistant", "content": [{"toolUse": {
            "toolUseId": "t1", "name": "f", "input": {}}}]}, *ask("b")],
         "Expected toolResult blocks at messages.2.content for the following Ids: t1"),
    ],
    ids=["first-not-user", "not-alternating", "blank", "unanswered-tool-use"],
)
def test_what_converse_refuses_is_a_validation_exception(
    server: LoopbackServer, messages: list[dict[str, Any]], words: str
) -> None:
    tools = {"tools": [{"toolSpec": {"name": "f", "inputSchema": {"json": {"type": "object"}}}}]}
    with pytest.raises(botocore.exceptions.ClientError) as caught:
        runtime(server).converse_stream(modelId=MODEL, messages=messages, toolConfig=tools)
    assert caught.value.response["Error"]["Code"] == "ValidationException"
    assert words in caught.value.response["Error"]["Message"]


def test_closing_the_stream_mid_reply_is_seen_by_the_server(server: LoopbackServer) -> None:
    server.script = [Turn(text="one two three four five six", delay=0.05)]
    stream = runtime(server).converse_stream(modelId=MODEL, messages=ask("hi"))["stream"]
    for event in stream:
        if "contentBlockDelta" in event:
            break
    stream.close()
    (record,) = asyncio.run(server.wait_abandoned(1))  # the server's own loop records it
    assert not record.completed


# -- the frames, read by botocore's parser and by aimu's ------------------------------------


def test_aimu_s_decoder_reads_what_botocore_s_parser_reads() -> None:
    messages = [
        frame({":event-type": "messageStart", ":message-type": "event"}, b'{"role":"assistant"}'),
        frame({":message-type": "event", "ünïcode": "välue"}, b""),
        frame({":exception-type": "throttlingException", ":message-type": "exception"},
              b'{"message":"slow down"}'),
    ]
    stream = b"".join(messages)
    parser = EventStreamBuffer()
    parser.add_data(stream)
    theirs = [(message.headers, message.payload) for message in parser]
    whole, rest = _eventstream.split(stream)
    assert rest == b"" and whole == messages
    ours = [(m.headers, m.payload) for m in map(_eventstream.decode, whole)]
    assert ours == theirs
    for size in (1, 5, 13, 64):  # however the bytes arrive
        got: list[bytes] = []
        pending = b""
        for start in range(0, len(stream), size):
            done, pending = _eventstream.split(pending + stream[start:start + size])
            got += done
        assert got == messages and pending == b""


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda m: m[:9] + bytes([m[9] ^ 1]) + m[10:], "prelude failed its CRC32"),
        (lambda m: m[:-1] + bytes([m[-1] ^ 1]), "failed its CRC32 check"),
        (lambda m: m[:20] + bytes([m[20] ^ 1]) + m[21:], "failed its CRC32 check"),
        (lambda m: m[:-3], "in the middle of a message"),
    ],
    ids=["prelude-crc", "message-crc", "payload-bit", "cut-short"],
)
def test_a_damaged_message_is_refused_by_both_parsers(damage: Any, words: str) -> None:
    message = frame({":event-type": "metadata", ":message-type": "event"}, b'{"usage":{}}')
    bad = damage(message)
    with pytest.raises(_eventstream.FrameError, match=words):
        _eventstream.decode(bad)
    parser = EventStreamBuffer()
    parser.add_data(bad)
    if words == "in the middle of a message":
        assert list(parser) == []  # botocore waits for the rest
    else:
        with pytest.raises(ChecksumMismatch):
            list(parser)
