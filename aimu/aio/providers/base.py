"""The base every model provider implements: :class:`ModelClient`, the chunk types of a
turn and :class:`TurnAssembler`.

A provider implements one method, :meth:`ModelClient.stream_turn`: an async generator
of :data:`Chunk` for one model turn over a transcript. Closing that generator, or
cancelling the task iterating it, must close the HTTP response at once. A client holds
no conversation: an agent's session owns its transcript, and ``aimu.aio.chat`` asks one
turn over the caller's. Assembling a turn is shared here. Providers import this module,
``aimu.aio.client`` picks a provider; it imports only the data below it (and, inside the
deprecated ``chat()`` shim alone, ``aimu.aio.chat``, which it calls).
"""

from __future__ import annotations

import abc
import warnings
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self, overload

from aimu.aio._echo import echo
from aimu.aio._frozen import quick_init
from aimu.aio._numbers import MAX_COUNT, is_count
from aimu.aio.transcript import (
    AssistantMessage,
    Message,
    ToolCall,
    ToolSpec,
    Usage,
    zero_usage,
)

__all__ = [
    "Chunk",
    "ModelClient",
    "NativeData",
    "TextDelta",
    "ThinkingDelta",
    "ToolCallDelta",
    "TurnAssembler",
    "TurnDone",
    "TurnRequest",
    "TurnRetry",
    "check_context_window",
]


def check_context_window(value: object) -> int | None:
    """``value`` if it is a positive int (at most 2**63-1) or None (``context_window=``);
    else ValueError."""
    if value is None or (
        isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_COUNT
    ):
        return value
    raise ValueError(
        f"context_window must be a positive number of tokens (at most 2**63-1) or None, "
        f"got {echo(value)}"
    )


@quick_init
@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str
    type: Literal["text"] = "text"


@quick_init
@dataclass(frozen=True, slots=True)
class ThinkingDelta:
    text: str
    type: Literal["thinking"] = "thinking"


@quick_init
@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """One complete tool call (providers assemble streamed argument fragments first).

    ``error`` says what was wrong when the model's arguments could not be parsed (the
    call then carries empty arguments): the agent answers it with that error as a
    tool result, so the model can see it and correct itself.
    """

    call: ToolCall
    error: str | None = None
    type: Literal["tool_call"] = "tool_call"


@quick_init
@dataclass(frozen=True, slots=True)
class TurnDone:
    """The turn ended normally; always the last chunk of a complete turn.

    ``stop_reason`` is the server's own word for why the reply ended: ``"stop"``,
    ``"tool_calls"``, ``"length"`` (cut off by the token limit), or None if it gave none.
    ``usage_reported`` is False when the server sent no token counts (``usage`` is then
    zero, not a count): a token limit cannot be checked against it.
    """

    usage: Usage
    stop_reason: str | None = None
    usage_reported: bool = field(default=True, compare=False)
    type: Literal["done"] = "done"

    @property
    def done_reason(self) -> str | None:
        """The former name of :attr:`stop_reason`."""
        return self.stop_reason


@dataclass(frozen=True, slots=True)
class NativeData:
    """Provider-native data of the reply (``{"wire": NAME, ...}``) that its wire needs
    back unchanged on the next turn; kept as the message's ``aimu_native`` only if the
    turn finishes (a cut turn keeps none: nothing half-signed is ever sent back)."""

    data: dict[str, Any]
    type: Literal["native"] = "native"


@quick_init
@dataclass(frozen=True, slots=True)
class TurnRetry:
    """The reply's stream broke and the turn was asked again; what follows replaces or
    continues what came before it.

    ``continued``: the server goes on from ``kept``, the text streamed so far, which
    stays (the model writes only the rest). Else the turn restarted: ``kept`` is ``""``
    and everything streamed before this chunk (text, thinking, tool calls) is replaced
    by what follows. ``spent`` is what the broken attempt cost (its request's tokens as
    its server counted them, else estimated, and its streamed output estimated): a
    finished turn's :class:`TurnDone` counts only the last attempt. ``error`` says what
    broke, ``attempt`` is the retry's number (1 for the first).
    """

    continued: bool
    kept: str
    spent: Usage
    error: str
    attempt: int = 1
    type: Literal["retry"] = "retry"


Chunk = TextDelta | ThinkingDelta | ToolCallDelta | NativeData | TurnDone | TurnRetry


@dataclass(frozen=True, slots=True)
class TurnRequest:
    """What a turn asks of the model beyond the transcript and the tools.

    ``output_schema``: the JSON schema the reply's text must match (Ollama ``format``,
    OpenAI ``response_format``), named ``output_name``. ``tool_choice`` (``"auto"``,
    ``"required"``, ``"none"`` or a tool's name) and ``parallel_tool_calls`` go only
    with tools, and only to servers that have them. None: not sent.
    """

    output_schema: Mapping[str, Any] | None = None
    output_name: str = "output"
    tool_choice: str | None = None
    parallel_tool_calls: bool | None = None


