"""One model turn without an agent: :func:`chat`.

The conversation lives with the caller: ``messages`` is the caller's list, and the client
(a transport) keeps nothing. An agent keeps its own conversation (``agent.messages``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from contextlib import aclosing
from typing import Literal, overload

from aimu.aio.providers.base import Chunk, ModelClient, TurnAssembler
from aimu.aio.transcript import AssistantMessage, Message, ToolSpec, UserMessage, validate

__all__ = ["chat"]


@overload
async def chat(
    client: ModelClient,
    message: str | Message,
    *,
    messages: list[Message] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    stream: Literal[False] = False,
) -> AssistantMessage: ...


@overload
async def chat(
    client: ModelClient,
    message: str | Message,
    *,
    messages: list[Message] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    stream: Literal[True],
) -> AsyncGenerator[Chunk, None]: ...


@overload
async def chat(
    client: ModelClient,
    message: str | Message,
    *,
    messages: list[Message] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    stream: bool = False,
) -> AssistantMessage | AsyncGenerator[Chunk, None]: ...


async def chat(
    client: ModelClient,
    message: str | Message,
    *,
    messages: list[Message] | None = None,
    tools: Sequence[ToolSpec] | None = None,
    stream: bool = False,
) -> AssistantMessage | AsyncGenerator[Chunk, None]:
    """Ask ``client`` for one turn after ``message`` (a str is a user message); the reply.

    ``messages``, the caller's conversation, gets ``message`` and then the reply appended
    (None: a one-shot turn over ``message`` alone). ``stream=True`` returns the reply's
    chunks as an async generator; the reply is appended when it ends. A turn cut short (a
    cancel, an error, a stream closed half-way) leaves what came so far as an assistant
    message marked ``aimu_partial``; one that brought nothing leaves ``message`` last.
    A bad ``message`` or ``messages`` raises TypeError or
    :class:`~aimu.aio.errors.TranscriptError` before anything is appended or sent.
    """
    transcript = _conversation(messages)
    user = _message(message)
    validate([*transcript, user])
    transcript.append(user)
    if stream:
        return _turn(client, transcript, tools, TurnAssembler(), stream=True)
    assembler = TurnAssembler()
    async with aclosing(_turn(client, transcript, tools, assembler, stream=False)) as turn:
        async for _ in turn:
            pass
    return assembler.message()


def _conversation(messages: object) -> list[Message]:
    if messages is None:
        return []
    if not isinstance(messages, list):
        raise TypeError(
            "chat(messages=...) takes the conversation as a list (the message and the reply "
            f"are appended to it), got {type(messages).__name__}"
        )
    return messages


def _message(message: object) -> Message:
    if isinstance(message, str):
        return UserMessage(role="user", content=message)
    if not isinstance(message, Mapping):
        raise TypeError(
            "chat() takes the message as a str or a message dict ({'role': 'user', "
            f"'content': ...}}), got {type(message).__name__}"
        )
    return message  # type: ignore[return-value]  # checked by validate() with the rest


async def _turn(
    client: ModelClient,
    transcript: list[Message],
    tools: Sequence[ToolSpec] | None,
    assembler: TurnAssembler,
    *,
    stream: bool,
) -> AsyncGenerator[Chunk, None]:
    """The turn's chunks, each added to ``assembler``; its message appended at the end,
    however the turn ends (partial when cut short), if the turn brought anything."""
    try:
        async with aclosing(client.stream_turn(transcript, tools, stream=stream)) as chunks:
            async for chunk in chunks:
                assembler.add(chunk)
                yield chunk
    finally:
        if assembler.started or assembler.done:
            transcript.append(assembler.message())
