"""A cancelled reply's FIN leaves in the step that takes the cancel, on every wire.

Before, httpcore closed the connection of an abandoned reply after its lock, a
checkpoint and the transport's deferred close (two to four passes of the loop): the
server saw the stream closed that much later. The probe is the client socket's TCP state,
read by a callback queued right behind the cancel: on the loop's next pass, after the
cancelled step and before anything else.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

import pytest

from aimu import aio
from aimu.testing.script import Turn
from aimu.testing.server import LoopbackServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO: Linux")

#: ``tcpi_state`` once our FIN has left: FIN_WAIT1, FIN_WAIT2 (acknowledged).
_FIN_SENT = {4, 5}
_ESTABLISHED = 1


@pytest.fixture(params=["ollama", "openai", "gemini", "openai-responses", "anthropic", "bedrock",
                        "azure", "azure-responses", "vertex"])
def provider(request: pytest.FixtureRequest) -> str:
    """Every wire and every cloud's door (tests/aio/conftest.py's make_client)."""
    return str(request.param)


def _state(sock: socket.socket) -> int:
    return int(struct.unpack("B", sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1))[0])


@pytest.mark.parametrize("way", ["aclose", "task cancel"])
async def test_a_cancelled_reply_sends_its_fin_before_the_loop_runs_anything_else(
    make_client: Callable[..., aio.ModelClient], server: LoopbackServer, way: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``aclose``: the turn closed between two chunks (a consumer that stops reading);
    ``task cancel``: the task reading it cancelled while it waits for bytes (a Stop)."""
    made: list[socket.socket] = []
    connect = socket.socket.connect

    def recording(self: socket.socket, address: Any) -> None:
        made.append(self)
        connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", recording)
    server.script = [Turn(text="one two three four", fault="hang", fault_after=1)]
    model = make_client()
    turn = model.stream_turn([{"role": "user", "content": "go"}])
    await anext(turn)
    (sock,) = made  # the client's connection
    assert _state(sock) == _ESTABLISHED
    loop = asyncio.get_running_loop()
    seen: list[int] = []
    if way == "aclose":
        loop.call_soon(lambda: seen.append(_state(sock)))
        await turn.aclose()
    else:
        reading = asyncio.ensure_future(anext(turn))
        await asyncio.sleep(0)  # it waits for the bytes the server holds back
        assert not reading.done()
        reading.cancel()
        loop.call_soon(lambda: seen.append(_state(sock)))
        with pytest.raises(asyncio.CancelledError):
            await reading
        await turn.aclose()
    assert seen and seen[0] in _FIN_SENT, seen
    (record,) = await server.wait_abandoned(1)
    assert record.chunks_sent == 1
    # The pool goes on: the next request takes a new connection and is answered.
    server.script = [Turn(text="again")]
    chunks = [chunk async for chunk in model.stream_turn([{"role": "user", "content": "go"}])]
    assert any(getattr(chunk, "text", "") == "again" for chunk in chunks)
