"""Reaching a live run by its id: one request type, one protocol, one way to apply it.

A client asks a live run to ``cancel``, ``interrupt``, ``stop`` (interrupt, then cancel
after a grace) or take a ``send`` (text, and images as ``data:`` URLs) as a
:class:`Steer`. Whatever carries it (this process's :class:`LocalRuns`, Redis through
``aio.RedisControl``, Temporal through ``aimu.temporal.RunsClient``: each a
:class:`Steering`), :func:`steer` is what finally applies it to the run's handle.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, TypeAlias, cast, get_args

from aimu.aio._ids import is_run_id
from aimu.aio._numbers import grace_seconds
from aimu.aio.errors import UnknownRunError
from aimu.aio.images import received_images
from aimu.aio.scope import sent_message
from aimu.aio.transcript import UserMessage

if TYPE_CHECKING:
    from aimu.aio.run_handle import RunHandle
    from aimu.aio.store import Store

__all__ = [
    "STEER_KINDS", "LocalRuns", "Spawn", "Steer", "SteerKind", "Steering", "send_kept", "steer",
]

SteerKind: TypeAlias = Literal["cancel", "interrupt", "stop", "send"]
#: Every :data:`SteerKind`.
STEER_KINDS: Final = frozenset(get_args(SteerKind))
#: Runs a coroutine in the background (a stop's wait for its grace), owned by the caller.
Spawn: TypeAlias = Callable[[Coroutine[Any, Any, Any]], object]
#: Field names a request has on the wire under another name: a send's ``input_id`` is
#: ``aimu_sent``, the key its kept message carries it under (and the one every aimu's
#: Redis worker reads).
_WIRE: Final = {"input_id": "aimu_sent"}


@dataclass(frozen=True, slots=True)
class Steer:
    """What a client asks of a live run: ``cancel`` (``reason``), ``interrupt``, ``stop``
    (``grace`` seconds, then cancel) or ``send`` (``text``, ``images`` as ``data:`` URLs;
    ``input_id``: the id the send's message is kept under in the session's store, see
    :func:`send_kept`).

    Checked when made (ValueError for an unknown kind or a grace that is not finite
    seconds, 0 or more; TypeError for a reason or text that is not a string), and it
    travels as itself: :meth:`to_json` and :meth:`from_json` are its one wire form, over
    Redis and Temporal alike. Every carrier has one ``request(run_id, steer)``; its verbs
    (``cancel()``, ``stop()``...) make a Steer and call it. :func:`steer` applies it.
    """

    kind: SteerKind
    reason: str | None = None
    grace: float = 5.0
    text: str = ""
    images: tuple[str, ...] = ()
    input_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in STEER_KINDS:
            raise ValueError(f"unknown request {self.kind!r}: cancel, interrupt, stop or send")
        if self.reason is not None and not isinstance(self.reason, str):
            raise TypeError(f"cancel(reason=...) takes a string, got {type(self.reason).__name__}")
        if not isinstance(self.text, str):
            raise TypeError(f"send() takes text as a string, got {type(self.text).__name__}")
        if self.input_id is not None and not is_run_id(self.input_id):
            raise ValueError(f"input_id takes an id of [A-Za-z0-9_-], got {self.input_id!r:.80}")
        object.__setattr__(self, "grace", grace_seconds(self.grace))
        object.__setattr__(self, "images", tuple(self.images))

    @classmethod
    def sending(
        cls, text: str, images: Sequence[object] = (), input_id: str | None = None
    ) -> Steer:
        """A send of ``text`` and ``images`` (bytes, paths or ``data:`` URLs, read and
        checked here as ``run(images=)`` checks them: TypeError or ValueError)."""
        message = sent_message(text, images)
        return cls("send", text=text, images=tuple(message.get("images", ())),
                   input_id=input_id)

    @property
    def must_be_taken(self) -> bool:
        """True for a send: its sender learns whether the run took the text (else it
        joins no run); a cancel, interrupt or stop is done once it is recorded."""
        return self.kind == "send"

    @property
    def what(self) -> str:
        """The request in a sentence: ``the text``, ``the cancel``..."""
        return "the text" if self.kind == "send" else f"the {self.kind}"

    def to_json(self) -> dict[str, Any]:
        """Its wire form: ``kind`` and every field that is not its default."""
        data: dict[str, Any] = {"kind": self.kind}
        for name, default in _DEFAULTS.items():
            value = getattr(self, name)
            if value != default:
                data[_WIRE.get(name, name)] = list(value) if name == "images" else value
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Steer:
        """The request ``data`` (:meth:`to_json`'s, or an older aimu's) carries; checked
        as when made. Fields it does not know (a newer aimu's) are left. Older forms: a
        Redis send as a user message (its text as ``content``), a Temporal cancel's reason
        as ``text``."""
        kind = data.get("kind")
        fields = {name: data[_WIRE.get(name, name)] for name in _DEFAULTS
                  if data.get(_WIRE.get(name, name)) is not None}
        if kind == "send" and "text" not in fields and isinstance(data.get("content"), str):
            fields["text"] = data["content"]  # and ``aimu_sent: true`` when no id was kept
            if not isinstance(fields.get("input_id", ""), str):
                del fields["input_id"]
        if kind == "cancel" and "reason" not in fields and isinstance(data.get("text"), str):
            fields["reason"] = fields.pop("text")
        images = fields.get("images", ())
        if not isinstance(images, list | tuple) or not all(isinstance(i, str) for i in images):
            raise TypeError(f"a request's images are data: URLs, got {images!r:.80}")
        return cls(cast(SteerKind, kind), **fields)

    def check(self) -> Steer:
        """This request, checked in full before a carrier records it for another process:
        a send's message as ``run()`` checks its input (TypeError or ValueError)."""
        if self.kind == "send":
            self.message()
        return self

    def message(self) -> UserMessage:
        """The user message a send adds, checked (TypeError or ValueError, as ``run()``
        checks its input), carrying ``input_id`` if it has one."""
        message = sent_message(self.text, received_images(self.images))
        if self.input_id is not None:
            message["aimu_sent"] = self.input_id
        return message


_DEFAULTS: Final = {f.name: f.default for f in dataclasses.fields(Steer) if f.name != "kind"}


def steer(handle: RunHandle[Any], request: Steer, spawn: Spawn) -> bool:
    """Apply ``request`` to ``handle``: the one place a request's kind is dispatched.
    False if the run could not take it (it ended, is being cancelled, or no longer takes
    text). A stop's wait runs under ``spawn``. A send's images must be ``data:`` URLs
    (ValueError: a path would read this host's files); its text and images are checked
    as ``run()`` checks them."""
    kind = request.kind
    if kind == "cancel":
        return handle.cancel(request.reason)
    if kind == "interrupt":
        return handle.interrupt()
    if kind == "stop":
        if handle.done:
            return False
        spawn(handle.stop(request.grace))
        return True
    return handle.post(request.message())


async def send_kept(
    store: Store, session: str, request: Steer, deliver: Callable[[Steer], Awaitable[bool]]
) -> bool:
    """Deliver the send ``request`` to a run of ``session`` with its message kept in
    ``store`` first (a pending input, see :meth:`~aimu.aio.store.Store.add_input`): True
    once the run took it, and then a process that dies before the run's next step
    boundary loses nothing (the session's next run joins it, once). A run that refused
    it (it ended) or ``deliver`` raising: the input is taken back, unless a run joined
    it meanwhile (then it reached the run: True)."""
    kept = dataclasses.replace(request, input_id=uuid.uuid4().hex)
    await store.add_input(session, kept.message())
    try:
        taken = await deliver(kept)
    except Exception:
        if await store.drop_input(session, str(kept.input_id)):
            raise
        return True
    return taken or not await store.drop_input(session, str(kept.input_id))


class Steering(Protocol):
    """Delivers requests to live runs by id, wherever they run."""

    async def request(self, run_id: str, request: Steer) -> bool:
        """Deliver ``request`` to run ``run_id``; False if it had ended (or refused it),
        ``UnknownRunError`` if there is no such run."""
        ...


class LocalRuns:
    """The runs of this process by id: the :class:`Steering` for them."""

    def __init__(self, spawn: Spawn) -> None:
        self._spawn = spawn
        self._handles: dict[str, RunHandle[Any]] = {}

    def add(self, handle: RunHandle[Any]) -> None:
        """Know ``handle`` by its ``run_id`` until it ends."""
        run_id = handle.run_id
        if run_id is None:
            raise ValueError(f"{handle!r} has no run_id: start it with run_id=")
        self._handles[run_id] = handle
        handle.add_done_callback(lambda done: self._handles.pop(run_id, None))

    def holds(self, run_id: str) -> bool:
        """True while run ``run_id`` is one of these (it has not ended)."""
        return run_id in self._handles

    async def request(self, run_id: str, request: Steer) -> bool:
        handle = self._handles.get(run_id)
        if handle is None:
            raise UnknownRunError(f"no run {run_id!r} in this process", url="this process")
        return steer(handle, request, self._spawn)
