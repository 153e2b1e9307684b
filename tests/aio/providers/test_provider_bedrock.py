"""What only the Bedrock provider does: its settings (region, endpoint, credentials from
botocore's chain, resolved off the event loop), its request in Converse's shape (system
blocks, alternating messages, toolConfig, toolChoice, typed output, cache points),
signed reasoning kept and sent back unchanged, usage with cached tokens, throttling
retried before the turn and not after, a cut answer continued, and no secret key,
session token or signature in an error, a repr or any log record, botocore's own
included. Against the loopback server's Converse wire, which checks every signature."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from provider_support import closed_after_test, turn
from pydantic import BaseModel

from aimu import aio
from aimu._extras import MissingExtra
from aimu.aio.client import (
    TextDelta,
    ThinkingDelta,
    ToolCallDelta,
    TurnDone,
    TurnRequest,
)
from aimu.aio.errors import ModelError, ModelHTTPError
from aimu.aio.events import TextChunk
from aimu.aio.providers.base import NativeData
from aimu.aio.providers.bedrock import BedrockClient
from aimu.aio.transcript import Message
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.server import LoopbackServer
from aimu.testing.server.bedrock import (
    CREDENTIALS,
    REGION,
    SESSION_TOKEN,
    TEMPORARY_KEY_ID,
    TEST_KEY_ID,
)

MODEL = "anthropic.claude-test-v1:0"
SECRET = CREDENTIALS[TEST_KEY_ID]
USER: list[Message] = [{"role": "user", "content": "x"}]
_AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
        "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_BEDROCK_RUNTIME",
        "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


def bedrock(server: LoopbackServer, **options: Any) -> BedrockClient:
    options.setdefault("aws_access_key_id", TEST_KEY_ID)
    options.setdefault("aws_secret_access_key", SECRET)
    options.setdefault("region", REGION)
    return closed_after_test(BedrockClient(MODEL, base_url=server.url, **options))



@pytest.fixture
async def server() -> Any:
    async with LoopbackServer() as loopback:
        yield loopback


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No AWS settings from the machine: no variables, empty shared files."""
    for name in _AWS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role lookups
    return monkeypatch


# -- settings -------------------------------------------------------------------------------


def test_region_and_endpoint_come_from_arguments_then_the_environment(
    aws_env: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="needs an AWS region: region= or AWS_REGION"):
        aio.client(f"bedrock:{MODEL}")
    model = aio.client(f"bedrock:{MODEL}", region="eu-west-3")
    assert isinstance(model, BedrockClient)
    assert model.base_url == "https://bedrock-runtime.eu-west-3.amazonaws.com"
    assert model.model == MODEL  # the model id keeps its colon
    assert model.endpoint().endswith("/model/anthropic.claude-test-v1%3A0/converse-stream")
    aws_env.setenv("AWS_DEFAULT_REGION", "us-west-2")
    assert aio.client("bedrock:m").region == "us-west-2"  # type: ignore[attr-defined]
    aws_env.setenv("AWS_REGION", "ap-south-1")
    aws_env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9/")
    from_env = aio.client("bedrock:m")
    assert isinstance(from_env, BedrockClient)
    assert (from_env.region, from_env.base_url) == ("ap-south-1", "http://127.0.0.1:9")
    aws_env.setenv("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", "http://127.0.0.1:10")
    assert aio.client("bedrock:m").base_url == "http://127.0.0.1:10"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="given together"):
        aio.client("bedrock:m", aws_access_key_id=TEST_KEY_ID)
    given = aio.client("bedrock:m", aws_access_key_id=TEST_KEY_ID, aws_secret_access_key=SECRET,
                       aws_session_token=SESSION_TOKEN)
    for secret in (SECRET, SESSION_TOKEN):
        assert secret not in repr(given) and secret not in repr(vars(given))


def test_without_botocore_the_error_says_which_extra_to_install(
    aws_env: pytest.MonkeyPatch,
) -> None:
    aws_env.setitem(sys.modules, "botocore.credentials", None)
    with pytest.raises(MissingExtra, match=r"the bedrock: provider needs the bedrock extra.*"
                                           r"aimu-agents\[bedrock\]|\[bedrock\]"):
        aio.client("bedrock:m", region="us-east-1")


