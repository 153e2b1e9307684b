"""A run's events, decoded once, turned into a protocol's stream with the nesting kept.

:class:`EventStream` takes the events a follower yields (JSON, decoded here into
:mod:`aimu.aio.events`' classes) or typed events, and calls one hook per thing a
protocol shows; an adapter subclasses it and writes only its wire. The shape it keeps:

- a **step** opens at its first text, reasoning or tool event (or a shown progress) and
  closes at ``StepFinished`` or at :meth:`~EventStream.close` (the run's end, or a stop);
- within a step one **text** part or one **reasoning** part is open at a time: each
  closes the other, a tool call closes both, a tool result closes the text;
- a **tool call** arrives whole (start, arguments, end, in that order), once: a call the
  client was shown before (``shown``) is not started again, its result is shown;
- a turn **restarted** (``TurnRetried``) ends its open parts; a continued one goes on.

The shape of pydantic-ai's ``UIEventStream``: the base knows the nesting, an adapter
its wire format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, Generic, TypeVar, get_args

from aimu.aio.events import (
    Event,
    RunFinished,
    StepFinished,
    TextChunk,
    ThinkingChunk,
    ToolCallStarted,
    ToolProgress,
    ToolResult,
    TurnRetried,
)

__all__ = ["EventStream", "decode", "text_parts"]

Out = TypeVar("Out")


def _path(data: Mapping[str, Any]) -> tuple[str, ...]:
    return tuple(data["path"]) if "path" in data else ()


def _text(data: Mapping[str, Any]) -> TextChunk:
    return TextChunk(data["source"], data["text"], tuple(data["path"]) if "path" in data else ())


def _thinking(data: Mapping[str, Any]) -> ThinkingChunk:
    return ThinkingChunk(data["source"], data["text"],
                         tuple(data["path"]) if "path" in data else ())


def _tool_call(data: Mapping[str, Any]) -> ToolCallStarted:
    return ToolCallStarted(data["source"], data["call_id"], data["name"], data["arguments"],
                           _path(data))


def _tool_progress(data: Mapping[str, Any]) -> ToolProgress:
    return ToolProgress(data["source"], data["call_id"], data["name"], data["progress"],
                        data.get("total"), data.get("message"), _path(data))


def _tool_result(data: Mapping[str, Any]) -> ToolResult:
    return ToolResult(data["source"], data["call_id"], data["name"], data["content"],
                      data["is_error"], _path(data))


def _turn_retried(data: Mapping[str, Any]) -> TurnRetried:
    return TurnRetried(data["source"], data["mode"], data["kept"], data["error"],
                       data.get("attempt", 1), _path(data))


def _step_finished(data: Mapping[str, Any]) -> StepFinished:
    return StepFinished(data["source"], data["step"], _path(data))


def _run_finished(data: Mapping[str, Any]) -> RunFinished:
    return RunFinished(
        data["source"], data["status"], data["reply"], data["usage"], data.get("error"),
        data.get("stop_reason"), data.get("requests", 0), data.get("retries", 0),
        data.get("duration", 0.0), _path(data),
    )


#: The events a protocol shows, by their ``type`` tag: how each is decoded from JSON.
#: (A run's start, a handle's end and a model retry show nothing of their own.)
_DECODERS: Final[dict[object, Callable[[Mapping[str, Any]], Event]]] = {
    "text": _text,
    "thinking": _thinking,
    "tool_call": _tool_call,
    "tool_progress": _tool_progress,
    "tool_result": _tool_result,
    "turn_retried": _turn_retried,
    "step_finished": _step_finished,
    "run_finished": _run_finished,
}


def decode(data: Mapping[str, Any]) -> Event | None:
    """The typed event of ``data`` (one event as :func:`~aimu.aio.event_json.event_data`
    encodes it), or None for one no protocol shows (a run's start, a handle's end)."""
    decoder = _DECODERS.get(data.get("type"))
    return None if decoder is None else decoder(data)


def text_parts(parts: Iterable[object]) -> list[object]:
    """The ``text`` of each of a message's parts typed ``"text"`` (AG-UI's content parts,
    the AI SDK's message parts: both say ``{"type": "text", "text": ...}``)."""
    return [part.get("text") for part in parts
            if isinstance(part, Mapping) and part.get("type") == "text"]


