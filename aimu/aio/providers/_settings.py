"""The settings every HTTP model client takes, as one value.

Each client's constructor (and ``aio.client(...)``) still takes them as keyword
arguments, typed by the ``*Keywords`` dictionaries below (what a client does not take
is refused as an unexpected keyword, as before); :meth:`ClientSettings.of` checks the
names once and the client carries the one frozen :class:`ClientSettings`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypedDict

from aimu.aio.providers._pool import DEFAULT_CONCURRENCY
from aimu.aio.providers._retry import DEFAULT_DELAY, DEFAULT_RETRIES

__all__ = [
    "ClientSettings",
    "ConnectionKeywords",
    "ServiceKeywords",
    "ServiceTurnKeywords",
    "TurnKeywords",
]


class ConnectionKeywords(TypedDict, total=False):
    """What every HTTP client takes: the model's options, timeouts, retries and bounds."""

    options: Mapping[str, Any] | None
    timeout: float
    connect_timeout: float
    retries: int
    retry_delay: float
    concurrency: int | None
    context_window: int | None


class ServiceKeywords(ConnectionKeywords, total=False):
    """A service reached at a base URL with an API key (all but Ollama and Bedrock)."""

    base_url: str | None
    api_key: str | None
    headers: Mapping[str, str] | None


class TurnKeywords(ConnectionKeywords, total=False):
    """A wire that may merge adjacent roles and continue a cut answer."""

    merge_roles: bool
    continues_partial: bool


class ServiceTurnKeywords(ServiceKeywords, TurnKeywords, total=False):
    """Both (the OpenAI-compatible and Anthropic wires)."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ClientSettings:
    """How an HTTP model client reaches its server and retries, carried as one value
    (the defaults are the keywords' defaults). Its repr leaves out what may hold a
    secret: the base URL (user info, a query), the API key and the headers."""

    base_url: str | None = dataclasses.field(default=None, repr=False)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    headers: Mapping[str, str] | None = dataclasses.field(default=None, repr=False)
    options: Mapping[str, Any] | None = None
    timeout: float = 300.0
    connect_timeout: float = 5.0
    retries: int = DEFAULT_RETRIES
    retry_delay: float = DEFAULT_DELAY
    merge_roles: bool = True
    concurrency: int | None = DEFAULT_CONCURRENCY
    context_window: int | None = None
    continues_partial: bool = False

    @classmethod
    def of(cls, owner: str, taken: type[Any], given: Mapping[str, Any]) -> ClientSettings:
        """The settings of ``given`` keywords, which must be among ``taken``'s (a
        ``*Keywords`` dictionary): TypeError naming the first other, as Python would for
        ``owner(...)``."""
        unknown = sorted(given.keys() - taken.__optional_keys__)
        if unknown:
            raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**given)
