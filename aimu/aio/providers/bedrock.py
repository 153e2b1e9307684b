"""``bedrock:<modelId>``: Amazon Bedrock's Converse API, streamed, signed with SigV4.

The transcript is translated to Converse's shape here and nowhere else: the system
prompt goes as the top-level ``system`` blocks; a user or assistant message is a list of
content blocks (``text``, ``image``, ``toolUse``; the signed ``reasoningContent`` of a
reply sent back unchanged from its ``aimu_native`` data); tool results are
``toolResult`` blocks at the head of the next user message, adjacent messages of one
side merged into one, as Converse wants strict alternation.

``POST /model/{modelId}/converse-stream`` answers with AWS's binary event stream
(:mod:`._eventstream`, both checksums of every message checked): ``messageStart``,
``contentBlockStart`` / ``contentBlockDelta`` / ``contentBlockStop``, ``messageStop``,
``metadata`` with the usage. An exception message mid-stream (``throttlingException``...)
is an error of the HTTP status it stands for, retried like one while no byte of the turn
has come.

Each request (and each retry) is signed by botocore (``SigV4Auth``, service ``bedrock``)
with credentials from botocore's standard chain, resolved and refreshed in a worker
thread (they may need the network); botocore's own DEBUG records of the signing (the
canonical request, the session token in it, the signature) are dropped, and no secret
key, session token or signature reaches a message, repr or log record.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self, Unpack, cast, overload
from urllib.parse import quote

import httpx

from aimu._extras import needs_extra
from aimu.aio.errors import ModelError
from aimu.aio.providers import _eventstream as frames
from aimu.aio.providers._decoder import (
    TurnDecoder,
    as_dict,
    as_list,
    decoded_call,
    with_cached,
)
from aimu.aio.providers._errors import clip
from aimu.aio.providers._http import HTTPModelClient, TurnInput
from aimu.aio.providers._report import Reporter
from aimu.aio.providers._settings import ClientSettings, TurnKeywords
from aimu.aio.providers._unicode import TurnText, clean
from aimu.aio.providers._wire import dumps, unchanged
from aimu.aio.providers.anthropic import _trailing, prefill_space
from aimu.aio.providers.base import Chunk, NativeData, ToolCallDelta, TurnDone
from aimu.aio.transcript import Message, ToolCall, ToolSpec, Usage, native_data

if TYPE_CHECKING:
    from botocore.credentials import Credentials, ReadOnlyCredentials

__all__ = [
    "REGION_ENVS",
    "SERVICE",
    "STOP_REASONS",
    "URL_ENVS",
    "WIRE",
    "BedrockClient",
    "message_blocks",
]

#: The SigV4 signing name of the Bedrock runtime.
SERVICE = "bedrock"
#: The name of this wire in ``aimu_native`` data.
WIRE = "bedrock"
#: Where the region comes from when ``region=`` is not given, in order.
REGION_ENVS = ("AWS_REGION", "AWS_DEFAULT_REGION")
#: Where the endpoint comes from when ``base_url=`` is not given, in order (botocore's
#: names); else ``https://bedrock-runtime.{region}.amazonaws.com``.
URL_ENVS = ("AWS_ENDPOINT_URL_BEDROCK_RUNTIME", "AWS_ENDPOINT_URL")
#: Converse's ``stopReason`` in aimu's words (others are kept as they are).
STOP_REASONS = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "tool_calls",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "guardrail_intervened": "content_filter",
    "content_filtered": "content_filter",
}
#: The HTTP status an exception message of the stream stands for.
_EXCEPTION_STATUS = {
    "throttlingException": 429,
    "serviceUnavailableException": 503,
    "internalServerException": 500,
    "modelStreamErrorException": 424,
    "modelTimeoutException": 408,
    "validationException": 400,
}
_CACHE_POINT = {"cachePoint": {"type": "default"}}
_CREDENTIALS_HINT = (
    "aws_access_key_id= / aws_secret_access_key=, or AWS_ACCESS_KEY_ID / "
    "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN), or AWS_PROFILE"
)
_KEPT_SIGNATURES = 32


# -- botocore's DEBUG records of our signing -------------------------------------------------

_signing = threading.local()


class _DropWhileSigning(logging.Filter):
    """Drops ``botocore.auth``'s records made while aimu signs in this thread (they
    carry the canonical request, with the session token, and the signature)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(_signing, "active", False)


