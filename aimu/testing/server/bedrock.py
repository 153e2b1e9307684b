"""Amazon Bedrock's Converse API on the loopback server: ``POST /model/{modelId}/converse``
and ``/converse-stream``, every request's SigV4 signature checked as AWS checks it.

The signature is recomputed with botocore from the secret of the access key the request
names (:data:`CREDENTIALS`: a long-term key, and a temporary one whose requests must
carry its session token) over the headers it says it signed, its path, body and time,
and compared; a request without one, with an unknown key, a time more than five minutes
off, a scope of another region or service, or a signature that does not match is
refused 403 with AWS's error type header and body (the mismatch's body shows the
canonical request AWS expected, as some AWS services do: the session token is in it).

A streamed turn goes out as AWS's event stream (:func:`frame`: typed headers, both CRC32
checksums): ``messageStart``, ``contentBlockDelta`` (text, ``reasoningContent`` with a
signature this server checks when it comes back, ``toolUse`` input after its
``contentBlockStart``), ``contentBlockStop``, ``messageStop`` and ``metadata`` with the
usage (with a cache point in the request, half the input counts as read from the cache).
The ``error_event`` and ``overloaded_event`` faults send an ``internalServerException``
or ``throttlingException`` message mid-stream; ``bad_json`` a message whose CRC is wrong.
Requests Converse refuses are refused 400 ``ValidationException``: roles that do not
alternate or a first message not the user's, an empty content or blank text, a
``toolUse`` not answered by the next message's ``toolResult`` blocks (or a result
answering nothing), tool blocks without ``toolConfig``, a forged reasoning signature.
Scripts see the request in the chat shape, as for every wire.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import hmac
import json
import math
import re
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from aimu.testing.script import ScriptedCall, Turn, split_text
from aimu.testing.server.records import Headers
from aimu.testing.server.wire import Protocol, Reply, Wire, json_bytes, output_tokens

__all__ = [
    "BEDROCK",
    "CREDENTIALS",
    "REGION",
    "SESSION_TOKEN",
    "TEMPORARY_KEY_ID",
    "TEST_KEY_ID",
    "BedrockWire",
    "frame",
    "sign_reasoning",
]

#: The region the loopback endpoint is in (a request scoped to another is refused).
REGION = "us-east-1"
TEST_KEY_ID = "AKIALOOPBACKTESTKEY01"
TEMPORARY_KEY_ID = "ASIALOOPBACKTEMPKEY01"
#: The session token a request signed with :data:`TEMPORARY_KEY_ID` must carry.
SESSION_TOKEN = "IQoJb3JpZ2luX2VjEloopback//session/token+EXAMPLE=="
#: The test access keys the server knows: key id -> secret access key.
CREDENTIALS = {
    TEST_KEY_ID: "loopback/K7MDENG+bPxRfiCYsecretEXAMPLEKEY01",
    TEMPORARY_KEY_ID: "loopback/wJalrXUtnFEMI+temporarySECRETKEY01",
}
CONTENT_TYPE = "application/vnd.amazon.eventstream"
PREFIX = "/model/"
_STREAM = "/converse-stream"
_WHOLE = "/converse"
_SKEW = datetime.timedelta(minutes=5)
_ERROR_TYPES = {
    400: "ValidationException", 403: "AccessDeniedException", 404: "ResourceNotFoundException",
    408: "ModelTimeoutException", 424: "ModelErrorException", 429: "ThrottlingException",
    500: "InternalServerException", 503: "ServiceUnavailableException",
}
_STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens",
                 "content_filter": "content_filtered"}
_PADDING = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456"
_REASONING_KEY = b"aimu-loopback-bedrock-reasoning"
_AUTHORIZATION = re.compile(
    r"AWS4-HMAC-SHA256 Credential=([^,\s]+),\s*SignedHeaders=([^,\s]+),\s*Signature=([0-9a-f]+)$"
)


def sign_reasoning(text: str) -> str:
    """The signature the loopback server gives (and checks on) a reasoning block."""
    digest = hmac.new(_REASONING_KEY, text.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return base64.b64encode(digest.digest()).decode("ascii")


# -- the event stream ------------------------------------------------------------------------


def frame(headers: Mapping[str, str], payload: bytes, *, corrupt: bool = False) -> bytes:
    """One event stream message: string headers, the payload, both CRC32 checksums
    (``corrupt``: the message's checksum off by one)."""
    encoded = b"".join(
        bytes([len(key)]) + key + b"\x07" + len(data).to_bytes(2, "big") + data
        for key, data in ((name.encode(), value.encode()) for name, value in headers.items())
    )
    total = 12 + len(encoded) + len(payload) + 4
    prelude = total.to_bytes(4, "big") + len(encoded).to_bytes(4, "big")
    message = prelude + zlib.crc32(prelude).to_bytes(4, "big") + encoded + payload
    checksum = (zlib.crc32(message) + corrupt) & 0xFFFFFFFF
    return message + checksum.to_bytes(4, "big")


def _event(kind: str, data: Mapping[str, Any]) -> bytes:
    headers = {":event-type": kind, ":content-type": "application/json", ":message-type": "event"}
    return frame(headers, json_bytes({**data, "p": _PADDING[: 1 + len(kind) % 40]}))


def _exception(kind: str, message: str) -> bytes:
    headers = {":exception-type": kind, ":content-type": "application/json",
               ":message-type": "exception"}
    return frame(headers, json_bytes({"message": message}))


# -- the signature, checked as AWS checks it -------------------------------------------------


def _denied(kind: str, message: str) -> Reply:
    error_type = f"{kind}:http://internal.amazon.com/coral/com.amazon.coral.service/"
    return Reply(json_bytes({"message": message}), 403, headers=(("x-amzn-ErrorType", error_type),))


def check_signature(method: str, target: str, headers: Headers, body: bytes) -> Reply | None:
    """The 403 AWS gives this request's signature, or None when it is genuine."""
    found = _AUTHORIZATION.match(headers.get("authorization", "").strip())
    if "authorization" not in headers:
        return _denied("MissingAuthenticationTokenException", "Missing Authentication Token")
    if found is None:
        return _denied("IncompleteSignatureException",
                       "Authorization header requires 'Credential', 'SignedHeaders' and "
                       "'Signature' parameters.")
    credential, signed_names, signature = found.groups()
    key_id, _, scope = credential.partition("/")
    secret = CREDENTIALS.get(key_id)
    token = headers.get("x-amz-security-token")
    if secret is None or (key_id == TEMPORARY_KEY_ID) != (token is not None) or (
        token is not None and not hmac.compare_digest(token, SESSION_TOKEN)
    ):
        return _denied("UnrecognizedClientException",
                       "The security token included in the request is invalid.")
    stamp = headers.get("x-amz-date", "")
    try:
        when = datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
    except ValueError:
        return _denied("IncompleteSignatureException", "X-Amz-Date is missing or malformed.")
    now = datetime.datetime.now(datetime.UTC)
    if abs(now - when) > _SKEW:
        return _denied("InvalidSignatureException",
                       f"Signature expired: {stamp} is now earlier than "
                       f"{(now - _SKEW):%Y%m%dT%H%M%SZ} ({now:%Y%m%dT%H%M%SZ} - 5 min.)")
    day, region, service, terminal = [*scope.split("/"), "", "", "", ""][:4]
    if day != stamp[:8] or terminal != "aws4_request" or service != "bedrock":
        return _denied("InvalidSignatureException",
                       f"Credential should be scoped to correct service: 'bedrock'. ({scope})")
    if region != REGION:
        return _denied("InvalidSignatureException",
                       f"Credential should be scoped to a valid region, not '{region}'.")
    names = signed_names.split(";")
    if "host" not in names or "x-amz-date" not in names:
        return _denied("InvalidSignatureException",
                       "'Host' and 'X-Amz-Date' must be signed headers.")
    expected, canonical = _signature(method, target, headers, body, names, secret, stamp)
    if not hmac.compare_digest(expected, signature):
        return _denied(
            "InvalidSignatureException",
            "The request signature we calculated does not match the signature you provided. "
            "Check your AWS Secret Access Key and signing method. Consult the service "
            f"documentation for details.\n\nThe Canonical String for this request should have "
            f"been\n'{canonical}'\n",
        )
    return None


def _signature(
    method: str, target: str, headers: Headers, body: bytes, names: Sequence[str], secret: str,
    stamp: str,
) -> tuple[str, str]:
    """The signature botocore computes for the request as received (only the headers it
    names as signed), and the canonical request it is over."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    host = headers.get("host", "")
    request = AWSRequest(
        method=method, url=f"http://{host}{target}", data=body,
        headers={name: headers.get(name, "") for name in names},
    )
    request.context["timestamp"] = stamp
    token = headers.get("x-amz-security-token")
    key_id = TEMPORARY_KEY_ID if token else TEST_KEY_ID
    auth = SigV4Auth(Credentials(key_id, secret, token), "bedrock", REGION)
    canonical = auth.canonical_request(request)
    return auth.signature(auth.string_to_sign(request, canonical), request), canonical


# -- the wire --------------------------------------------------------------------------------


class BedrockWire(Wire):
    protocol = "bedrock"
    stream_content_type = CONTENT_TYPE

    def __init__(
        self, model: str, body: Mapping[str, Any], call_ids: Iterator[int], *, stream: bool = True
    ) -> None:
        super().__init__(model, body, call_ids)
        self.stream = stream
        self._ids: list[str] | None = None

    def streamed(self) -> bool:
        return self.stream

    def refusal(self) -> str | None:
        return request_error(self.body)

    def script_view(self) -> dict[str, Any]:
        return chat_shape(self.body, self.model)

    def error_body(self, status: int, message: str) -> bytes:
        return json_bytes({"message": message})

    def error_headers(self, status: int) -> list[tuple[str, str]]:
        kind = _ERROR_TYPES.get(status, "ServiceUnavailableException")
        return [("x-amzn-ErrorType", f"{kind}:http://internal.amazon.com/coral/com.amazon.bedrock/")]

    def error_event(self, message: str) -> bytes:
        return _exception("internalServerException", message)

    def overloaded_event(self, message: str) -> bytes:
        return _exception("throttlingException",
                          f"Too many requests, please wait before trying again. ({message})")

    def bad_line(self) -> bytes:
        return frame({":event-type": "contentBlockDelta", ":message-type": "event"},
                     b'{"contentBlockIndex":0,"delta":{"text":"x"}}', corrupt=True)

    def _call_ids(self, calls: Sequence[ScriptedCall]) -> list[str]:
        if self._ids is None:
            self._ids = [call.id or f"tooluse_loopback{next(self.call_ids):08d}" for call in calls]
        return self._ids

    def _usage(self, turn: Turn) -> dict[str, int]:
        cached = turn.input_tokens // 2 if b"cachePoint" in json_bytes(self.body) else 0
        output = output_tokens(turn)
        return {"inputTokens": turn.input_tokens - cached, "outputTokens": output,
                "totalTokens": turn.input_tokens + output, "cacheReadInputTokens": cached,
                "cacheWriteInputTokens": 0}

    def _stop_reason(self, turn: Turn) -> str:
        if turn.stop_reason is not None:
            return _STOP_REASONS.get(turn.stop_reason, turn.stop_reason)
        return "tool_use" if turn.tool_calls else "end_turn"

    def chunks(self, turn: Turn) -> list[bytes]:
        """One piece per delta: a block's start goes with its first delta, its stop with
        its last; ``messageStart`` goes with the first piece."""
        pieces: list[list[bytes]] = []
        index = 0
        if turn.thinking:
            pieces.append([
                _event("contentBlockDelta", {"contentBlockIndex": index, "delta": {
                    "reasoningContent": {"text": turn.thinking}}}),
                _event("contentBlockDelta", {"contentBlockIndex": index, "delta": {
                    "reasoningContent": {"signature": sign_reasoning(turn.thinking)}}}),
                _event("contentBlockStop", {"contentBlockIndex": index}),
            ])
            index += 1
        texts = split_text(turn.text, turn.chunks) if turn.text else []
        if texts:
            pieces += [[_event("contentBlockDelta", {"contentBlockIndex": index,
                                                     "delta": {"text": piece}})]
                       for piece in texts]
            pieces[-1].append(_event("contentBlockStop", {"contentBlockIndex": index}))
            index += 1
        for call, call_id in zip(turn.tool_calls, self._call_ids(turn.tool_calls), strict=True):
            arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
            fragments = split_text(arguments, max(2, math.ceil(len(arguments) / 16)))
            block = [[_event("contentBlockDelta", {"contentBlockIndex": index,
                                                   "delta": {"toolUse": {"input": fragment}}})]
                     for fragment in fragments]
            block[0].insert(0, _event("contentBlockStart", {
                "contentBlockIndex": index,
                "start": {"toolUse": {"toolUseId": call_id, "name": call.name}},
            }))
            block[-1].append(_event("contentBlockStop", {"contentBlockIndex": index}))
            pieces += block
            index += 1
        start = _event("messageStart", {"role": "assistant"})
        if not pieces:
            return [start]
        pieces[0].insert(0, start)
        return [b"".join(piece) for piece in pieces]

    def final(self, turn: Turn) -> list[bytes]:
        return [
            _event("messageStop", {"stopReason": self._stop_reason(turn)}),
            _event("metadata", {"usage": self._usage(turn), "metrics": {"latencyMs": 1}}),
        ]

    def whole(self, turn: Turn, *, finished: bool = True) -> bytes:
        content: list[dict[str, Any]] = []
        if turn.thinking:
            content.append({"reasoningContent": {"reasoningText": {
                "text": turn.thinking, "signature": sign_reasoning(turn.thinking)}}})
        if turn.text:
            content.append({"text": turn.text})
        for call, call_id in zip(turn.tool_calls, self._call_ids(turn.tool_calls), strict=True):
            content.append({"toolUse": {"toolUseId": call_id, "name": call.name,
                                        "input": dict(call.arguments)}})
        reply: dict[str, Any] = {"output": {"message": {"role": "assistant", "content": content}}}
        if finished:
            reply["stopReason"] = self._stop_reason(turn)
        reply["usage"] = self._usage(turn)
        reply["metrics"] = {"latencyMs": 1}
        return json_bytes(reply)


# -- what Converse refuses -------------------------------------------------------------------


def _kinds(block: Mapping[str, Any]) -> list[str]:
    return [key for key in block if key not in ("cachePoint",)] or list(block)


def request_error(body: Mapping[str, Any]) -> str | None:
    """The 400 ``ValidationException`` Converse gives this request body, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "The model returned the following errors: messages: field required"
    if not isinstance(messages[0], Mapping) or messages[0].get("role") != "user":
        return ("A conversation must start with a user message. Try again with a "
                "conversation that starts with a user message.")
    tools_used = False
    pending: list[str] = []  # toolUse ids of the assistant message before
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        if index and role == messages[index - 1].get("role"):
            return ("A conversation must alternate between user and assistant roles. Make sure "
                    "the conversation alternates between user and assistant roles and try again.")
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list) or not content:
            return (f"The content field in the Message object at messages.{index} is empty. Add "
                    "a ContentBlock object to the content field and try again.")
        problem = _block_error(index, str(role), content)
        if problem is not None:
            return problem
        answered = [str(b["toolResult"].get("toolUseId")) for b in content if "toolResult" in b]
        if pending and set(pending) - set(answered):
            missing = ", ".join(sorted(set(pending) - set(answered)))
            return (f"Expected toolResult blocks at messages.{index}.content for the following "
                    f"Ids: {missing}")
        if set(answered) - set(pending):
            return (f"The number of toolResult blocks at messages.{index}.content exceeds the "
                    "number of toolUse blocks of previous turn.")
        pending = [str(b["toolUse"].get("toolUseId")) for b in content if "toolUse" in b]
        tools_used = tools_used or bool(pending or answered)
    if tools_used and not isinstance(body.get("toolConfig"), Mapping):
        return ("The toolConfig field must be defined when using toolUse and toolResult content "
                "blocks.")
    if messages[-1].get("role") == "assistant":
        last = messages[-1]["content"][-1]
        if "text" in last and str(last["text"]) != str(last["text"]).rstrip():
            return "final assistant content cannot end with trailing whitespace"
    return None