class TurnAssembler:
    """Builds the assistant message of one turn from its chunks, complete or cut short.

    Given the ``client`` the turn streams from, the message records the model that wrote
    it (``aimu_model``, from :attr:`ModelClient.answered_by`: a fallback names the model
    that answered).
    """

    __slots__ = (
        "client", "done", "native", "replaced", "stop_reason", "text_parts", "thinking_parts",
        "tool_calls", "usage", "usage_reported",
    )

    def __init__(self, client: ModelClient | None = None) -> None:
        self.client = client
        self.text_parts: list[str] = []
        self.thinking_parts: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.native: dict[str, Any] | None = None
        self.usage: Usage = zero_usage()
        self.usage_reported = False
        self.done = False
        #: The :attr:`TurnDone.stop_reason` of a finished turn (None until then).
        self.stop_reason: str | None = None
        #: What a restarted turn (:class:`TurnRetry`) had before: the message until the
        #: new reply brings something (a stop meanwhile keeps it, partial).
        self.replaced: tuple[list[str], list[str], list[ToolCall]] | None = None

    def add(self, chunk: Chunk) -> None:
        if isinstance(chunk, TextDelta):
            self.text_parts.append(chunk.text)
        elif isinstance(chunk, ThinkingDelta):
            self.thinking_parts.append(chunk.text)
        elif isinstance(chunk, ToolCallDelta):
            self.tool_calls.append(chunk.call)
        elif isinstance(chunk, NativeData):
            self.native = chunk.data
        elif isinstance(chunk, TurnRetry):
            if not chunk.continued and self._has_parts():  # replaced by what follows
                self.replaced = (self.text_parts, self.thinking_parts, self.tool_calls)
                self.text_parts, self.thinking_parts, self.tool_calls = [], [], []
                self.native = None
        else:
            usage = chunk.usage
            # A count no store can hold (a server's 10**400) is no count: not taken.
            if is_count(usage["input_tokens"]) and is_count(usage["output_tokens"]):
                self.usage, self.usage_reported = usage, chunk.usage_reported
            self.stop_reason = chunk.stop_reason
            self.done = True
            self.replaced = None

    def _has_parts(self) -> bool:
        return bool(self.text_parts or self.thinking_parts or self.tool_calls)

    def _parts(self) -> tuple[list[str], list[str], list[ToolCall]]:
        """The reply's text, thinking and calls: a restarted turn's former ones until
        the new reply brings something (or finishes)."""
        replaced = self.replaced
        if replaced is not None and not self.done and not self._has_parts():
            return replaced
        return self.text_parts, self.thinking_parts, self.tool_calls

    @property
    def started(self) -> bool:
        return self._has_parts() or (self.replaced is not None and not self.done)

    @property
    def text(self) -> str:
        return "".join(self._parts()[0])

    def message(self) -> AssistantMessage:
        """The assistant message so far; marked ``aimu_partial`` unless the turn finished."""
        text_parts, thinking_parts, tool_calls = self._parts()
        message: AssistantMessage = {"role": "assistant", "content": "".join(text_parts)}
        if tool_calls:
            message["tool_calls"] = tool_calls
        if thinking_parts:
            message["thinking"] = "".join(thinking_parts)
        if not self.done:
            message["aimu_partial"] = True
        elif self.native is not None:
            message["aimu_native"] = self.native
        if self.client is not None:
            message["aimu_model"] = self.client.answered_by
        return message


#: What each client shows as :attr:`ModelClient.messages` (the user's view of a
#: conversation; see there), kept beside the clients: a client holds no conversation,
#: and a fork (a copy) shows none.
_SHOWN: weakref.WeakKeyDictionary[ModelClient, list[Message]] = weakref.WeakKeyDictionary()


