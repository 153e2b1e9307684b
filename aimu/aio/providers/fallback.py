"""``FallbackModel(primary, *others)``: a model client that hands a turn to the next model
when the one it asked cannot answer.

A turn goes to the next model on a connection error, a 5xx, or a 429 that outlasted the
model's own retries, all before the first chunk of the reply; never on a cancel, an
interrupt, a deadline or a limit, and never once a reply has begun (its text is already
the run's). Each model translates the transcript for its own wire (thinking and native
data that cannot cross stay home); the message a turn writes records the model that
answered (``aimu_model``), and :attr:`FallbackModel.usage_by_model` counts each model's
tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Self

from aimu.aio.errors import ModelConnectionError, ModelError, ModelHTTPError
from aimu.aio.providers._retry import log
from aimu.aio.providers.base import Chunk, ModelClient, TurnDone, TurnRequest
from aimu.aio.scope import current_scope
from aimu.aio.transcript import Message, ToolSpec, Usage, add_usage, zero_usage

__all__ = ["FallbackModel", "falls_over"]


def falls_over(error: ModelError) -> bool:
    """True for a failure another model may answer instead: the server could not be
    reached or dropped the request, a 5xx, or a 429 (its retries already spent)."""
    if isinstance(error, ModelHTTPError):
        return error.status_code == 429 or 500 <= error.status_code < 600
    return isinstance(error, ModelConnectionError)


class FallbackModel(ModelClient):
    """Several model clients used as one: ``primary`` first, then each of ``others``."""

    provider = "fallback"

    def __init__(self, primary: ModelClient, *others: ModelClient) -> None:
        models = (primary, *others)
        for position, model in enumerate(models):
            if not isinstance(model, ModelClient):
                raise TypeError(
                    f"FallbackModel takes model clients (aio.client(...)); argument {position} "
                    f"is {type(model).__name__}"
                )
        if len({id(model) for model in models}) != len(models):
            raise ValueError("FallbackModel was given the same client twice")
        super().__init__(primary.model)
        self.models: tuple[ModelClient, ...] = models
        self._answered = primary
        #: Tokens each model used on the turns it answered, by ``"provider:model"``.
        self.usage_by_model: dict[str, Usage] = {}
        windows = [m.context_window for m in models if m.context_window is not None]
        # A request must fit whichever model takes it.
        self.context_window = min(windows) if windows else None

    @property
    def host(self) -> str:
        return ", ".join(model.host for model in self.models)

    @property
    def answered_by(self) -> str:
        return self._answered.answered_by

    @property
    def answered_model(self) -> str:
        return self._answered.answered_model

    @property
    def priced_models(self) -> tuple[str, ...]:
        return tuple(name for model in self.models for name in model.priced_models)

    def _retries_made(self) -> int:
        # The retries of every model (each retries on its own before a fallback).
        return sum(model._retries_made() for model in self.models)

    def __repr__(self) -> str:
        inner = ", ".join(f"{m.provider}:{m.model}" for m in self.models)
        return f"<FallbackModel {inner}>"

    def fork(self) -> Self:
        return type(self)(*(model.fork() for model in self.models))

    async def aclose(self) -> None:
        for model in self.models:
            await model.aclose()

    async def stream_turn(
        self,
        messages: Sequence[Message],
        tools: Sequence[ToolSpec] | None = None,
        *,
        stream: bool = True,
        request: TurnRequest | None = None,
    ) -> AsyncGenerator[Chunk, None]:
        last = len(self.models) - 1
        for position, model in enumerate(self.models):
            chunks = (
                model.stream_turn(messages, tools, stream=stream)
                if request is None
                else model.stream_turn(messages, tools, stream=stream, request=request)
            )
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                return
            except ModelError as error:
                await chunks.aclose()
                if position == last or not falls_over(error) or _stopping():
                    raise
                nxt = self.models[position + 1]
                log.warning(
                    "model %s:%s at %s failed before its reply (%s); the turn goes to %s:%s",
                    model.provider, model.model, model.host, type(error).__name__,
                    nxt.provider, nxt.model,
                )
                continue
            except BaseException:
                await chunks.aclose()
                raise
            self._answered = model
            try:
                self._count(first)
                yield first
                async for chunk in chunks:
                    self._count(chunk)
                    yield chunk
            finally:
                await chunks.aclose()
            return

    def _count(self, chunk: Chunk) -> None:
        if isinstance(chunk, TurnDone):
            spent = self.usage_by_model.setdefault(self.answered_by, zero_usage())
            add_usage(spent, chunk.usage)


def _stopping() -> bool:
    """True when the run is being stopped (an interrupt asked, or its deadline reached):
    a failure then ends the turn, it is not handed on."""
    scope = current_scope.get()
    if scope is None:
        return False
    if scope.interrupt_requested:
        return True
    deadline = scope.deadline
    return deadline is not None and asyncio.get_running_loop().time() >= deadline