class EventStream(Generic[Out]):
    """One run's events to a protocol's events (``Out``), nesting kept as the module
    says. Feed it each event (:meth:`feed` for JSON, :meth:`on` for a typed one), then
    :meth:`close` it; each returns the protocol's events it makes, in order.

    An adapter overrides the hooks it shows (each returns the events it makes; by
    default none). The calls in ``shown`` are not started again; those in
    ``hidden_calls`` / ``hidden_results`` (set by an adapter) are not shown at all."""

    hidden_calls: frozenset[str] = frozenset()
    hidden_results: frozenset[str] = frozenset()

    def __init__(self, run_id: str, shown: Iterable[str] = ()) -> None:
        self.run_id = run_id
        #: The calls started (or shown before this stream): each is started once.
        self.calls: set[str] = set(shown)
        #: The open text part, the open reasoning part (their ids), and whether a step is.
        self.text_id: str | None = None
        self.reasoning_id: str | None = None
        self.in_step = False
        #: The id of the step's last text part (it stays after the part closes).
        self.step_text: str | None = None
        #: Why the model stopped its last turn (the run's ``RunFinished`` says).
        self.stop_reason: str | None = None
        self._ids = 0

    def next_id(self) -> str:
        """A new id in this stream, ``RUN_ID-N``: parts' ids, and any an adapter needs."""
        self._ids += 1
        return f"{self.run_id}-{self._ids}"

    # -- in -------------------------------------------------------------------------------

    def feed(self, data: Mapping[str, Any]) -> list[Out]:
        """The protocol's events for one of aimu's, as JSON (decoded once, here)."""
        feeder = _FEEDERS.get(data.get("type"))
        return [] if feeder is None else feeder(self, data)

    def on(self, event: Event) -> list[Out]:
        """The protocol's events for one of aimu's typed events."""
        handle = _HANDLERS.get(type(event))
        return [] if handle is None else handle(self, event)

    def close(self) -> list[Out]:
        """End whatever is open: the parts, then the step (a step's end, or the run's)."""
        out = self._end_text() + self._end_reasoning()
        if self.in_step:
            self.in_step = False
            out += self.step_end()
        return out

    def _text(self, event: TextChunk) -> list[Out]:
        if self.text_id is not None and event.text:  # the most of them (an open part is
            # always in a step: a step's end closes its parts first)
            return self.text_delta(self.text_id, event.text)
        out = self._step()
        if event.text:
            out += self._end_reasoning()
            if self.text_id is None:
                self.text_id = self.step_text = self.next_id()
                out += self.text_start(self.text_id)
            out += self.text_delta(self.text_id, event.text)
        return out

    def _thinking(self, event: ThinkingChunk) -> list[Out]:
        if self.reasoning_id is not None and event.text:
            return self.reasoning_delta(self.reasoning_id, event.text)
        out = self._step()
        if event.text:
            out += self._end_text()
            if self.reasoning_id is None:
                self.reasoning_id = self.next_id()
                out += self.reasoning_start(self.reasoning_id)
            out += self.reasoning_delta(self.reasoning_id, event.text)
        return out

    def _tool_call(self, call: ToolCallStarted) -> list[Out]:
        if call.call_id in self.hidden_calls:
            return []
        out = self._step()
        if call.call_id in self.calls:
            return out  # the client has it (it was shown when the run paused)
        parent = self.text_id
        out += self._end_text() + self._end_reasoning()
        self.calls.add(call.call_id)
        return out + self.tool_call_start(call, parent) + self.tool_call_args(call) + (
            self.tool_call_end(call))

    def _tool_result(self, result: ToolResult) -> list[Out]:
        if result.call_id in self.hidden_results:
            return []
        out = self._step() + self._end_text()
        return out + self.tool_result(result)

    def _tool_progress(self, progress: ToolProgress) -> list[Out]:
        shown = self.tool_progress(progress)
        return self._step() + shown if shown else shown

    def _turn_retried(self, retried: TurnRetried) -> list[Out]:
        out = self.turn_retried(retried, self.text_id)
        if retried.mode == "restarted":  # the reply starts again: its parts end here
            out += self._end_text() + self._end_reasoning()
        return out

    def _step_finished(self, step: StepFinished) -> list[Out]:
        out = self.close()
        self.step_text = None
        return out + self.step_finished(step)

    def _run_finished(self, finished: RunFinished) -> list[Out]:
        self.stop_reason = finished.stop_reason
        return []

    def _step(self) -> list[Out]:
        if self.in_step:
            return []
        self.in_step = True
        self.step_text = None
        return self.step_start()

    def _end_text(self) -> list[Out]:
        if self.text_id is None:
            return []
        part, self.text_id = self.text_id, None
        return self.text_end(part)

    def _end_reasoning(self) -> list[Out]:
        if self.reasoning_id is None:
            return []
        part, self.reasoning_id = self.reasoning_id, None
        return self.reasoning_end(part)

    # -- out: the hooks an adapter overrides -----------------------------------------------

    def step_start(self) -> list[Out]:
        return []

    def step_end(self) -> list[Out]:
        return []

    def step_finished(self, step: StepFinished) -> list[Out]:
        """After the step's end (each ``StepFinished``, whether a step was open or not)."""
        return []

    def text_start(self, part: str) -> list[Out]:
        return []

    def text_delta(self, part: str, text: str) -> list[Out]:
        return []

    def text_end(self, part: str) -> list[Out]:
        return []

    def reasoning_start(self, part: str) -> list[Out]:
        return []

    def reasoning_delta(self, part: str, text: str) -> list[Out]:
        return []

    def reasoning_end(self, part: str) -> list[Out]:
        return []

    def tool_call_start(self, call: ToolCallStarted, parent: str | None) -> list[Out]:
        """``parent``: the text part the call closed (None when none was open)."""
        return []

    def tool_call_args(self, call: ToolCallStarted) -> list[Out]:
        return []

    def tool_call_end(self, call: ToolCallStarted) -> list[Out]:
        return []

    def tool_result(self, result: ToolResult) -> list[Out]:
        return []

    def tool_progress(self, progress: ToolProgress) -> list[Out]:
        """What a progress report shows (when it shows something, its step opens first)."""
        return []

    def turn_retried(self, retried: TurnRetried, part: str | None) -> list[Out]:
        """``part``: the text part the broken reply was writing (None when none was open);
        called before a restarted reply's parts end."""
        return []


