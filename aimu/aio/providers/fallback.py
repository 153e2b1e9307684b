"""``FallbackModel(primary, *others)``: a model client that hands a turn to the next model
when the one it asked cannot answer.

A turn goes to the next model on a connection error, a 5xx, or a 429 that outlasted the
model's own retries; never on a cancel, an interrupt, a deadline or a limit. After part
of the reply came, the next model continues it if it can (``continues_partial``), else
starts the turn over (a :class:`~aimu.aio.providers.base.TurnRetry` tells the reader).
When every model fails, the error names each and its failure. Each model translates
the transcript for its own wire (thinking and native data that cannot cross stay home);
the message a turn writes records the model that answered (``aimu_model``), and
:attr:`FallbackModel.usage_by_model` counts each model's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from typing import Self

from aimu.aio.errors import ModelConnectionError, ModelError, ModelHTTPError
from aimu.aio.providers._resume import TurnSoFar
from aimu.aio.providers._retry import log
from aimu.aio.providers.base import Chunk, ModelClient, TurnDone, TurnRequest
from aimu.aio.scope import RunScope, current_scope
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
        turn, failures = TurnSoFar(messages), list[tuple[ModelClient, ModelError]]()
        scope = current_scope.get()  # the run's (current at the first step)
        for position, model in enumerate(self.models):
            chunks = (
                model.stream_turn(turn.sent, tools, stream=stream)
                if request is None
                else model.stream_turn(turn.sent, tools, stream=stream, request=request)
            )
            try:
                async for chunk in chunks:
                    self._answered = model
                    self._count(chunk)
                    turn.chunks([chunk])
                    yield chunk
                return
            except ModelError as error:
                failures.append((model, error))
                last = position == len(self.models) - 1
                if last or not falls_over(error) or _stopping(scope):
                    if len(failures) == 1:
                        raise
                    raise _every_failure(failures) from error
                nxt = self.models[position + 1]
                log.warning(
                    "model %s:%s at %s failed %s (%s); the turn goes to %s:%s",
                    model.provider, model.model, model.host,
                    "mid-reply" if turn.given else "before its reply", type(error).__name__,
                    nxt.provider, nxt.model,
                )
                if turn.given:  # its text so far: continued by the next, or replaced
                    yield turn.broke(error, len(failures), nxt.continues_partial, None)
            finally:
                await chunks.aclose()

    def _count(self, chunk: Chunk) -> None:
        if isinstance(chunk, TurnDone):
            spent = self.usage_by_model.setdefault(self.answered_by, zero_usage())
            add_usage(spent, chunk.usage)


def _every_failure(failures: list[tuple[ModelClient, ModelError]]) -> ModelError:
    """The error a turn ends with when no model answered it: the last model's, of the
    same kind (a caller's ``except`` still catches it), its message naming each model
    tried and how it failed."""
    last = failures[-1][1]
    said = "; ".join(
        f"{model.provider}:{model.model} at {model.host}: {type(error).__name__}: {error}"
        for model, error in failures
    )
    whole = BaseException.__new__(type(last))
    whole.__dict__.update(last.__dict__)  # host, status_code, body: the last model's
    whole.args = (f"every model of the FallbackModel failed the turn: {said}",)
    return whole


def _stopping(scope: RunScope | None) -> bool:
    """True when the run is being stopped (an interrupt asked, or its deadline reached):
    a failure then ends the turn, it is not handed on."""
    if scope is None:
        return False
    if scope.interrupt_requested:
        return True
    deadline = scope.deadline
    return deadline is not None and asyncio.get_running_loop().time() >= deadline
