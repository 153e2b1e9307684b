"""Secrets and reporting: the URL shown, the credentials taken out of it, the secrets
redacted, and the errors of one model request (:class:`Reporter`), each naming the
service, host and model and what to check."""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit, urlunsplit

import httpx

from aimu.aio.errors import ModelHTTPError, ModelProtocolError
from aimu.aio.providers._errors import clip, error_text, transport_error
from aimu.aio.providers._retry import log

__all__ = ["AuthSource", "Reporter", "Secrets", "display_url", "is_local", "split_credentials"]
_TEXT_LIMIT = 500
_REDACTED = "***"


def display_url(url: str) -> str:
    """``url`` without user info or query, fit to name in an error or a repr."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))


def is_local(url: str) -> bool:
    """Whether ``url``'s host is this machine or a private network's (``localhost``,
    ``127.0.0.1``, ``::1``, ``10.x``, ``192.168.x``...): where a model server with no API
    key is normal."""
    host = (urlsplit(url).hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private


_KEYLESS: set[tuple[str, str]] = set()


def _warn_no_key(variable: str, host: str) -> None:
    """Say once per process and host that requests to ``host`` go without an API key: a
    warning (shown by default, as a library's avoidable mistake is), and a log record."""
    if (variable, host) in _KEYLESS:
        return
    _KEYLESS.add((variable, host))
    said = f"no API key for {host}: requests go without one (set {variable}, or pass api_key=)"
    warnings.warn(said, UserWarning, stacklevel=_outside_aimu())  # the line that made it
    log.warning("%s", said)


_AIMU = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _outside_aimu() -> int:
    """The ``stacklevel`` of the first caller outside the aimu package (for its caller)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_AIMU):
        frame, level = frame.f_back, level + 1
    return level


def split_credentials(url: str) -> tuple[str, dict[str, str], list[str]]:
    """``url`` without ``user:password@``, the Basic auth header for it, and the secrets.

    The URL that httpx sees (and logs at INFO) never carries the credentials.
    """
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at:
        return url, {}, []
    user, _, password = userinfo.partition(":")
    user, password = unquote(user), unquote(password)
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    bare = urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    secrets = [s for s in (password, user, token) if len(s) >= 4]
    return bare, {"Authorization": f"Basic {token}"}, secrets


class Secrets(tuple[str, ...]):
    """Strings to redact from every message; never shown by a repr."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{len(self)} secrets>"

    __str__ = __repr__


@dataclass(slots=True, eq=False, repr=False)
class Reporter:
    """Builds the errors of one model request; each names the service, host and model."""

    service: str
    host: str
    model: str
    secrets: Sequence[str]
    timeout: httpx.Timeout
    hint: str

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, _REDACTED)
        return text

    def protocol(self, what: str) -> ModelProtocolError:
        """The reply could not be understood: ``what`` the server did, redacted."""
        return ModelProtocolError(
            self.redact(f"{self.service} at {self.host} {what} (model {self.model!r})"),
            host=self.host,
        )

    def unfinished(self, what: str) -> ModelProtocolError:
        """The reply broke off before its end: ``what`` the server did, and that it may
        have stopped mid-reply."""
        return self.protocol(f"{what}; the server may have stopped mid-reply")

    def json_object(self, raw: str | bytes, what: str) -> dict[str, Any]:
        """``raw`` parsed as a JSON object, else the protocol error naming ``what`` it was.

        Raised outside the ``except``: no chained error keeps the raw text (which may
        echo a secret).
        """
        problem = ""
        value: object = None
        try:
            value = json.loads(raw)
        except ValueError as error:
            problem = f"not JSON: {error}"
        if not problem and not isinstance(value, dict):
            problem = "not a JSON object"
        if problem or not isinstance(value, dict):
            raise self.protocol(
                f"sent {what} that could not be understood ({problem}): {clip(raw)}"
            )
        return value

    def server_error(self, detail: object, status: int = 200) -> ModelHTTPError:
        """An error object the server sent inside a 200 reply; ``status`` is the HTTP
        status its kind stands for (Anthropic's ``overloaded_error``: 529), so an error
        that arrives before any byte of the turn is retried as that status would be."""
        text = self.redact(error_text(detail))
        return ModelHTTPError(
            f"{self.service} at {self.host} reported an error mid-reply for model "
            f"{self.model!r}: {text[:_TEXT_LIMIT]}",
            host=self.host, status_code=status, body=text,
        )

    def http_error(self, response: httpx.Response, raw: bytes, hint: str) -> ModelHTTPError:
        body = self.redact(raw.decode("utf-8", "replace"))
        text = error_text(body)[:_TEXT_LIMIT] or response.reason_phrase
        status = response.status_code
        return ModelHTTPError(
            f"{self.service} at {self.host} answered HTTP {status} for model {self.model!r}: "
            f"{text}{hint}",
            host=self.host, status_code=status, body=body,
        )

    # Used as ``with reporter:`` around every read and write: like httpx's own
    # map_httpcore_exceptions, the one place transport failures become aimu errors.
    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, _: object
    ) -> None:
        if isinstance(error, httpx.TransportError):
            raise transport_error(
                error, service=self.service, host=self.host, hint=self.hint, timeout=self.timeout
            ) from error
        if isinstance(error, httpx.DecodingError):
            raise self.protocol(f"sent a body that could not be decoded ({error})") from error


class AuthSource(Protocol):
    """Where a changing credential comes from (:mod:`aimu.aio.providers._auth`)."""

    async def headers(self, reporter: Reporter) -> dict[str, str]:
        """The auth headers of one request; each secret in them joins ``reporter``'s."""
        ...
