"""The one-tool agent, as a LangGraph graph served by ``langgraph dev`` (bench_served.py)."""

import os

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent


@tool
def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


model = ChatOpenAI(model="test", base_url=os.environ["BENCH_MODEL_URL"], api_key="unused",
                   streaming=True, max_retries=0, timeout=600)
graph = create_react_agent(model, [lookup])
