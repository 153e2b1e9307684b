"""Bearer tokens that change while a client lives: an Entra ID token provider (Azure) and
Google's application default credentials (Vertex AI).

A :class:`TokenSource` gives the ``Authorization`` header of each request. Nothing here
blocks the event loop: a synchronous provider and every google-auth refresh run in a
worker thread. Each token is added to the request's redacted secrets before it is sent,
so no error or log record of that request shows it.
"""

from __future__ import annotations

import abc
import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from aimu._extras import needs_extra
from aimu.aio.errors import ModelConnectionError
from aimu.aio.providers._errors import clip
from aimu.aio.providers._report import Reporter, Secrets

__all__ = ["CLOUD_PLATFORM", "GoogleCredentials", "TokenProvider", "TokenSource"]

#: The OAuth scope Vertex AI takes.
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"

#: What ``azure_ad_token_provider=`` may be: a function returning a token, or a coroutine
#: function (the ``openai`` SDK's and ``azure-identity``'s providers are either).
ProviderFunction = Callable[[], str | Awaitable[str]]


class TokenSource(abc.ABC):
    """Where a client's bearer token comes from, asked before every request."""

    #: What to check when a token cannot be had (named in the error).
    check: str = ""

    @abc.abstractmethod
    async def token(self) -> str:
        """A token valid now."""

    async def headers(self, reporter: Reporter) -> dict[str, str]:
        """The ``Authorization`` header of one request; the token joins ``reporter``'s
        secrets. A failure to get one is a ModelConnectionError naming what to check."""
        try:
            token = await self.token()
        except Exception as error:  # the provider's own error: named, redacted, chained
            raise ModelConnectionError(
                reporter.redact(
                    f"{reporter.service} at {reporter.host}: no token for model "
                    f"{reporter.model!r} ({type(error).__name__}: {clip(str(error), 200)}); "
                    f"check {self.check}"
                ),
                host=reporter.host,
            ) from error
        if not isinstance(token, str) or not token:
            raise ModelConnectionError(
                f"{reporter.service} at {reporter.host}: {self.check} gave no token "
                f"(got {type(token).__name__})",
                host=reporter.host,
            )
        if token not in reporter.secrets:
            reporter.secrets = Secrets((*reporter.secrets, token))
        return {"Authorization": "Bearer " + token}


class TokenProvider(TokenSource):
    """``azure_ad_token_provider=``: called for every request, as the ``openai`` SDK calls
    it (``azure-identity``'s ``get_bearer_token_provider`` caches the token and refreshes
    it before it expires). A coroutine function is awaited; a plain function runs in a
    worker thread, so a refresh that goes to the network never blocks the loop."""

    check = "azure_ad_token_provider= (your Entra ID credentials)"

    def __init__(self, provider: ProviderFunction) -> None:
        if not callable(provider):
            raise TypeError(
                f"azure_ad_token_provider must be a function returning a token, "
                f"got {type(provider).__name__}"
            )
        self.provider = provider
        self.is_async = inspect.iscoroutinefunction(provider) or inspect.iscoroutinefunction(
            getattr(provider, "__call__", None)  # noqa: B004 - an object with async __call__
        )

    async def token(self) -> str:
        result = self.provider() if self.is_async else await asyncio.to_thread(self.provider)
        if inspect.isawaitable(result):
            result = await result
        return result  # its type is checked by headers()

    def __repr__(self) -> str:
        return f"TokenProvider({getattr(self.provider, '__qualname__', 'provider')})"


class GoogleCredentials(TokenSource):
    """Google credentials (``credentials=``, else the application default credentials,
    found on first use): their token, refreshed in a worker thread when google-auth says
    it is no longer valid (which it says some minutes before it expires), one refresh at
    a time."""

    check = (
        "token=, or the application default credentials (gcloud auth application-default "
        "login, GOOGLE_APPLICATION_CREDENTIALS)"
    )

    def __init__(self, credentials: Any = None) -> None:
        self.credentials = credentials
        self._lock = threading.Lock()

    async def token(self) -> str:
        credentials = self.credentials
        if credentials is not None and credentials.valid:
            return str(credentials.token)
        return await asyncio.to_thread(self._refreshed)

    async def headers(self, reporter: Reporter) -> dict[str, str]:
        """The bearer token, and the credentials' quota project (``x-goog-user-project``,
        as Google's SDKs send it: user credentials bill their quota there)."""
        headers = await super().headers(reporter)
        quota = getattr(self.credentials, "quota_project_id", None)
        if isinstance(quota, str) and quota:
            headers["x-goog-user-project"] = quota
        return headers

    def _refreshed(self) -> str:
        with self._lock:  # a refresh another request started is waited for, not repeated
            if self.credentials is None:
                self.credentials = _default_credentials()
            credentials = self.credentials
            if not credentials.valid:
                credentials.refresh(_google_request())
            return str(credentials.token)

    def __repr__(self) -> str:
        return f"GoogleCredentials({type(self.credentials).__name__})"


def _default_credentials() -> Any:
    with needs_extra("vertex: models", "vertex"):
        import google.auth

    credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
    return credentials


def _google_request() -> Any:
    """google-auth's transport for a refresh (over ``requests``)."""
    with needs_extra("vertex: models", "vertex"):
        from google.auth.transport.requests import Request
    return Request()