def _block_error(index: int, role: str, content: Sequence[object]) -> str | None:
    where = f"messages.{index}.content"
    for position, block in enumerate(content):
        if not isinstance(block, Mapping) or len(_kinds(block)) != 1:
            return f"{where}.{position}: a ContentBlock must hold exactly one member"
        if "text" in block and not str(block["text"]).strip():
            return (f"The text field in the ContentBlock object at {where}.{position} is blank. "
                    "Add text to the text field, and try again.")
        if ("toolUse" in block or "reasoningContent" in block) and role != "assistant":
            return f"{where}.{position}: only an assistant message may hold this block"
        if ("toolResult" in block or "image" in block) and role != "user":
            return f"{where}.{position}: only a user message may hold this block"
        said = block.get("reasoningContent", {}).get("reasoningText")
        if isinstance(said, Mapping) and not hmac.compare_digest(
            str(said.get("signature", "")), sign_reasoning(str(said.get("text", "")))
        ):
            return f"{where}.{position}: the reasoning block's signature is not valid"
        if "toolUse" in block and not isinstance(block["toolUse"].get("input"), Mapping):
            return f"{where}.{position}.toolUse.input: expected a JSON object"
    return None


# -- the request in the chat shape, for scripts ----------------------------------------------


def chat_shape(body: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The request as an OpenAI-style chat body: what scripts and the test model read."""
    messages: list[dict[str, Any]] = []
    system = "".join(str(b.get("text", "")) for b in body.get("system") or ()
                     if isinstance(b, Mapping))
    if system:
        messages.append({"role": "system", "content": system})
    names: dict[str, str] = {}
    for message in body.get("messages") or ():
        if not isinstance(message, Mapping):
            continue
        blocks = [b for b in message.get("content") or () if isinstance(b, Mapping)]
        text = "".join(str(b["text"]) for b in blocks if "text" in b)
        if message.get("role") == "assistant":
            uses = [b["toolUse"] for b in blocks if isinstance(b.get("toolUse"), Mapping)]
            names.update((str(u.get("toolUseId")), str(u.get("name"))) for u in uses)
            shaped: dict[str, Any] = {"role": "assistant", "content": text}
            if uses:
                shaped["tool_calls"] = [
                    {"id": str(u.get("toolUseId")), "type": "function",
                     "function": {"name": str(u.get("name")), "arguments": u.get("input") or {}}}
                    for u in uses
                ]
            messages.append(shaped)
            continue
        results = [b["toolResult"] for b in blocks if isinstance(b.get("toolResult"), Mapping)]
        for result in results:
            call_id = str(result.get("toolUseId"))
            said = "".join(str(part.get("text", "")) for part in result.get("content") or ()
                           if isinstance(part, Mapping))
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "name": names.get(call_id, ""), "content": said})
        if text or not results:
            messages.append({"role": "user", "content": text})
    shaped_body: dict[str, Any] = {"model": model, "messages": messages}
    config: Mapping[str, Any] = body.get("toolConfig") or {}
    tools = [
        {"type": "function", "function": {
            "name": spec.get("name"), "description": spec.get("description", ""),
            "parameters": (spec.get("inputSchema") or {}).get("json")}}
        for entry in config.get("tools") or () if isinstance(entry, Mapping)
        for spec in [entry.get("toolSpec")] if isinstance(spec, Mapping)
    ]
    if tools:
        shaped_body["tools"] = tools
    choice = config.get("toolChoice")
    if isinstance(choice, Mapping):
        shaped_body["tool_choice"] = (
            "auto" if "auto" in choice else "required" if "any" in choice
            else (choice.get("tool") or {}).get("name")
        )
    structure = (((body.get("outputConfig") or {}).get("textFormat") or {}).get("structure") or {})
    schema = (structure.get("jsonSchema") or {}).get("schema")
    if isinstance(schema, str):
        shaped_body["response_format"] = {
            "type": "json_schema", "json_schema": {"name": "output", "schema": json.loads(schema)}
        }
    return shaped_body


class BedrockProtocol(Protocol):
    """Converse's paths name the model: ``/model/{modelId}/converse(-stream)``."""

    def is_chat(self, path: str) -> bool:
        return path.startswith(PREFIX) and path.endswith((_STREAM, _WHOLE))

    def make_wire(self, target: str, body: Mapping[str, Any], call_ids: Iterator[int]) -> Wire:
        path = target.partition("?")[0]
        stream = path.endswith(_STREAM)
        name = unquote(path.removeprefix(PREFIX).removesuffix(_STREAM if stream else _WHOLE))
        return BedrockWire(name or "test", body, call_ids, stream=stream)

    def authorize(self, method: str, target: str, headers: Headers, body: bytes) -> Reply | None:
        return check_signature(method, target, headers, body)


BEDROCK = BedrockProtocol("bedrock", PREFIX + "{modelId}" + _STREAM, BedrockWire)
