from . import agent  # noqa: F401  (ADK's api_server finds root_agent here)
