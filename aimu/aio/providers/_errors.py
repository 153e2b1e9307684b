"""Transport failures and error bodies in words: the aimu error for each.

Every message names the service and its URL (credentials removed) and says what to
check; none carries a header, so an API key can never end up in one.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Mapping

import httpx

from aimu.aio.errors import ModelConnectionError

__all__ = ["clip", "error_text", "transport_error"]


def _reason(error: BaseException) -> str:
    """The most telling words for ``error``: the OS's reason if one is in its chain."""
    cause: BaseException | None = error
    seen = 0
    while cause is not None and seen < 16:
        if isinstance(cause, ssl.SSLCertVerificationError):  # its errno is not the OS's
            return f"TLS certificate not trusted: {cause.verify_message or cause.reason}"
        if isinstance(cause, ssl.SSLError):
            return f"TLS failed: {cause.reason or cause.strerror or type(cause).__name__}"
        # A connect error may say little ("All connection attempts failed"); the OS error
        # under it says why.
        if isinstance(cause, OSError) and isinstance(cause.errno, int) and cause.errno > 0:
            return os.strerror(cause.errno)  # asyncio's own strerror hides the reason
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror  # resolver errors: "Name or service not known"
        cause = cause.__cause__ or cause.__context__
        seen += 1
    text = str(error).strip()
    return text or type(error).__name__


def transport_error(
    error: httpx.TransportError,
    *,
    service: str,
    host: str,
    hint: str,
    timeout: httpx.Timeout,
) -> ModelConnectionError:
    """The aimu error for a request to ``service`` at ``host`` that failed in transport."""
    if isinstance(error, httpx.ConnectTimeout):
        message = f"could not connect to {service} at {host} within {timeout.connect:g}s; {hint}"
    elif isinstance(error, httpx.ConnectError | httpx.UnsupportedProtocol):
        message = f"cannot connect to {service} at {host} ({_reason(error)}); {hint}"
    elif isinstance(error, httpx.ReadTimeout):
        message = (
            f"{service} at {host} sent nothing for {timeout.read:g}s; the model may be "
            "stuck or overloaded (raise timeout= to wait longer)"
        )
    elif isinstance(error, httpx.TimeoutException):
        message = f"the request to {service} at {host} timed out ({_reason(error)})"
    elif isinstance(error, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        message = (
            f"the connection to {service} at {host} was dropped mid-reply "
            f"({_reason(error)}); the server may have crashed or restarted"
        )
    else:
        message = f"the request to {service} at {host} failed ({_reason(error)}); {hint}"
    return ModelConnectionError(message, host=host)


def error_text(detail: object) -> str:
    """The server's own words: ``{"error": ...}``, ``{"message": ...}``, a string, or JSON."""
    if isinstance(detail, str):
        text = detail.strip()
        if not text.startswith("{"):
            return text
        try:
            detail = json.loads(text)
        except ValueError:
            return text
    if isinstance(detail, Mapping) and "error" in detail:
        detail = detail["error"]
    if isinstance(detail, str):
        return detail.strip()
    if isinstance(detail, Mapping):
        for key in ("message", "detail", "error"):
            if isinstance(detail.get(key), str):
                return str(detail[key]).strip()
    return json.dumps(detail, default=str)


def clip(value: object, limit: int = 500) -> str:
    """Server data for an error message: text cut to ``limit`` characters, with its length."""
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, default=str)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"
