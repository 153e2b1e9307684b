"""``vertex:<gemini model>``: Gemini on Vertex AI.

The ``gemini:`` wire, configured for a Google Cloud project: requests go to
``https://{location}-aiplatform.googleapis.com/v1/projects/{project}/locations/{location}
/publishers/google/models/{model}:streamGenerateContent?alt=sse`` (``global``:
``aiplatform.googleapis.com``; the multi-regions ``us`` and ``eu``:
``aiplatform.{location}.rep.googleapis.com``; ``base_url=`` or
``GOOGLE_VERTEX_BASE_URL`` replaces the host) with an
OAuth access token as ``Authorization: Bearer``: ``token=``, else ``credentials=`` (any
google-auth credentials), else the application default credentials, refreshed in a
worker thread before they expire (google-auth, the ``vertex`` extra). No token appears
in a repr, a log record or an error.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import quote

from aimu._extras import needs_extra
from aimu.aio.providers._auth import GoogleCredentials
from aimu.aio.providers.gemini import GeminiClient

__all__ = ["VertexClient", "vertex_root"]

#: The locations served from a multi-region host (``aiplatform.{location}.rep...``).
_MULTI_REGIONS = frozenset({"us", "eu"})
_LOCATION = re.compile(r"[a-z][a-z0-9-]*")
_VERSIONED = re.compile(r".*/v\d+(?:alpha|beta)?\d*")


def vertex_root(location: str) -> str:
    """The Vertex AI host of ``location``."""
    if location == "global":
        return "https://aiplatform.googleapis.com"
    if location in _MULTI_REGIONS:
        return f"https://aiplatform.{location}.rep.googleapis.com"
    return f"https://{location}-aiplatform.googleapis.com"


class VertexClient(GeminiClient):
    """A Gemini model on Vertex AI (``client("vertex:gemini-2.5-flash", project=...)``).

    ``project`` (else ``GOOGLE_CLOUD_PROJECT``) and ``location`` (else
    ``GOOGLE_CLOUD_LOCATION``, else ``global``) place the model; ``base_url`` (else
    ``GOOGLE_VERTEX_BASE_URL``, as Google's SDK reads it) replaces the host (a URL
    without an API version gets ``/v1``). ``token`` is a fixed access
    token; without it, ``credentials`` or the application default credentials give one.
    The other settings are :class:`~aimu.aio.providers.gemini.GeminiClient`'s.
    """

    provider = "vertex"
    service = "Vertex AI"
    hint = (
        "is the endpoint reachable? check location= / GOOGLE_CLOUD_LOCATION and base_url= "
        "/ GOOGLE_VERTEX_BASE_URL"
    )
    url_env = ""
    default_url = ""
    url_example = "https://us-central1-aiplatform.googleapis.com"
    key_header = "Authorization"
    key_prefix = "Bearer "

    def __init__(
        self,
        model: str,
        *,
        project: str | None = None,
        location: str | None = None,
        token: str | None = None,
        credentials: Any = None,
        base_url: str | None = None,
        **options: Any,
    ) -> None:
        project = project or os.environ.get("GOOGLE_CLOUD_PROJECT")
        location = location or os.environ.get("GOOGLE_CLOUD_LOCATION") or "global"
        if not project:
            raise ValueError("Vertex AI needs the project: project= or GOOGLE_CLOUD_PROJECT")
        if not _LOCATION.fullmatch(location):
            raise ValueError(
                f"location= / GOOGLE_CLOUD_LOCATION must be a region such as us-central1, "
                f"global, us or eu; got {location[:40]!r}"
            )
        if token is not None and (not isinstance(token, str) or not token):
            raise ValueError("Vertex AI: token= must be a non-empty access token")
        if token is not None and credentials is not None:
            raise ValueError("Vertex AI: give token= or credentials=, not both")
        root = base_url or os.environ.get("GOOGLE_VERTEX_BASE_URL") or vertex_root(location)
        root = root.strip().rstrip("/")
        url = root if _VERSIONED.fullmatch(root) else root + "/v1"
        # "": no key from GEMINI_API_KEY either; the token goes as the Bearer "key".
        super().__init__(model, base_url=url, api_key=token or "", **options)
        self.project, self.location = project, location
        self._path = (
            f"{self.url}/projects/{quote(project, safe=':.')}/locations/{location}"
            f"/publishers/google/models/{quote(self.model, safe='-._~@')}"
        )
        if token is None:
            with needs_extra("vertex: models without token=", "vertex"):
                import google.auth.transport.requests  # noqa: F401 - what a refresh uses
            self._auth = GoogleCredentials(credentials)

    def status_hint(self, status: int) -> str:
        if status in (401, 403):
            return (
                "; check token= or the application default credentials (gcloud auth "
                "application-default login, GOOGLE_APPLICATION_CREDENTIALS) and that the "
                f"identity may use Vertex AI in project {self.project!r}"
            )
        if status == 404:
            return (
                f"; check the model name, project= / GOOGLE_CLOUD_PROJECT ({self.project!r}) "
                f"and location= / GOOGLE_CLOUD_LOCATION ({self.location!r})"
            )
        return ""
