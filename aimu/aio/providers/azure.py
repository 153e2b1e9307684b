"""``azure:<deployment>`` and ``azure-responses:<deployment>``: Azure OpenAI's v1 API.

The ``openai:`` and ``openai-responses:`` wires, configured for an Azure resource: the
base URL is the resource's ``https://<resource>.openai.azure.com/openai/v1``
(``base_url=`` or ``AZURE_OPENAI_BASE_URL``), the model is the deployment's name, and
the credential is one of an API key in the ``api-key`` header (``api_key=`` or
``AZURE_OPENAI_API_KEY``), a fixed Entra ID token (``token=``) or an Entra ID token
provider (``azure_ad_token_provider=``, asked before every request, as the ``openai``
SDK asks it) sent as ``Authorization: Bearer``. No key or token appears in a repr, a
log record or an error.
"""

from __future__ import annotations

import os
from typing import Any

from aimu.aio.providers._auth import ProviderFunction, TokenProvider
from aimu.aio.providers._report import Secrets
from aimu.aio.providers.openai import OpenAIClient, OpenAIService
from aimu.aio.providers.openai_responses import OpenAIResponsesClient

__all__ = ["AzureOpenAIClient", "AzureResponsesClient"]

_CREDENTIALS = "api_key= (or AZURE_OPENAI_API_KEY), token= or azure_ad_token_provider="


class _AzureService(OpenAIService):
    """What both Azure wires share: where the resource is and how a request is
    authenticated."""

    hint = "is the resource reachable? check base_url= / AZURE_OPENAI_BASE_URL"
    url_env = "AZURE_OPENAI_BASE_URL"
    default_url = ""
    url_example = "https://<resource>.openai.azure.com/openai/v1"
    key_envs = ("AZURE_OPENAI_API_KEY",)
    key_header = "api-key"
    key_prefix = ""
    #: How this client authenticates: ``"api-key"``, ``"token"`` or ``"token provider"``.
    credential = "api-key"

    def __init__(
        self,
        deployment: str,
        *,
        token: str | None = None,
        azure_ad_token_provider: ProviderFunction | None = None,
        **options: Any,
    ) -> None:
        """The wire's client (``options``: its own settings) at the resource, with the one
        credential given: the API key, else the token, else the token provider."""
        if not (options.get("base_url") or os.environ.get(self.url_env)):
            raise ValueError(
                f"{self.service} needs the resource's URL: base_url= or {self.url_env} "
                f"(e.g. {self.url_example})"
            )
        api_key = options.pop("api_key", None)
        given = [name for name, value in (("api_key", api_key), ("token", token),
                 ("azure_ad_token_provider", azure_ad_token_provider)) if value is not None]
        if len(given) > 1:
            raise ValueError(f"{self.service}: give one credential, not {' and '.join(given)}")
        if not given and not os.environ.get(self.key_envs[0]):
            raise ValueError(f"{self.service} needs a credential: {_CREDENTIALS}")
        headers = dict(options.pop("headers", None) or {})
        if token is not None:
            if not isinstance(token, str) or not token:
                raise ValueError(f"{self.service}: token= must be a non-empty string")
            headers["Authorization"] = "Bearer " + token
            self.credential = "token"
        auth = None if azure_ad_token_provider is None else TokenProvider(azure_ad_token_provider)
        # A token instead of a key: no api-key header, not even from the environment.
        key = api_key if not given or api_key is not None else ""
        build: Any = super().__init__  # the wire's client (OpenAIClient or the Responses')
        build(deployment, api_key=key, headers=headers, **options)
        if token is not None:
            self._secrets = Secrets((*self._secrets, token))
        if auth is not None:
            self._auth, self.credential = auth, "token provider"

    def status_hint(self, status: int) -> str:
        if status in (401, 403):
            if self.credential == "api-key":
                return "; check api_key= / AZURE_OPENAI_API_KEY and base_url= (the resource)"
            what = "token=" if self.credential == "token" else "azure_ad_token_provider="
            return (
                f"; check {what} (an Entra ID token for https://cognitiveservices.azure.com) "
                "and the identity's role on the resource"
            )
        if status == 404:
            return (
                f"; check the deployment name and that {self.host} is a resource's "
                f".../openai/v1 (base_url= / AZURE_OPENAI_BASE_URL)"
            )
        return ""


class AzureOpenAIClient(_AzureService, OpenAIClient):
    """A deployment on Azure OpenAI over chat completions (``client("azure:<deployment>")``).

    Settings as :class:`~aimu.aio.providers.openai.OpenAIClient`, and ``token=`` or
    ``azure_ad_token_provider=`` (a function, or a coroutine function, returning an
    Entra ID token) instead of ``api_key=``.
    """

    provider = "azure"
    service = "Azure OpenAI"


class AzureResponsesClient(_AzureService, OpenAIResponsesClient):
    """A deployment on Azure OpenAI over the Responses API
    (``client("azure-responses:<deployment>")``), ``background=True`` and its cancel
    included. Settings as :class:`~aimu.aio.providers.openai_responses.OpenAIResponsesClient`
    and the Azure credentials of :class:`AzureOpenAIClient`.
    """

    provider = "azure-responses"
    service = "Azure OpenAI Responses"
