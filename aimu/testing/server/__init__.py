"""The loopback protocol server: Ollama and OpenAI-compatible chat over real HTTP/1.1.

A :class:`LoopbackServer` listens on 127.0.0.1 (a random port by default) and plays a
script (:mod:`aimu.testing.script`) through ``/api/chat`` (NDJSON) and
``/v1/chat/completions`` (SSE), with delays and injected faults. It records every
request, and for every chat reply whether the client abandoned it and when: a closed
client connection is noticed even while the server waits between chunks.

Run ``python -m aimu.testing.server [--port N] [--delay S]`` to serve the embedded
``test`` model until SIGINT or SIGTERM.

The package, one concept a module: :mod:`.loopback` (the server: lifecycle, routing,
records, waiting), :mod:`._connection` (HTTP/1.1 over h11), :mod:`.playback` (a turn's
delays and faults), :mod:`.wire` with :mod:`.ollama` and :mod:`.openai` (each protocol's
framing and endpoints), :mod:`.clouds` (Azure OpenAI's and Vertex AI's paths in front of
those wires, their credentials checked; an OAuth token endpoint), :mod:`.model` (the
embedded test model), :mod:`.command`.
"""

from aimu.testing.server.command import main
from aimu.testing.server.loopback import LoopbackServer
from aimu.testing.server.model import default_script, requested_schema
from aimu.testing.server.records import RecordedRequest, StreamRecord

__all__ = [
    "LoopbackServer",
    "RecordedRequest",
    "StreamRecord",
    "default_script",
    "main",
    "requested_schema",
]