_QUIET = _DropWhileSigning()


def _quiet_botocore() -> None:
    """Put the filter on ``botocore.auth`` (once)."""
    logger = logging.getLogger("botocore.auth")
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)


# -- the transcript in Converse's shape ------------------------------------------------------


def _image(url: str) -> dict[str, Any]:
    head, _, data = url.partition(";base64,")
    kind = head.removeprefix("data:image/").lower()
    return {"image": {"format": "jpeg" if kind == "jpg" else kind, "source": {"bytes": data}}}


def message_blocks(message: Message) -> list[dict[str, Any]]:
    """The content blocks of one transcript message (system messages have none here).

    A reply written on this wire is sent as its ``aimu_native`` blocks (signed
    reasoning included) while they still match its tool calls; any other reply as its
    text and ``toolUse`` blocks.
    """
    if message["role"] == "tool":
        content = [{"text": message["content"]}] if message["content"] else []
        return [{"toolResult": {"toolUseId": message["tool_call_id"], "content": content}}]
    if message["role"] == "user":
        given = [_image(url) for url in message.get("images", [])]
        if message["content"]:
            given.append({"text": message["content"]})
        return given
    if message["role"] != "assistant":
        return []
    calls = message.get("tool_calls", [])
    native = native_data(message, WIRE)
    if native is not None and isinstance(native.get("content"), list):
        sent = [block for block in native["content"] if isinstance(block, dict)]
        ids = [as_dict(block.get("toolUse")).get("toolUseId") for block in sent
               if "toolUse" in block]
        if ids == [call["id"] for call in calls]:
            return [b for b in sent if "text" not in b or b["text"]]
    blocks: list[dict[str, Any]] = [{"text": message["content"]}] if message["content"] else []
    blocks += [
        {"toolUse": {"toolUseId": call["id"], "name": call["function"]["name"],
                     "input": call["function"]["arguments"]}}
        for call in calls
    ]
    return blocks