_HANDLERS: Final[dict[type[Any], Callable[[EventStream[Any], Any], list[Any]]]] = {
    TextChunk: EventStream._text,
    ThinkingChunk: EventStream._thinking,
    ToolCallStarted: EventStream._tool_call,
    ToolProgress: EventStream._tool_progress,
    ToolResult: EventStream._tool_result,
    TurnRetried: EventStream._turn_retried,
    StepFinished: EventStream._step_finished,
    RunFinished: EventStream._run_finished,
}


def _feed_text(stream: EventStream[Any], data: Mapping[str, Any]) -> list[Any]:
    """A text chunk: the most of a run's events. A delta of the open part needs only its
    text (no hook is given the event): it goes straight to ``text_delta``."""
    text = data["text"]
    if stream.text_id is not None and text:
        return stream.text_delta(stream.text_id, text)
    return stream._text(TextChunk(
        data["source"], text, tuple(data["path"]) if "path" in data else ()
    ))


def _feed_thinking(stream: EventStream[Any], data: Mapping[str, Any]) -> list[Any]:
    """A thinking chunk: a delta of the open reasoning part goes straight on, as text's."""
    text = data["text"]
    if stream.reasoning_id is not None and text:
        return stream.reasoning_delta(stream.reasoning_id, text)
    return stream._thinking(ThinkingChunk(
        data["source"], text, tuple(data["path"]) if "path" in data else ()
    ))


def _feeder(
    decoder: Callable[[Mapping[str, Any]], Event],
    handle: Callable[[EventStream[Any], Any], list[Any]],
) -> Callable[[EventStream[Any], Mapping[str, Any]], list[Any]]:
    def feed(stream: EventStream[Any], data: Mapping[str, Any]) -> list[Any]:
        return handle(stream, decoder(data))

    return feed


_TAGGED: Final = {str(cls.__dataclass_fields__["type"].default): cls for cls in get_args(Event)}
#: By ``type`` tag: decode the JSON event, then handle it.
_FEEDERS: Final[dict[object, Callable[[EventStream[Any], Mapping[str, Any]], list[Any]]]] = {
    **{tag: _feeder(decoder, _HANDLERS[_TAGGED[str(tag)]]) for tag, decoder in _DECODERS.items()},
    "text": _feed_text,
    "thinking": _feed_thinking,
}
