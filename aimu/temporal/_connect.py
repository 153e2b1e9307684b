"""Connecting to Temporal: at once, or a clear error naming the address."""

from __future__ import annotations

import asyncio
from typing import Final

from temporalio.client import Client

from aimu.aio.errors import ControlConnectionError

__all__ = ["connect"]

#: How long a connection attempt may take before Temporal counts as unreachable.
CONNECT_SECONDS: Final = 10.0


async def connect(temporal: str | Client, namespace: str = "default") -> Client:
    """A client of the Temporal server at ``temporal`` (``HOST:PORT``), or ``temporal``.

    ``ControlConnectionError`` naming the address when it does not answer.
    """
    if isinstance(temporal, Client):
        return temporal
    host, colon, port = temporal.rpartition(":")
    if not (colon and host and port.isascii() and port.isdigit()):
        raise ValueError(f"Temporal address {temporal!r}: give HOST:PORT, like 127.0.0.1:7233")
    try:
        async with asyncio.timeout(CONNECT_SECONDS):
            return await Client.connect(temporal, namespace=namespace)
    except (RuntimeError, OSError, TimeoutError) as error:
        raise ControlConnectionError(
            f"cannot reach Temporal at {temporal} (namespace {namespace!r}): "
            f"{_first_line(error)}; is it running (temporal server start-dev)?",
            url=temporal,
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__