def _trailing_prefill(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trailing assistant turn's blocks, its last text without trailing whitespace
    (the models that continue a prefill refuse one that ends in whitespace)."""
    if blocks and "text" in blocks[-1]:
        text = str(blocks[-1]["text"]).rstrip()
        blocks = blocks[:-1] + ([{"text": text}] if text else [])
    return blocks


class _Group:
    """One Converse message being built: its role, its blocks, and its JSON once done."""

    __slots__ = ("encoded", "rest", "results", "role")

    def __init__(self, role: str) -> None:
        self.role = role
        self.results: list[bytes] = []
        self.rest: list[bytes] = []
        self.encoded: bytes | None = None

    def encode(self) -> bytes:
        if self.encoded is None:
            content = b",".join(self.results + self.rest)
            self.encoded = b'{"role":"' + self.role.encode() + b'","content":[' + content + b"]}"
        return self.encoded


class _Encoder:
    """The transcript as Converse messages, each transcript message's blocks encoded once
    and each finished Converse message joined once (the messages sent last time are
    checked to be the same objects with the same content, as
    :func:`~aimu.aio.providers._wire.unchanged` does: a grown transcript costs only what
    it added)."""

    __slots__ = ("_contents", "_groups", "_objects", "_tools", "uses_tools")

    def __init__(self) -> None:
        self._objects: list[Message] = []
        self._contents: list[str] = []
        # per Converse message: its role, its toolResult blocks, its other blocks, and
        # the message encoded (None while it may still grow)
        self._groups: list[_Group] = []
        self._tools: tuple[object, bool, list[dict[str, Any]]] = (None, False, [])
        #: The names of the tools the transcript's calls used (toolConfig needs them).
        self.uses_tools: dict[str, None] = {}

    def messages(self, messages: Sequence[Message]) -> bytes:
        """The ``messages`` array (the system prompt is not in it); a trailing assistant
        message goes as a prefill, its last text without trailing whitespace."""
        start = unchanged(self._objects, self._contents, messages)
        if not start:
            self._objects, self._contents, self._groups = [], [], []
            self.uses_tools = {}
        groups = self._groups
        for message in messages[start:]:
            self._objects.append(message)
            self._contents.append(message["content"])
            role: str = message["role"]
            for call in cast("list[ToolCall]", message.get("tool_calls", [])):
                self.uses_tools[call["function"]["name"]] = None
            blocks = [dumps(block) for block in message_blocks(message)]
            side = "user" if role == "tool" else role
            if side not in ("user", "assistant") or not blocks:
                continue
            if not groups or groups[-1].role != side:
                groups.append(_Group(side))
            group = groups[-1]
            (group.results if role == "tool" else group.rest).extend(blocks)
            group.encoded = None
        encoded = [group.encode() for group in groups]
        if groups and groups[-1].role == "assistant" and messages[-1]["role"] == "assistant":
            trailing = [b for m in _trailing(messages) for b in message_blocks(m)]
            prefill = _Group("assistant")
            prefill.rest = [dumps(b) for b in _trailing_prefill(trailing)]
            encoded[-1:] = [prefill.encode()] if prefill.rest else []
        return b"[" + b",".join(encoded) + b"]"

    def tools(self, tools: Sequence[ToolSpec] | None, cache: bool) -> list[dict[str, Any]]:
        """``toolConfig.tools``: those offered, else those the transcript used (Converse
        wants a toolConfig whenever the messages hold toolUse or toolResult blocks)."""
        if not tools:
            return [{"toolSpec": {"name": name, "inputSchema": {"json": {"type": "object"}}}}
                    for name in self.uses_tools]
        cached, cached_flag, wire = self._tools
        if cached is not tools or cached_flag != cache:
            wire = []
            for tool in tools:
                function = tool["function"]
                spec: dict[str, Any] = {
                    "name": function["name"],
                    "inputSchema": {
                        "json": function.get("parameters") or {"type": "object", "properties": {}}
                    },
                }
                if function.get("description"):
                    spec["description"] = function["description"]
                wire.append({"toolSpec": spec})
            if cache:
                wire.append(_CACHE_POINT)
            self._tools = (tools, cache, wire)
        return wire


def _tool_choice(choice: str | None) -> dict[str, Any] | None:
    """Converse's ``toolChoice`` (it has no "none": the tools are then offered freely)."""
    if choice is None or choice == "none":
        return None
    if choice == "auto":
        return {"auto": {}}
    if choice == "required":
        return {"any": {}}
    return {"tool": {"name": choice}}


# -- credentials and signing -----------------------------------------------------------------


class _Signer:
    """Signs requests with SigV4: credentials from ``aws_access_key_id=``... or botocore's
    standard chain (environment, shared files and profiles, SSO, container and instance
    roles), resolved in a worker thread the first time, and refreshed there when botocore
    says they need it. Its repr shows nothing of them."""

    __slots__ = ("_auth", "_credentials", "_failure", "_refreshable", "_request", "profile",
                 "region")

    def __init__(self, region: str, profile: str | None, credentials: Credentials | None) -> None:
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest
        from botocore.credentials import RefreshableCredentials
        from botocore.exceptions import BotoCoreError

        self.region = region
        self.profile = profile
        self._credentials = credentials
        # botocore's parts, looked up once (not on every request)
        self._auth, self._request = SigV4Auth, AWSRequest
        self._refreshable, self._failure = RefreshableCredentials, BotoCoreError
        _quiet_botocore()

    def _resolve(self) -> Credentials | None:
        import botocore.session

        return botocore.session.Session(profile=self.profile).get_credentials()

    async def credentials(self, reporter: Reporter) -> ReadOnlyCredentials:
        """The credentials to sign with now (never read on the event loop's thread when
        that could wait on a file or the network)."""
        try:
            credentials = self._credentials
            if credentials is None:
                credentials = await asyncio.to_thread(self._resolve)
                if credentials is None:
                    raise ModelError(
                        f"no AWS credentials found for Amazon Bedrock at {reporter.host}: set "
                        f"{_CREDENTIALS_HINT} (botocore's standard chain)", host=reporter.host,
                    )
                self._credentials = credentials
            if isinstance(credentials, self._refreshable) and credentials.refresh_needed():
                frozen = await asyncio.to_thread(credentials.get_frozen_credentials)
            else:
                frozen = credentials.get_frozen_credentials()
        except self._failure as error:
            raise ModelError(
                reporter.redact(
                    f"could not get AWS credentials for Amazon Bedrock at {reporter.host} "
                    f"({type(error).__name__}: {error}); check {_CREDENTIALS_HINT}"
                ),
                host=reporter.host,
            ) from None
        return frozen

    def sign(self, frozen: ReadOnlyCredentials, request: httpx.Request) -> str:
        """Add ``X-Amz-Date``, ``Authorization`` (and ``X-Amz-Security-Token``) to
        ``request``; the signature made."""
        headers = request.headers
        signed = self._request(
            method=request.method, url=str(request.url), data=request.content,
            headers={"Content-Type": headers["content-type"], "Host": headers["host"]},
        )
        _signing.active = True
        try:
            self._auth(frozen, SERVICE, self.region).add_auth(signed)
        finally:
            _signing.active = False
        for name in ("X-Amz-Date", "X-Amz-Security-Token", "Authorization"):
            value = signed.headers.get(name)
            if value is not None:
                headers[name] = value
        return str(signed.headers["Authorization"]).rpartition("Signature=")[2]


class _Redacted(Sequence[str]):
    """The strings a request's errors must not show: the client's fixed secrets, the
    credentials' secret key, session token and key id, and the latest signatures. One
    object for a client and its forks; its repr shows none of them."""

    def __init__(self, fixed: Sequence[str]) -> None:
        self.fixed = tuple(fixed)
        self.credentials: tuple[str, ...] = ()
        self.signatures: collections.deque[str] = collections.deque(maxlen=_KEPT_SIGNATURES)

    def __iter__(self) -> Iterator[str]:
        return itertools.chain(self.fixed, self.credentials, self.signatures)

    def __len__(self) -> int:
        return len(self.fixed) + len(self.credentials) + len(self.signatures)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return list(self)[index]

    def __repr__(self) -> str:
        return f"<{len(self)} secrets>"

    __str__ = __repr__


# -- the client ------------------------------------------------------------------------------


class BedrockClient(HTTPModelClient):
    """A model on Amazon Bedrock through the Converse API (``client("bedrock:<modelId>")``).

    ``region`` defaults to ``AWS_REGION``, then ``AWS_DEFAULT_REGION``; ``base_url`` to
    ``AWS_ENDPOINT_URL_BEDROCK_RUNTIME``, then ``AWS_ENDPOINT_URL``, then
    ``https://bedrock-runtime.{region}.amazonaws.com``. Credentials: ``aws_access_key_id``,
    ``aws_secret_access_key`` (and ``aws_session_token``) when given, else botocore's
    standard chain (``profile`` names a profile of the shared files, else ``AWS_PROFILE``).
    ``options`` are merged into every request body in Converse's own names
    (``inferenceConfig``, ``additionalModelRequestFields`` for a model's own settings such
    as Claude's ``thinking``, ``guardrailConfig``...). ``cache=True`` puts a cache point
    after the system prompt and the tools. ``continues_partial=True`` sends a cut answer
    as a trailing assistant message for the model to continue (Claude models do; others
    may not). ``timeout``, ``connect_timeout``, ``retries``, ``retry_delay``,
    ``concurrency`` and ``context_window`` are as for every HTTP client.
    """

    provider = "bedrock"
    service = "Amazon Bedrock"
    hint = "check region= / AWS_REGION, or base_url= / AWS_ENDPOINT_URL_BEDROCK_RUNTIME"
    url_example = "https://bedrock-runtime.us-east-1.amazonaws.com"
    signs = True

    def __init__(
        self,
        model: str,
        *,
        region: str | None = None,
        base_url: str | None = None,
        profile: str | None = None,
        aws_access_key_id: str | None = None,
        aws_secret_access_key: str | None = None,
        aws_session_token: str | None = None,
        cache: bool = False,
        headers: Mapping[str, str] | None = None,
        **settings: Unpack[TurnKeywords],
    ) -> None:
        settled = ClientSettings.of(type(self).__name__, TurnKeywords, settings)
        with needs_extra("the bedrock: provider", "bedrock"):
            from botocore.credentials import Credentials
        region = (region or next(filter(None, map(os.environ.get, REGION_ENVS)), "")).strip()
        url = base_url or next(filter(None, map(os.environ.get, URL_ENVS)), None)
        url, sent, secrets = self.service_settings(
            url or f"https://bedrock-runtime.{region or 'us-east-1'}.amazonaws.com", None, headers
        )
        given: Credentials | None = None
        if aws_access_key_id or aws_secret_access_key or aws_session_token:
            if not (aws_access_key_id and aws_secret_access_key):
                raise ValueError(
                    "aws_access_key_id= and aws_secret_access_key= are given together"
                )
            given = Credentials(aws_access_key_id, aws_secret_access_key, aws_session_token)
            secrets += [s for s in (aws_secret_access_key, aws_session_token) if s]
        # Always merged: Converse wants user and assistant to alternate.
        settled = dataclasses.replace(settled, merge_roles=False, base_url=base_url,
                                      headers=headers)
        super().__init__(model, url, settled, headers=sent, secrets=secrets,
                         to_wire=message_blocks)
        if not region:  # after the options every client checks, as the others do
            raise ValueError(
                f"bedrock:{model} needs an AWS region: region= or {' / '.join(REGION_ENVS)}"
            )
        self.region = region
        self.cache = bool(cache)
        self._signer = _Signer(region, profile, given)
        self._redacted = _Redacted(self._secrets)
        self._path = f"{self.url}/model/{quote(self.model, safe='-._~')}"
        self._turns = _Encoder()

    def fork(self) -> Self:
        twin = super().fork()
        twin._turns = _Encoder()
        return twin

    def endpoint(self) -> str:
        return self._path + "/converse-stream"

    def url_for(self, stream: bool) -> str:
        return self.endpoint() if stream else self._path + "/converse"

    def reporter(self) -> Reporter:
        return Reporter(self.service, self.host, self.model, self._redacted,
                        self._pool.timeout, self.hint)

    async def sign(self, request: httpx.Request, reporter: Reporter) -> None:
        frozen = await self._signer.credentials(reporter)
        redacted = self._redacted
        if frozen.secret_key not in redacted.credentials:  # new ones: redacted from now on
            redacted.credentials = tuple(
                s for s in (frozen.secret_key, frozen.token, frozen.access_key) if s
            )
        if request.url.path.endswith("-stream"):
            request.headers["Accept"] = "application/vnd.amazon.eventstream"
        redacted.signatures.append(self._signer.sign(frozen, request))

    def body(self, turn: TurnInput) -> bytes:
        messages, request = turn.messages, turn.request
        encoded = self._turns.messages(messages)
        settings: dict[str, Any] = {}
        if messages and messages[0]["role"] == "system" and messages[0]["content"]:
            system: list[dict[str, Any]] = [{"text": messages[0]["content"]}]
            settings["system"] = [*system, _CACHE_POINT] if self.cache else system
        offered = self._turns.tools(turn.tools, self.cache)
        if offered:
            config: dict[str, Any] = {"tools": offered}
            choice = _tool_choice(request.tool_choice) if request and turn.tools else None
            if choice is not None:
                config["toolChoice"] = choice
            settings["toolConfig"] = config
        if request is not None and request.output_schema is not None:
            structure = {"jsonSchema": {"schema": json.dumps(dict(request.output_schema)),
                                        "name": request.output_name}}
            settings["outputConfig"] = {
                "textFormat": {"type": "json_schema", "structure": structure}
            }
        settings.update(self.options)
        tail = dumps(settings)[1:] if settings else b"}"
        return b'{"messages":' + encoded + (b"," + tail if settings else tail)

    def status_hint(self, status: int) -> str:
        if status in (401, 403):
            return (f"; check the AWS credentials ({_CREDENTIALS_HINT}), the clock, and that "
                    f"they may invoke {self.model} in {self.region}")
        if status == 404:
            return (f"; check the model id and that {self.model} is offered in {self.region} "
                    "(region= / AWS_REGION)")
        return ""

    def decoder(self, reporter: Reporter) -> TurnDecoder:
        return _ConverseTurn(reporter)

    def prefill_space(self, messages: Sequence[Message]) -> str:
        return prefill_space(messages) if messages[-1:] and self.continues_partial else ""


# -- reading a reply -------------------------------------------------------------------------


class _Block:
    """A content block being streamed: its kind (``text``, ``reasoning``, ``toolUse``)."""

    __slots__ = ("data", "kind", "parts")

    def __init__(self, kind: str, data: dict[str, Any]) -> None:
        self.kind = kind
        self.data = data
        self.parts: list[str] = []


class _ConverseTurn(TurnDecoder):
    """One reply: the event stream of ``converse-stream``, or one ``converse`` body."""

    framed = True

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.text = TurnText()
        self.blocks: dict[int, _Block] = {}
        self.done_blocks: list[dict[str, Any]] = []
        self.stop: str | None = None
        self.usage: Usage = {"input_tokens": 0, "output_tokens": 0}
        self.usage_reported = False
        self.seen: set[str] = set()

    # -- streamed -------------------------------------------------------------------

    def split(self, data: bytes) -> tuple[list[bytes], bytes]:
        try:
            return frames.split(data)
        except frames.FrameError as error:
            raise self.reporter.protocol(f"sent a broken event stream: {error}") from None

    def line(self, line: bytes) -> list[Chunk]:
        try:
            message = frames.decode(line)
        except frames.FrameError as error:
            raise self.reporter.protocol(f"sent a broken event stream: {error}") from None
        kind = message.headers.get(":message-type")
        if kind == "exception":
            name = message.headers.get(":exception-type", "")
            detail = self.reporter.json_object(message.payload, f"a {name}")
            text = f"{name}: {clip(detail.get('message', ''))}"
            raise self.reporter.server_error(text, _EXCEPTION_STATUS.get(name, 500))
        if kind == "error":
            code = message.headers.get(":error-code", "")
            said = message.headers.get(":error-message", "")
            raise self.reporter.server_error(f"{code}: {said}", 500)
        if kind != "event":
            return []
        event = self.reporter.json_object(message.payload, "an event")
        return self.event(message.headers.get(":event-type", ""), event)

    def event(self, kind: str, event: Mapping[str, Any]) -> list[Chunk]:
        if kind == "contentBlockDelta":
            return self._delta(event)
        if kind == "contentBlockStart":
            start = as_dict(as_dict(event.get("start")).get("toolUse"))
            self._open(event, "toolUse", dict(start))
            return []
        if kind == "contentBlockStop":
            return self._close(event)
        if kind == "messageStop":
            reason = event.get("stopReason")
            self.stop = reason if isinstance(reason, str) else None
            return []
        if kind == "metadata":
            if self.stop is None:
                raise self.reporter.protocol("sent metadata before messageStop")
            self._count(as_dict(event.get("usage")))
            return self._done()
        return []  # messageStart, and event types added later

    def end(self) -> list[Chunk]:
        if self.stop is None:
            raise self.reporter.unfinished(
                "ended the stream before messageStop (the reply did not finish)"
            )
        return self._done()  # no metadata: the usage is not known

    def _index(self, event: Mapping[str, Any]) -> int:
        index = event.get("contentBlockIndex")
        if not isinstance(index, int) or isinstance(index, bool):
            raise self.reporter.protocol(f"sent a content block event with index {clip(index, 40)}")
        return index

    def _open(self, event: Mapping[str, Any], kind: str, data: dict[str, Any]) -> _Block:
        index = self._index(event)
        if index in self.blocks:
            raise self.reporter.protocol(f"started content block {index} twice")
        block = self.blocks[index] = _Block(kind, data)
        return block

    def _delta(self, event: Mapping[str, Any]) -> list[Chunk]:
        delta = as_dict(event.get("delta"))
        block = self.blocks.get(self._index(event))
        text = delta.get("text")
        if isinstance(text, str):
            block = block or self._open(event, "text", {})
            block.parts.append(text)
            return self.text.chunks(None, text)
        reasoning = delta.get("reasoningContent")
        if isinstance(reasoning, dict):
            block = block or self._open(event, "reasoning", {})
            for key in ("signature", "redactedContent"):
                if isinstance(reasoning.get(key), str):
                    block.data[key] = block.data.get(key, "") + reasoning[key]
            piece = reasoning.get("text")
            if isinstance(piece, str):
                block.parts.append(piece)
                return self.text.chunks(piece, None)
            return []
        tool = delta.get("toolUse")
        if isinstance(tool, dict):
            if block is None or block.kind != "toolUse":
                raise self.reporter.protocol("sent toolUse input before its contentBlockStart")
            if isinstance(tool.get("input"), str):
                block.parts.append(tool["input"])
        return []  # citations and later delta types carry nothing the transcript keeps

    def _close(self, event: Mapping[str, Any]) -> list[Chunk]:
        index = self._index(event)
        block = self.blocks.get(index)
        if block is None:
            raise self.reporter.protocol(f"stopped content block {index} before it began")
        raw = "".join(block.parts)
        if block.kind == "toolUse":
            return [self._call(block.data, raw)]
        if block.kind == "text":
            self.done_blocks.append({"text": clean(raw)})
        else:
            self.done_blocks.append(_reasoning(raw, block.data))
        return []

    def _call(self, data: Mapping[str, Any], raw: str) -> ToolCallDelta:
        name = data.get("name")
        if not isinstance(name, str) or not name:
            raise self.reporter.protocol("sent a toolUse block without a name")
        delta = decoded_call(data.get("toolUseId"), name, raw, self.seen)
        call = delta.call
        self.done_blocks.append({"toolUse": {"toolUseId": call["id"],
                                             "name": call["function"]["name"],
                                             "input": call["function"]["arguments"]}})
        return delta

    def _count(self, usage: Mapping[str, Any]) -> None:
        """The input tokens include those read from and written to the prompt cache;
        those read are the cached input tokens too."""
        inputs = [usage.get(key) for key in
                  ("inputTokens", "cacheReadInputTokens", "cacheWriteInputTokens")]
        self.usage["input_tokens"] = sum(
            v for v in inputs if isinstance(v, int) and not isinstance(v, bool)
        )
        with_cached(self.usage, inputs[1])
        output = usage.get("outputTokens")
        if isinstance(output, int) and not isinstance(output, bool):
            self.usage["output_tokens"] = output
            self.usage_reported = isinstance(inputs[0], int)

    def _done(self) -> list[Chunk]:
        chunks = self.text.flush()
        if any("reasoningContent" in block for block in self.done_blocks):
            chunks.append(NativeData({"wire": WIRE, "content": self.done_blocks}))
        reason = STOP_REASONS.get(self.stop, self.stop) if self.stop is not None else None
        chunks.append(TurnDone(self.usage.copy(), reason, self.usage_reported))
        self.finished = True
        return chunks

    # -- whole ------------------------------------------------------------------------

    def whole(self, body: bytes) -> list[Chunk]:
        reply = self.reporter.json_object(body, "a reply")
        content = as_dict(as_dict(reply.get("output")).get("message")).get("content")
        if not isinstance(content, list):
            raise self.reporter.protocol(f"sent a reply without output.message: {clip(body)}")
        chunks: list[Chunk] = []
        for block in as_list(content):
            block = as_dict(block)
            if isinstance(block.get("text"), str):
                chunks += self.text.chunks(None, block["text"])
                self.done_blocks.append({"text": clean(block["text"])})
            elif isinstance(block.get("toolUse"), dict):
                use = block["toolUse"]
                arguments = use.get("input") if isinstance(use.get("input"), dict) else {}
                chunks.append(self._call(use, json.dumps(arguments)))
            elif isinstance(block.get("reasoningContent"), dict):
                reasoning = block["reasoningContent"]
                said = as_dict(reasoning.get("reasoningText"))
                text = said.get("text") if isinstance(said.get("text"), str) else ""
                chunks += self.text.chunks(text, None)
                data = {"signature": said.get("signature"),
                        "redactedContent": reasoning.get("redactedContent")}
                self.done_blocks.append(_reasoning(str(text), data))
        stop = reply.get("stopReason")
        if not isinstance(stop, str):
            raise self.reporter.protocol("sent a reply that did not finish (no stopReason)")
        self.stop = stop
        self._count(as_dict(reply.get("usage")))
        return chunks + self._done()


def _reasoning(text: str, data: Mapping[str, Any]) -> dict[str, Any]:
    """A reasoning block as Converse takes it back: its text and signature as they came,
    or the redacted content."""
    redacted = data.get("redactedContent")
    if isinstance(redacted, str) and redacted:
        return {"reasoningContent": {"redactedContent": redacted}}
    said: dict[str, Any] = {"text": text}
    signature = data.get("signature")
    if isinstance(signature, str) and signature:
        said["signature"] = signature
    return {"reasoningContent": {"reasoningText": said}}

