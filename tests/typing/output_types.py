"""Checked by ``mypy --strict`` (tests/test_typing.py), never run: what mypy infers for
``run()`` from an agent's ``output_type``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_type

from pydantic import BaseModel

from aimu import aio


class Weather(BaseModel):
    summary: str


@dataclass
class Forecast:
    days: int


async def inferred() -> None:
    model = aio.client("test")
    text = aio.Agent(model)
    assert_type(text, aio.Agent[str])
    assert_type(await text.run("hi"), str)
    weather = aio.Agent(model, output_type=Weather)
    assert_type(weather, aio.Agent[Weather])
    assert_type(await weather.run("hi"), Weather)
    assert_type(await weather.resume(), Weather)
    assert_type(weather.run_sync("hi"), Weather)
    assert_type(weather.start(), aio.Agent[Weather])
    assert_type(await aio.RunHandle.start(weather.run("hi")), Weather)
    forecast = aio.Agent(model, output_type=Forecast, tool_choice="auto")
    assert_type(await forecast.run("hi"), Forecast)
    numbers = aio.Agent(model, output_type=list[int])
    assert_type(await numbers.run("hi"), list[int])
    either: aio.Agent[int | str] = aio.Agent(model, output_type=int | str)
    assert_type(await either.run("hi"), int | str)
    # A typed agent is a workflow step like any other.
    aio.Chain([weather, text])
