"""The one-tool agent, as an Agno agent served by AgentOS (bench_served.py)."""

import os

from agno.agent import Agent
from agno.db.sqlite import SqliteDb
from agno.models.openai.like import OpenAILike
from agno.os import AgentOS


def lookup(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


agent = Agent(
    id="peer-agent",
    name="peer-agent",
    model=OpenAILike(id="test", base_url=os.environ["BENCH_MODEL_URL"], api_key="unused",
                     max_retries=0, timeout=600),
    tools=[lookup],
    db=SqliteDb(db_file=os.environ.get("BENCH_AGNO_DB", "agno.db")),
    telemetry=False,
)
agent_os = AgentOS(agents=[agent], telemetry=False)
app = agent_os.get_app()

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["BENCH_PORT"]), log_level="warning")
