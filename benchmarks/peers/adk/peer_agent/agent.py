"""The one-tool agent, as an ADK agent served by ``adk api_server`` (bench_served.py)."""

import os

from google.adk.agents import Agent
from google.adk.models.lite_llm import LiteLlm


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


root_agent = Agent(
    name="peer_agent",
    model=LiteLlm(model="openai/test", api_base=os.environ["BENCH_MODEL_URL"], api_key="unused"),
    instruction="Answer the question.",
    tools=[lookup],
)
