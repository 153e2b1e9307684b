"""Fixtures of the serve tests (see harness.py)."""

from tests.serve.harness import http, model_server, served

__all__ = ["http", "model_server", "served"]
