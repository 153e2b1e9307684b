"""Who may call the server: the Host it is reached by, cross-site requests, JSON only.

:class:`RequestGuard` wraps the whole application (outside CORS and the token) and
refuses, before any route runs:

- a ``Host`` this server does not answer to (DNS rebinding: a page on ``evil.example``
  whose name now resolves to 127.0.0.1 would otherwise read every session). Without a
  token only loopback names are served; more are allowed by name (``allowed_hosts``).
- a state-changing request (POST, PUT, PATCH, DELETE) from another site: its ``Origin``
  is not this server's own and not an allowed CORS origin, or the browser's
  ``Sec-Fetch-Site`` says ``cross-site`` / ``same-site`` (another port is another
  origin). A ``fetch`` in ``no-cors`` mode or a ``<form>`` is refused too, whatever its
  content type.
- a state-changing request whose body is not declared ``application/json``: a browser
  sends JSON across sites only after a CORS preflight this server does not grant.

GET, HEAD and OPTIONS pass these checks because no route changes anything on them: none
starts, resumes or revives a run (a page's reconnect that must revive one POSTs).

It also adds the security headers to every response: no framing (``X-Frame-Options``,
CSP ``frame-ancestors``), no sniffing, no referrer, and a CSP that lets the chat page
load only its own files.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Final
from urllib.parse import urlsplit

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aimu.serve.http import error_response

__all__ = ["RequestGuard", "host_name", "is_loopback_name"]

_UNSAFE: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_BROWSER_SAME: Final = frozenset({"same-origin", "none"})
#: The page and its files load only from this server; nothing may frame any response.
PAGE_POLICY: Final = (
    "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
#: The /docs page (aimu.serve.docs): Swagger UI's files and its start script come from
#: this server; no inline script or style, no CDN; "Try it out" calls only this server.
DOCS_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
#: API answers are data: no content of theirs runs, loads or gets framed.
API_POLICY: Final = "default-src 'none'; frame-ancestors 'none'; sandbox"
_HEADERS: Final = (
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("Cross-Origin-Opener-Policy", "same-origin"),
    ("Cross-Origin-Resource-Policy", "same-origin"),
    ("Permissions-Policy", "camera=(), microphone=(), geolocation=()"),
)


def host_name(host: str) -> str:
    """The name in a ``Host`` header or an origin's netloc, without the port, lowercased."""
    host = host.strip().lower()
    if host.startswith("["):  # [::1]:8000
        return host[1:].partition("]")[0]
    name, colon, port = host.rpartition(":")
    return name if colon and port.isascii() and port.isdigit() and ":" not in name else host


def is_loopback_name(name: str) -> bool:
    """True for a name only this machine answers: localhost (and ``*.localhost``, which
    browsers resolve to loopback themselves), 127.0.0.0/8, ::1."""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _allows(patterns: Iterable[str], name: str) -> bool:
    for pattern in patterns:
        if pattern == "*" or pattern == name:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


class RequestGuard:
    """ASGI middleware: Host, cross-site and content-type checks; security headers.

    ``allowed_hosts``: names served besides the loopback ones (``*.example.com``
    matches subdomains; ``*`` any); None: loopback only without a token, any name with
    one. ``origins``: browser origins allowed to call across sites (the CORS ones).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        allowed_hosts: Sequence[str] | None,
        token: bool,
        origins: Sequence[str] = (),
    ) -> None:
        self.app = app
        if allowed_hosts is None:
            allowed_hosts = ["*"] if token else []
        self._hosts = tuple(h.strip().lower().strip("[]") for h in allowed_hosts)
        self._origins = frozenset(o.rstrip("/").lower() for o in origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        reply = _with_security_headers(send, scope)
        if refusal is not None:
            status, message = refusal
            await error_response(status, message)(scope, receive, reply)
            return
        await self.app(scope, receive, reply)

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        host = headers.get("host", "")
        name = host_name(host)
        if not (is_loopback_name(name) or _allows(self._hosts, name)):
            return 400, (
                f"this server does not answer to the host name {name[:80]!r}: without a "
                "token it serves only loopback names (localhost, 127.0.0.1, [::1]); allow "
                "more with --allowed-host NAME (or app(allowed_hosts=[...]))"
            )
        if scope["method"] not in _UNSAFE:
            return None
        origin = headers.get("origin")
        allowed_origin = origin is not None and origin.rstrip("/").lower() in self._origins
        if origin is not None and not allowed_origin:
            parts = urlsplit(origin)
            if origin == "null" or parts.netloc.lower() != host.strip().lower():
                return 403, (
                    f"cross-site request refused: a page from {origin[:100]!r} may not "
                    f"{scope['method']} here; allow that origin with --cors-origin"
                )
        site = headers.get("sec-fetch-site")
        if site is not None and site not in _BROWSER_SAME and not allowed_origin:
            return 403, (
                f"cross-site request refused (Sec-Fetch-Site: {site[:20]}): only this "
                "server's own page may change state; allow an origin with --cors-origin"
            )
        media = headers.get("content-type")
        has_body = headers.get("content-length", "0") != "0" or "transfer-encoding" in headers
        if media is None and not has_body:
            return None  # no body at all: nothing a form or a no-cors fetch smuggles in
        kind = (media or "").partition(";")[0].strip().lower()
        if kind != "application/json":
            return 415, (
                f"the request body must be JSON: send 'Content-Type: application/json' "
                f"(got {(media or 'none')[:60]!r})"
            )
        return None


def _with_security_headers(send: Send, scope: Scope) -> Send:
    path: str = scope["path"][len(scope.get("root_path", "")):] or "/"
    docs = path == "/docs" or path.startswith("/docs/")
    page = docs or path == "/" or path.startswith("/static/")
    policy = DOCS_POLICY if docs else PAGE_POLICY if page else API_POLICY

    async def reply(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = MutableHeaders(scope=message)
            for name, value in _HEADERS:
                headers.setdefault(name, value)
            headers.setdefault("Content-Security-Policy", policy)
            if not page:
                headers.setdefault("Cache-Control", "no-store")
        await send(message)

    return reply
