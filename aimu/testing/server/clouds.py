"""The clouds' front doors of the loopback server: Azure OpenAI and Vertex AI.

Each checks a request's credential as its service does and refuses a wrong or missing one
(401, in that service's error shape), then hands it to the wire behind it:

- Azure OpenAI: ``/openai/v1/chat/completions`` and ``/openai/v1/responses[/...]`` (the
  v1 API), and the dated API the ``openai`` SDK's ``AzureOpenAI`` client calls,
  ``/openai/deployments/{deployment}/chat/completions`` and ``/openai/responses[/...]``
  (these need ``?api-version=``, as Azure does). The credential is an ``api-key`` header
  (one of :attr:`CloudAccess.azure_keys`) or an ``Authorization: Bearer`` token.
- Vertex AI: ``/{v1,v1beta1}/projects/{project}/locations/{location}/publishers/google/
  models/{model}:{streamGenerateContent,generateContent}``; the credential is a bearer
  token. The Gemini wire answers it.
- ``POST /token``: an OAuth 2 token endpoint that issues tokens living
  :attr:`CloudAccess.token_lifetime` seconds for a refresh token it knows, or for a
  service account's JWT (``jwt-bearer`` grant) asking for the cloud-platform scope.

A token is accepted while it lives (:attr:`CloudAccess.tokens`, token to expiry).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs

from aimu.testing.server._connection import Request
from aimu.testing.server.wire import Reply, json_bytes

__all__ = [
    "AZURE_KEY",
    "REFRESH_TOKEN",
    "TOKEN",
    "TOKEN_PATH",
    "CloudAccess",
    "is_cloud_path",
    "service_account_info",
]

#: The API key, bearer token and refresh token the server accepts unless told otherwise.
AZURE_KEY = "loopback-azure-key"
TOKEN = "loopback-token"
REFRESH_TOKEN = "loopback-refresh-token"
TOKEN_PATH = "/token"
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
_JWT_GRANT = "urn:ietf:params:oauth:grant-type:jwt-bearer"

_AZURE = "/openai/"
_VERTEX = re.compile(
    r"/(v1|v1beta1)/projects/([^/]+)/locations/([a-z0-9-]+)/publishers/google/models/"
    r"([^/:]+)(:[A-Za-z]+)"
)
_LEGACY_CHAT = re.compile(r"/openai/deployments/([^/]+)(/chat/completions)")
_AZURE_KEY_REFUSED = (
    "Access denied due to invalid subscription key or wrong API endpoint. Make sure to "
    "provide a valid key for an active subscription and use a correct regional API endpoint "
    "for your resource."
)
_AZURE_TOKEN_REFUSED = (
    "Unauthorized. Access token is missing, invalid, audience is incorrect "
    "(https://cognitiveservices.azure.com), or have expired."
)
_GOOGLE_REFUSED = (
    "Request had invalid authentication credentials. Expected OAuth 2 access token, login "
    "cookie or other valid authentication credential. See "
    "https://developers.google.com/identity/sign-in/web/devconsole-project."
)


def is_cloud_path(path: str) -> bool:
    """A path one of the clouds' front doors answers."""
    return path.startswith(_AZURE) or "/projects/" in path or path == TOKEN_PATH