async def test_credentials_come_from_botocore_s_chain_resolved_off_the_loop(
    server: LoopbackServer, aws_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A profile of the shared credentials file, named by AWS_PROFILE: botocore reads the
    file in a worker thread, never on the loop's; the request is signed with it."""
    (tmp_path / "credentials").write_text(
        f"[loopback]\naws_access_key_id = {TEST_KEY_ID}\naws_secret_access_key = {SECRET}\n"
    )
    aws_env.setenv("AWS_PROFILE", "loopback")
    import botocore.session

    threads: list[threading.Thread] = []
    resolve = botocore.session.Session.get_credentials

    def watched(session: botocore.session.Session) -> Any:
        threads.append(threading.current_thread())
        return resolve(session)

    aws_env.setattr(botocore.session.Session, "get_credentials", watched)
    server.script = [Turn(text="signed"), Turn(text="again")]
    async with BedrockClient(MODEL, region=REGION, base_url=server.url) as model:
        assert [c for c in await turn(model, USER) if isinstance(c, TextDelta)]
        await turn(model, USER)
    assert threads and threading.main_thread() not in threads
    assert len(threads) == 1  # resolved once, then kept
    assert len(server.requests) == 2 and all(r.path.endswith("-stream") for r in server.requests)


async def test_no_credentials_is_an_error_naming_the_variables(
    server: LoopbackServer, aws_env: pytest.MonkeyPatch
) -> None:
    async with BedrockClient(MODEL, region=REGION, base_url=server.url) as model:
        with pytest.raises(ModelError, match="AWS_ACCESS_KEY_ID") as caught:
            await turn(model, USER)
    assert "AWS_PROFILE" in str(caught.value) and not server.requests
    aws_env.setenv("AWS_PROFILE", "no-such-profile")
    async with BedrockClient(MODEL, region=REGION, base_url=server.url) as model:
        with pytest.raises(ModelError, match=r"ProfileNotFound.*AWS_PROFILE"):
            await turn(model, USER)


# -- the request ----------------------------------------------------------------------------


async def test_the_transcript_in_converse_s_messages(server: LoopbackServer) -> None:
    """System on top; tool results first in one user message with the user text after
    them; an empty reply left out; a partial reply's unsigned thinking never sent."""
    calls: list[Any] = [
        {"id": "tooluse_a", "type": "function",
         "function": {"name": "lookup", "arguments": {"city": "Oslo"}}},
        {"id": "tooluse_b", "type": "function",
         "function": {"name": "lookup", "arguments": {"city": "Rome"}}},
    ]
    messages: list[Message] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "looking", "tool_calls": calls, "thinking": "hm"},
        {"role": "tool", "content": "sunny", "tool_call_id": "tooluse_a", "name": "lookup"},
        {"role": "tool", "content": "", "tool_call_id": "tooluse_b", "name": "lookup"},
        {"role": "user", "content": "and Paris?"},
        {"role": "assistant", "content": "", "aimu_partial": True, "thinking": "cut"},
        {"role": "user", "content": "continue"},
    ]
    async with bedrock(server) as model:
        await turn(model, messages)  # no tools offered now: toolConfig from the calls made
        body = server.requests[-1].body
        assert body["system"] == [{"text": "be brief"}]
        assert body["messages"] == [
            {"role": "user", "content": [{"text": "go"}]},
            {"role": "assistant", "content": [
                {"text": "looking"},
                {"toolUse": {"toolUseId": "tooluse_a", "name": "lookup",
                             "input": {"city": "Oslo"}}},
                {"toolUse": {"toolUseId": "tooluse_b", "name": "lookup",
                             "input": {"city": "Rome"}}},
            ]},
            {"role": "user", "content": [
                {"toolResult": {"toolUseId": "tooluse_a", "content": [{"text": "sunny"}]}},
                {"toolResult": {"toolUseId": "tooluse_b", "content": []}},
                {"text": "and Paris?"},
                {"text": "continue"},
            ]},
        ]
        assert body["toolConfig"] == {"tools": [
            {"toolSpec": {"name": "lookup", "inputSchema": {"json": {"type": "object"}}}}]}
        messages += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "more"}]
        await turn(model, messages)  # the encoded messages are kept: only the new encoded
        assert server.requests[-1].body["messages"][-2:] == [
            {"role": "assistant", "content": [{"text": "fine"}]},
            {"role": "user", "content": [{"text": "more"}]},
        ]


