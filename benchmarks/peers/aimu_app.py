"""The one-tool agent, served by ``aimu serve``'s app (bench_served.py)."""

import logging
import os

import uvicorn

from aimu import aio, serve
from aimu.serve._uvicorn import engine


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


logging.basicConfig(level=logging.WARNING)
model = aio.client("openai:test", base_url=os.environ["BENCH_MODEL_URL"], api_key="unused")
# BENCH_REDIS: one of a fleet on one store and Redis (bench_served.py's aimu-fleet).
app = serve.app(model, store=os.environ["BENCH_STORE"], token=None, tools=[lookup],
                recover=1.0 if os.environ.get("BENCH_RECOVER") else None,
                redis=os.environ.get("BENCH_REDIS") or None,
                redis_prefix=os.environ.get("BENCH_PREFIX") or "aimu")
# What `aimu serve` runs on: its slow-client deadline on httptools, uvloop (when installed).
chosen = engine()
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning",
            backlog=4096, timeout_keep_alive=600, http=chosen.protocol, loop=chosen.loop)
