"""The one-tool agent, served by ``aimu serve``'s app (bench_served.py)."""

import logging
import os

import uvicorn

from aimu import aio, serve


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


logging.basicConfig(level=logging.WARNING)
model = aio.client("openai:test", base_url=os.environ["BENCH_MODEL_URL"], api_key="unused")
app = serve.app(model, store=os.environ["BENCH_STORE"], token=None, tools=[lookup],
                recover=1.0 if os.environ.get("BENCH_RECOVER") else None)
uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning",
            backlog=4096, timeout_keep_alive=600)