async def test_tools_tool_choice_caching_options_and_typed_output(server: LoopbackServer) -> None:
    tools: Any = [{"type": "function", "function": {
        "name": "lookup", "description": "The weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    options = {"inferenceConfig": {"maxTokens": 99, "temperature": 0}}
    server.script = [Turn(text='{"n": 1}')] * 3
    async with bedrock(server, cache=True, options=options) as model:
        await turn(model, [{"role": "system", "content": "sys"}, *USER], tools=tools,
                   request=TurnRequest(output_schema={"type": "object"}, output_name="N",
                                       tool_choice="required"))
        body = server.requests[-1].body
        assert body["inferenceConfig"] == {"maxTokens": 99, "temperature": 0}
        assert body["system"] == [{"text": "sys"}, {"cachePoint": {"type": "default"}}]
        assert body["toolConfig"] == {
            "tools": [
                {"toolSpec": {"name": "lookup", "description": "The weather.", "inputSchema": {
                    "json": {"type": "object", "properties": {"city": {"type": "string"}}}}}},
                {"cachePoint": {"type": "default"}},
            ],
            "toolChoice": {"any": {}},
        }
        assert body["outputConfig"] == {"textFormat": {"type": "json_schema", "structure": {
            "jsonSchema": {"schema": '{"type": "object"}', "name": "N"}}}}
        await turn(model, USER, tools=tools, request=TurnRequest(tool_choice="lookup"))
        assert server.requests[-1].body["toolConfig"]["toolChoice"] == {"tool": {"name": "lookup"}}
        await turn(model, USER, tools=tools, request=TurnRequest(tool_choice="none"))
        assert "toolChoice" not in server.requests[-1].body["toolConfig"]  # Converse has none


async def test_typed_output_over_the_wire(server: LoopbackServer) -> None:
    class City(BaseModel):
        name: str
        people: int

    async with aio.Agent(bedrock(server), output_type=City) as agent:
        result = await agent.run("a city")
    assert isinstance(result, City)
    assert "outputConfig" in server.requests[-1].body


# -- reasoning, usage, stops ----------------------------------------------------------------


async def test_signed_reasoning_goes_back_unchanged_and_a_forged_one_is_refused(
    server: LoopbackServer,
) -> None:
    def lookup(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    server.script = [
        Turn(thinking="two cities", text="looking",
             tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})]),
        Turn(text="sunny"),
        Turn(text="never"),
    ]
    async with aio.Agent(bedrock(server), tools=[lookup]) as agent:
        assert await agent.run("weather?") == "sunny"
    asked = agent.model_client.messages[1]
    assert asked["role"] == "assistant" and asked.get("thinking") == "two cities"
    native = asked["aimu_native"]
    assert native["wire"] == "bedrock"
    reasoning = native["content"][0]["reasoningContent"]["reasoningText"]
    assert reasoning["text"] == "two cities" and reasoning["signature"]
    sent = server.requests[1].body["messages"][1]["content"]
    assert sent[0] == native["content"][0]  # exactly as it came, signature and all
    forged = json.loads(json.dumps(agent.model_client.messages))
    forged[1]["aimu_native"]["content"][0]["reasoningContent"]["reasoningText"]["text"] = "3"
    async with aio.Agent(bedrock(server), tools=[lookup]) as other:
        other.restore(forged)
        with pytest.raises(ModelHTTPError, match="signature") as caught:
            await other.run("again")
    assert caught.value.status_code == 400
    server.script = [Turn(thinking="whole thought", text="done")]  # converse, not streamed
    async with bedrock(server) as model:
        chunks = await turn(model, USER, stream=False)
    (kept,) = [c for c in chunks if isinstance(c, NativeData)]
    assert kept.data["content"][0]["reasoningContent"]["reasoningText"]["signature"]
    assert [type(c) for c in chunks[:2]] == [ThinkingDelta, TextDelta]


async def test_usage_counts_cache_reads_as_input_and_apart(server: LoopbackServer) -> None:
    server.script = [Turn(text="a b c", input_tokens=41, output_tokens=7)] * 2
    for cache in (False, True):
        async with bedrock(server, cache=cache) as model:
            chunks = await turn(model, [{"role": "system", "content": "s"}, *USER])
        done = chunks[-1]
        assert isinstance(done, TurnDone) and done.usage_reported and done.stop_reason == "stop"
        cached = {"cached_input_tokens": 20} if cache else {}
        assert done.usage == {"input_tokens": 41, "output_tokens": 7, **cached}


@pytest.mark.parametrize(
    ("scripted", "reason", "status"),
    [(None, "stop", "completed"), ("length", "length", "incomplete"),
     ("content_filter", "content_filter", "incomplete")],
)
async def test_stop_reasons_in_aimu_s_words(
    server: LoopbackServer, scripted: str | None, reason: str, status: str
) -> None:
    server.script = [Turn(text="partial answer", stop_reason=scripted)] * 2
    async with bedrock(server) as model:
        chunks = await turn(model, USER)
        assert isinstance(chunks[-1], TurnDone) and chunks[-1].stop_reason == reason
        handle = aio.RunHandle.start(aio.Agent(model.fork()).run("x"))
        await handle.wait()
    assert handle.status == status


async def test_throttling_is_retried_before_the_turn_and_not_after(
    server: LoopbackServer,
) -> None:
    """A 429 ThrottlingException and a throttlingException message before any byte of
    the turn are retried (re-signed: a retry is a new request); one mid-reply too, the
    turn then restarted (Converse continues a partial only with continues_partial)."""
    server.script = [Turn(text="x", fault="http_429", retry_after="0"), Turn(text="hello"),
                     Turn(text="x", fault="overloaded_event"), Turn(text="again")]
    async with bedrock(server, retry_delay=0) as model:
        for said in ("hello", "again"):
            chunks = await turn(model, USER)
            assert "".join(c.text for c in chunks if isinstance(c, TextDelta)) == said
    assert len(server.requests) == 4
    assert len({r.headers["x-amz-date"] + str(r.connection) for r in server.requests}) >= 2
    server.script = [Turn(text="one two three", fault="overloaded_event", fault_after=1),
                     Turn(text="all three")]
    async with aio.Agent(bedrock(server, retry_delay=0)) as agent:
        assert await agent.run("x") == "all three"  # cut mid-reply: asked again (issue 44)
    assert agent.model_client.messages[-1] == {  # the partial replaced, not glued on
        "role": "assistant", "content": "all three", "aimu_model": f"bedrock:{MODEL}",
    }
    assert agent.last_run.retries == 1
    assert len(server.requests) == 6


async def test_a_cut_answer_is_continued_without_its_trailing_space(
    server: LoopbackServer,
) -> None:
    words = "one two three four five"
    server.script = [Turn(text=words), Turn(text=" four five", chunks=2)]
    async with aio.Agent(bedrock(server, continues_partial=True)) as agent:
        seen: list[str] = []
        async with aclosing(agent.run("count", stream=True)) as events:
            async for event in events:
                if isinstance(event, TextChunk):
                    seen.append(event.text)
                    if len(seen) == 3:
                        break
        assert "".join(seen) == "one two three "
        assert await agent.resume(continue_partial=True) == words
    assert server.requests[-1].body["messages"][-1] == {
        "role": "assistant", "content": [{"text": "one two three"}],
    }
    assert agent.last_run is not None and agent.last_run.continuation == "continued"
    assert agent.model_client.messages[-1]["content"] == words


async def test_a_tool_call_with_bad_input_is_a_tool_error(server: LoopbackServer) -> None:
    server.script = [Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"})])]
    async with bedrock(server) as model:
        chunks = await turn(model, USER)
    (call,) = [c for c in chunks if isinstance(c, ToolCallDelta)]
    assert call.call["function"] == {"name": "lookup", "arguments": {"city": "Oslo"}}
    assert call.error is None and chunks[-1].stop_reason == "tool_calls"  # type: ignore[union-attr]


# -- secrets --------------------------------------------------------------------------------


async def test_a_bad_signature_is_refused_and_no_secret_reaches_an_error_or_any_log_record(
    server: LoopbackServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Temporary credentials with a wrong secret: the server's 403 quotes the canonical
    request it expected, session token and all; the error names what to check and shows
    none of the secret key, the token or the signature, and no record at DEBUG on any
    logger (botocore's, which logs the canonical request and the signature, httpx's,
    aimu's) does either."""
    caplog.set_level(logging.DEBUG)
    wrong = "wrong/secret/access/key/EXAMPLE0123456789"
    server.script = [Turn(text="ok")]
    good = bedrock(server, aws_access_key_id=TEMPORARY_KEY_ID,
                   aws_secret_access_key=CREDENTIALS[TEMPORARY_KEY_ID],
                   aws_session_token=SESSION_TOKEN)
    async with good:
        assert await aio.chat(good, "hi")  # a signed request went through, logging at DEBUG
    async with bedrock(server, aws_access_key_id=TEMPORARY_KEY_ID, aws_secret_access_key=wrong,
                       aws_session_token=SESSION_TOKEN) as bad:
        with pytest.raises(ModelHTTPError) as caught:
            await turn(bad, USER)
    error = caught.value
    assert error.status_code == 403 and "does not match" in str(error)
    assert "AWS_SECRET_ACCESS_KEY" in str(error) and "AWS_PROFILE" in str(error)
    assert "Canonical String" in error.body and "x-amz-security-token:***" in error.body
    signatures = [r.headers.get("authorization", "") for r in server.requests]
    assert signatures == ["***", "***"]  # recorded redacted; the real ones are below
    secrets = [CREDENTIALS[TEMPORARY_KEY_ID], wrong, SESSION_TOKEN]
    texts = [str(error), repr(error), error.body, caplog.text,
             *(repr(r.args) for r in caplog.records)]
    for secret in secrets:
        assert all(secret not in text for text in texts), secret
    assert "Signature=" not in caplog.text and "CanonicalRequest" not in caplog.text


async def test_botocore_s_records_are_dropped_only_while_aimu_signs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without aimu's filter botocore.auth would log the canonical request with the
    session token; the filter is scoped to aimu's signing, so the caller's own boto3
    signing (in this thread, outside aimu) still logs as botocore does."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    caplog.set_level(logging.DEBUG, logger="botocore.auth")
    request = AWSRequest(method="POST", url="http://127.0.0.1:1/x", data=b"{}")
    SigV4Auth(Credentials("AKIDX", "s3cret", SESSION_TOKEN), "bedrock", REGION).add_auth(request)
    assert SESSION_TOKEN in caplog.text  # what botocore logs: why the filter exists
    caplog.clear()
    async with LoopbackServer() as server:
        server.script = [Turn(text="ok")]
        async with bedrock(server, aws_access_key_id=TEMPORARY_KEY_ID,
                           aws_secret_access_key=CREDENTIALS[TEMPORARY_KEY_ID],
                           aws_session_token=SESSION_TOKEN) as model:
            await turn(model, USER)
    assert SESSION_TOKEN not in caplog.text and "CanonicalRequest" not in caplog.text


async def test_a_signed_request_waits_for_no_file_on_the_loop(
    server: LoopbackServer, aws_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Credentials that need refreshing (a credential_process whose credentials expire
    within botocore's refresh window) are refreshed in a worker thread, each request."""
    script = tmp_path / "creds.py"
    script.write_text(
        "import json, datetime\n"
        "soon = datetime.datetime.now(datetime.UTC) + datetime.timedelta(minutes=1)\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {TEST_KEY_ID!r}, "
        f"'SecretAccessKey': {SECRET!r}, 'Expiration': soon.isoformat()}}))\n"
    )
    (tmp_path / "config").write_text(
        f"[profile process]\ncredential_process = {sys.executable} {script}\n"
    )
    aws_env.setenv("AWS_PROFILE", "process")
    from botocore.credentials import ProcessProvider

    threads: list[threading.Thread] = []
    run = ProcessProvider._retrieve_credentials_using

    def watched(provider: ProcessProvider, command: str) -> Any:
        threads.append(threading.current_thread())
        return run(provider, command)

    aws_env.setattr(ProcessProvider, "_retrieve_credentials_using", watched)
    server.script = [Turn(text="one"), Turn(text="two")]
    async with BedrockClient(MODEL, region=REGION, base_url=server.url) as model:
        await turn(model, USER)
        await turn(model, USER)
    assert len(threads) >= 2 and threading.main_thread() not in threads
    assert len(server.streams) == 2 and all(s.completed for s in server.streams)


async def test_a_cancel_mid_stream_closes_it_at_once_and_keeps_the_partial(
    server: LoopbackServer,
) -> None:
    server.script = [Turn(text="one two three four five six", delay=30)]
    async with aio.Agent(bedrock(server)) as agent:
        shown = asyncio.Event()

        async def consume() -> None:
            async for event in agent.run("go", stream=True):
                if isinstance(event, TextChunk):
                    shown.set()

        task = asyncio.ensure_future(consume())
        await shown.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        (record,) = await server.wait_abandoned(1)
        assert record.protocol == "bedrock" and not record.completed
        assert agent.model_client.messages[-1] == {
            "role": "assistant", "content": "one ", "aimu_partial": True,
            "aimu_model": f"bedrock:{MODEL}",
        }


async def test_a_throttled_bedrock_falls_back_to_another_cloud_and_back(
    server: LoopbackServer,
) -> None:
    """Bedrock still throttling once its retries are spent: the turn goes to Anthropic's
    API; the other way round, an overloaded Anthropic hands it to Bedrock. Each message
    records the model that wrote it, each wire takes the transcript."""
    from aimu.aio.providers.anthropic import AnthropicClient

    claude = AnthropicClient("claude-test", base_url=server.url, api_key="sk-ant-x", retries=0)
    cloud = bedrock(server, retries=0)
    server.script = [Turn(text="x", fault="http_429"), Turn(text="from anthropic"),
                     Turn(text="x", fault="http_529"), Turn(text="from bedrock")]
    async with aio.Agent(aio.FallbackModel(cloud, claude)) as first:
        assert await first.run("one") == "from anthropic"
    async with aio.Agent(aio.FallbackModel(claude.fork(), cloud.fork())) as second:
        second.restore(first.model_client.messages)
        assert await second.run("two") == "from bedrock"
    writers = [m.get("aimu_model") for m in second.model_client.messages
               if m["role"] == "assistant"]
    assert writers == ["anthropic:claude-test", f"bedrock:{MODEL}"]
    assert [r.protocol for r in server.requests] == ["bedrock", "anthropic", "anthropic",
                                                     "bedrock"]
    assert server.requests[-1].body["messages"][1] == {
        "role": "assistant", "content": [{"text": "from anthropic"}]}


async def test_a_fork_redacts_what_its_client_signed_with(server: LoopbackServer) -> None:
    """Forks share the client's credentials and what its errors redact: a fork's 403
    hides the session token, and no repr of either shows it or a signature."""
    wrong = "wrong/secret/for/the/fork/EXAMPLE0123456789"
    async with bedrock(server, aws_access_key_id=TEMPORARY_KEY_ID, aws_secret_access_key=wrong,
                       aws_session_token=SESSION_TOKEN) as model:
        fork = model.fork()
        with pytest.raises(ModelHTTPError) as caught:
            await turn(fork, USER)
        assert "x-amz-security-token:***" in caught.value.body
        signature = model._redacted.signatures[-1]  # what the fork signed with
        for shown in (repr(model), repr(vars(model)), repr(fork), repr(vars(fork)),
                      str(caught.value), caught.value.body):
            assert SESSION_TOKEN not in shown and wrong not in shown and signature not in shown