class ModelClient(abc.ABC):
    """An async model client: :meth:`stream_turn` asks the model for one turn.

    A client is a transport: it holds no conversation and no state of a run (any number
    of sessions may share one). :attr:`messages` is the user's view of the transcript
    of the agent session it was given to (the session owns it). A turn without an agent:
    ``aimu.aio.chat(client, message, messages=...)``."""

    #: The prefix of ``client()`` specs for this provider.
    provider: str = ""
    #: Requests this client retried so far (only the deprecated :attr:`retry_count`
    #: reads it: a run counts its own retries per request, ``RunResult.retries``).
    _retried: int = 0
    #: The server continues a trailing assistant message (a prefix) instead of starting
    #: a new reply: what ``resume(continue_partial=True)`` needs.
    continues_partial: bool = False
    #: The model's context window in tokens, if known (``context_window=`` sets it): an
    #: agent stops ``limited`` before a request that would not fit.
    context_window: int | None = None
    #: The server can say the model's context window (:meth:`discover_context_window`).
    discovers_context_window: bool = False
    #: Awaited with a turn's handle (JSON data) when the server will go on making that
    #: turn without us (a background response): what a session stores so that, after a
    #: crash, :meth:`reattach_turn` picks the turn up instead of asking again.
    on_remote_turn: Callable[[dict[str, Any]], Awaitable[None]] | None = None

    @property
    def retry_count(self) -> int:
        """Deprecated: the retries of every request this client made, for every run and
        session that used it. Retries are counted per run: read ``RunResult.retries``
        (``agent.last_run.retries``), or ``retries`` on the run's ``RunFinished``."""
        warnings.warn(
            f"{type(self).__name__}.retry_count adds up every run's retries on this client; "
            "read a run's own: RunResult.retries (agent.last_run.retries)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._retries_made()

    def _retries_made(self) -> int:
        return self._retried

    def reattach_turn(self, handle: Mapping[str, Any]) -> bool:
        """Make the next turn re-attach to the remote turn ``handle`` names (one given to
        :attr:`on_remote_turn`); False when this client cannot."""
        return False

    async def discover_context_window(self) -> int | None:
        """The model's context window as its server reports it (asked once), or None when
        it cannot be known; the configured ``context_window`` wins."""
        return self.context_window

    def __init__(self, model: str) -> None:
        self.model = model

    @property
    def messages(self) -> list[Message]:
        """The user's view of the agent session's transcript (the client itself never
        reads it): for a client given to an agent, the same list as ``agent.messages``
        (``agent.model_client.messages``: the session owns it; change it through the
        agent: ``restore()``, runs). Before that, the conversation of the deprecated
        :meth:`chat`, which an agent given this client goes on with."""
        shown = _SHOWN.get(self)
        if shown is None:
            shown = _SHOWN[self] = []
        return shown

    @messages.setter
    def messages(self, messages: list[Message]) -> None:
        _SHOWN[self] = messages

    @property
    @abc.abstractmethod
    def host(self) -> str:
        """Where requests go (a URL, or ``"embedded"``); named in every error."""

    @abc.abstractmethod
    def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
        request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        """One model turn over ``messages``, as chunks ending with :class:`TurnDone`.

        An async generator. ``stream=False`` asks the server for one whole reply (the
        chunks are then produced from it). ``request`` asks for more (an output schema,
        tool options); the agent passes it only when it has something to ask. Closing
        the generator or cancelling its task closes the HTTP response at once. Does not
        read or touch :attr:`messages`.
        """

    @abc.abstractmethod
    def fork(self) -> Self:
        """A client with the same model, settings and connection pool (showing no
        conversation: :attr:`messages` is not the client's)."""

    async def aclose(self) -> None:  # noqa: B027 - a client without resources has nothing to do
        """Close network resources. Forks share them: close the client you created."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.provider}:{self.model} at {self.host}>"

    #: ``answered_by`` and the model it names: one string for all the client's messages.
    _answered_by: tuple[str, str] | None = None

    @property
    def answered_by(self) -> str:
        """The ``"provider:model"`` that wrote this client's latest turn (what an
        assistant message records as ``aimu_model``: the same string for every message,
        not a copy in each)."""
        named = self._answered_by
        if named is None or named[1] is not self.model:
            named = self._answered_by = (f"{self.provider}:{self.model}", self.model)
        return named[0]

    @property
    def answered_model(self) -> str:
        """The model name that wrote the latest turn: whose price counts its tokens."""
        return self.model

    @property
    def priced_models(self) -> tuple[str, ...]:
        """The model names a turn may be written by: a cost limit needs a price for each."""
        return (self.model,)

    @overload
    async def chat(
        self,
        message: str | Message,
        *,
        tools: Sequence[ToolSpec] | None = None,
        stream: Literal[False] = False,
    ) -> AssistantMessage: ...

    @overload
    async def chat(
        self,
        message: str | Message,
        *,
        tools: Sequence[ToolSpec] | None = None,
        stream: Literal[True],
    ) -> AsyncIterator[Chunk]: ...

    async def chat(
        self,
        message: str | Message,
        *,
        tools: Sequence[ToolSpec] | None = None,
        stream: bool = False,
    ) -> AssistantMessage | AsyncIterator[Chunk]:
        """Deprecated: ``aimu.aio.chat(client, message, messages=...)`` keeps the
        conversation with the caller. This one appends ``message`` and the reply to
        :attr:`messages`, as it always did."""
        from aimu.aio.chat import chat  # the shim's edge, which goes with it

        warnings.warn(
            f"{type(self).__name__}.chat() is deprecated: a client holds no conversation; "
            "use aimu.aio.chat(client, ..., messages=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        return await chat(self, message, messages=self.messages, tools=tools, stream=stream)