@dataclass
class CloudAccess:
    """The credentials the clouds' front doors accept, and the tokens they issued."""

    azure_keys: set[str] = field(default_factory=lambda: {AZURE_KEY})
    #: Bearer token -> when it expires (``time.time()``; ``inf``: never).
    tokens: dict[str, float] = field(default_factory=lambda: {TOKEN: float("inf")})
    refresh_tokens: set[str] = field(default_factory=lambda: {REFRESH_TOKEN})
    #: Seconds a token from ``POST /token`` lives.
    token_lifetime: int = 3600
    #: The tokens ``POST /token`` issued, in order.
    issued: list[str] = field(default_factory=list)

    def bearer_ok(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and self.tokens.get(token, 0.0) > time.time()

    def route(self, request: Request) -> tuple[Request, Reply | None]:
        """The request as the wire behind the door takes it, and the door's own answer
        (a refusal, a token), if it gives one."""
        path, _, query = request.target.partition("?")
        if path == TOKEN_PATH:
            return request, self._token(request)
        if path.startswith(_AZURE):
            return self._azure(request, path, query)
        found = _VERTEX.fullmatch(path)
        if found is None:
            return request, None
        target = f"/v1beta/models/{found[4]}{found[5]}" + (f"?{query}" if query else "")
        routed = dataclasses.replace(request, target=target)
        if not self.bearer_ok(request):
            error = {"code": 401, "message": _GOOGLE_REFUSED, "status": "UNAUTHENTICATED"}
            return routed, Reply(json_bytes({"error": error}), 401)
        return routed, None

    def _azure(self, request: Request, path: str, query: str) -> tuple[Request, Reply | None]:
        legacy = _LEGACY_CHAT.fullmatch(path)
        if path.startswith("/openai/v1/"):
            routed_path = path.removeprefix("/openai")
        elif legacy is not None:
            routed_path = "/v1" + legacy[2]
        else:
            routed_path = "/v1/" + path.removeprefix(_AZURE)
        routed = dataclasses.replace(request, target=routed_path + (f"?{query}" if query else ""))
        key = request.headers.get("api-key")
        if key is not None and key not in self.azure_keys:
            return routed, _azure_error(401, _AZURE_KEY_REFUSED)
        if key is None and not self.bearer_ok(request):
            return routed, _azure_error(401, _AZURE_TOKEN_REFUSED)
        if not path.startswith("/openai/v1/") and "api-version" not in parse_qs(query):
            return routed, _azure_error(404, "Resource not found")
        return routed, None

    def _token(self, request: Request) -> Reply:
        form = parse_qs(request.body.decode("utf-8", "replace"))
        grant = form.get("grant_type", [""])[0]
        if grant == _JWT_GRANT:
            granted = _assertion_ok(form.get("assertion", [""])[0])
        else:
            granted = grant == "refresh_token" and (
                form.get("refresh_token", [""])[0] in self.refresh_tokens
            )
        if not granted:
            refused = {"error": "invalid_grant", "error_description": "Bad Request"}
            return Reply(json_bytes(refused), 400)
        token = f"ya29.loopback-{len(self.issued) + 1}"
        self.issued.append(token)
        self.tokens[token] = time.time() + self.token_lifetime
        body: dict[str, object] = {"access_token": token, "expires_in": self.token_lifetime,
                "token_type": "Bearer", "scope": CLOUD_PLATFORM}
        return Reply(json_bytes(body))


def service_account_info(token_uri: str, project: str = "loopback-project") -> dict[str, str]:
    """A service account's key file (a fresh RSA key; needs ``cryptography``) whose
    tokens come from ``token_uri``: the server's ``url + "/token"``. Written to a file
    named by ``GOOGLE_APPLICATION_CREDENTIALS``, it is the application default
    credentials google-auth finds."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption()).decode()
    return {
        "type": "service_account", "project_id": project, "private_key_id": "loopback-1",
        "private_key": pem, "client_email": f"aimu@{project}.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": token_uri,
    }


def _assertion_ok(assertion: str) -> bool:
    """A service account's signed JWT (its signature is not checked here) for this token
    endpoint, asking for the cloud-platform scope."""
    parts = assertion.split(".")
    if len(parts) != 3:
        return False
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return False
    return (
        isinstance(claims, dict)
        and str(claims.get("aud", "")).endswith(TOKEN_PATH)
        and CLOUD_PLATFORM in str(claims.get("scope", "")).split()
        and bool(claims.get("iss"))
    )


def _azure_error(status: int, message: str) -> Reply:
    return Reply(json_bytes({"error": {"code": str(status), "message": message}}), status)
