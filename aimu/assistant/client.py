"""The chat's model client, and its errors in the chat's own terms.

:func:`make_client` is :func:`aimu.aio.client` with the embedded test model slowed so
that a person sees the reply stream; :func:`error_line` is the one line the chat shows
for an error, a connection error's hint naming the environment variables and
``--model test`` instead of the client's arguments.
"""

from __future__ import annotations

from aimu.aio.client import ModelClient
from aimu.aio.client import client as make_model_client
from aimu.aio.errors import ModelConnectionError

__all__ = ["TEST_MODEL_DELAY", "error_line", "make_client", "without_hint"]

#: Seconds between the embedded test model's chunks, so a person sees the reply stream.
TEST_MODEL_DELAY = 0.03

# What to check when the model server cannot be reached, in the chat's own terms (the
# library's hint names the client's arguments).
_CLI_HINTS = {
    "ollama": "is Ollama running there? set OLLAMA_HOST, or chat offline with --model test",
    "openai": "is the server running? set OPENAI_BASE_URL, or chat offline with --model test",
    "openai-responses": (
        "is the server running? set OPENAI_BASE_URL, or chat offline with --model test"
    ),
    "anthropic": (
        "is the server running? set ANTHROPIC_BASE_URL, or chat offline with --model test"
    ),
    "gemini": (
        "is the server reachable? set GEMINI_BASE_URL, or chat offline with --model test"
    ),
    "azure": (
        "is the resource reachable? set AZURE_OPENAI_BASE_URL, or chat offline with "
        "--model test"
    ),
    "azure-responses": (
        "is the resource reachable? set AZURE_OPENAI_BASE_URL, or chat offline with "
        "--model test"
    ),
    "vertex": (
        "is the endpoint reachable? set GOOGLE_CLOUD_LOCATION (or GOOGLE_VERTEX_BASE_URL), "
        "or chat offline with --model test"
    ),
    "bedrock": (
        "is Bedrock reachable there? set AWS_REGION (or AWS_ENDPOINT_URL_BEDROCK_RUNTIME), "
        "or chat offline with --model test"
    ),
}


def make_client(spec: str) -> ModelClient:
    """The model client for ``spec``; the embedded test model streams visibly slowly."""
    if spec.partition(":")[0] == "test":
        return make_model_client(spec, delay=TEST_MODEL_DELAY)
    return make_model_client(spec)


def error_line(error: BaseException, client: ModelClient | None = None) -> str:
    """The first line of ``error``'s message; a connection error gets the chat's hint."""
    lines = str(error).strip().splitlines()
    line = lines[0] if lines else type(error).__name__
    if isinstance(error, ModelConnectionError) and client is not None:
        line = _in_chat_terms(line, client)
    return line


def without_hint(text: str, client: ModelClient) -> str:
    """``text`` without ``client``'s hint (a retry note, where the hint would repeat)."""
    hint = getattr(client, "hint", None)
    return text.replace(f"; {hint}", "") if isinstance(hint, str) else text


def _in_chat_terms(text: str, client: ModelClient) -> str:
    """``text`` with ``client``'s hint (which names its arguments) in the chat's terms."""
    hint = getattr(client, "hint", None)
    if isinstance(hint, str) and client.provider in _CLI_HINTS:
        return text.replace(hint, _CLI_HINTS[client.provider])
    return text
