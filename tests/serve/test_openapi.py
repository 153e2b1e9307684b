"""Schemathesis against /openapi.json on a real Uvicorn: no 500, no response that breaks
the document (status, body schema, content type), for inputs generated from it.

Bounded: a fixed number of examples per operation, so it takes seconds, not minutes.
Run against a server alone and one sharing its runs through Redis.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from aimu import aio, serve
from aimu.serve.application import openapi_document
from tests import services
from tests.serve.harness import uvicorn_serving

pytestmark = pytest.mark.slow

EXAMPLES = 40


@pytest.fixture(scope="module", params=["alone", "redis"])
def base_url(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A server on its own, or one sharing its runs through Redis (other routes' paths)."""
    store: Path = tmp_path_factory.mktemp("openapi") / "sessions.db"
    shared: dict[str, str] = {}
    if request.param == "redis":
        shared = {"redis": services.redis_url(),
                  "redis_prefix": f"aimu_test_oa-{secrets.token_hex(4)}"}
    application = serve.app(aio.client("test"), store=store, **shared)
    with uvicorn_serving(application) as url:
        yield url


#: The document FastAPI writes from the routes (the same for every server).
schema = schemathesis.openapi.from_dict(openapi_document())
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_the_api_keeps_its_document(case: schemathesis.Case, base_url: str) -> None:
    case.call_and_validate(base_url=base_url, checks=CHECKS, timeout=20)
