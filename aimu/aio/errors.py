"""The one error tree of aimu.

    AimuError
     ├── ModelError                 a model provider failed
     │    ├── ModelConnectionError  the server could not be reached (names the host)
     │    ├── ModelHTTPError        the server answered with an error status
     │    └── ModelProtocolError    the server's reply could not be understood
     ├── TranscriptError            a transcript is invalid (also a ValueError; names the index)
     ├── ToolDefinitionError        a function cannot be offered as a tool (also a TypeError)
     ├── MCPServerError             an MCP server could not be started, reached or listed
     ├── StaleDecisionError         a decision for a pause that no longer waits (a ValueError)
     ├── OutputError                a run could not give its typed output (``output_type=``)
     │    ├── OutputValidationError the model's answers failed the output type (names it)
     │    └── NoOutputError         the run ended without an answer (interrupted, paused)
     ├── StoreError                 durable storage failed
     │    ├── SessionLockedError    another writer holds the session
     │    ├── StoreCapacityError    the store ran out of connections (says which limit)
     │    └── StoreFormatError      a file is corrupt or from a newer schema
     └── ControlError               run control across processes (Redis) failed
          ├── ControlConnectionError  Redis unreachable (names the URL, never the password)
          ├── UnknownRunError       no such run under the prefix (also a LookupError)
          └── RunLostError          the run's worker stopped renewing its lease

Errors name the thing that failed (host, message index, tool, session) and, where
there is one, what to do about it. API keys never appear in a message.
"""

from __future__ import annotations

__all__ = [
    "AimuError",
    "ControlConnectionError",
    "ControlError",
    "MCPServerError",
    "ModelConnectionError",
    "ModelError",
    "ModelHTTPError",
    "ModelProtocolError",
    "NoOutputError",
    "OutputError",
    "OutputValidationError",
    "RunLostError",
    "SessionLockedError",
    "StaleDecisionError",
    "StoreCapacityError",
    "StoreError",
    "StoreFormatError",
    "ToolDefinitionError",
    "TranscriptError",
    "UnknownRunError",
]


class AimuError(Exception):
    """Root of every error aimu raises on purpose."""


class ModelError(AimuError):
    """A model provider failed; ``host`` is the server it talked to."""

    def __init__(self, message: str, *, host: str) -> None:
        super().__init__(message)
        self.host = host


class ModelConnectionError(ModelError, ConnectionError):
    """The model server could not be reached (refused, unresolvable, timed out)."""


class ModelHTTPError(ModelError):
    """The model server answered with an HTTP error status."""

    def __init__(self, message: str, *, host: str, status_code: int, body: str) -> None:
        super().__init__(message, host=host)
        self.status_code = status_code
        self.body = body


class ModelProtocolError(ModelError):
    """The server's reply was malformed: a bad JSON line, a stream cut short."""


class TranscriptError(AimuError, ValueError):
    """A transcript failed validation; ``index`` is the offending message (or None)."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        super().__init__(message)
        self.index = index


class ToolDefinitionError(AimuError, TypeError):
    """A function cannot be turned into a tool (unsupported type, bad default)."""


class MCPServerError(AimuError, ConnectionError):
    """An MCP server could not be started, reached, or listed its tools badly; ``server``
    is its name (the message says which command or URL, never a header's value)."""

    def __init__(self, message: str, *, server: str) -> None:
        super().__init__(message)
        self.server = server


class StaleDecisionError(AimuError, ValueError):
    """A decision was given for a pause of a tool call that no longer waits (the session
    was replaced, or the call asked again since): it changes nothing. Names the call."""

    def __init__(self, message: str, *, call_id: str) -> None:
        super().__init__(message)
        self.call_id = call_id


class OutputError(AimuError):
    """A run of an agent with ``output_type=`` could not give a value of that type."""


class OutputValidationError(OutputError, ValueError):
    """The model's answer is not a valid ``output_type`` even after the corrections it was
    sent; ``text`` is the last answer (clipped), ``problem`` what was wrong with it."""

    def __init__(self, message: str, *, text: str, problem: str) -> None:
        super().__init__(message)
        self.text = text
        self.problem = problem


class NoOutputError(OutputError):
    """The run ended without an answer to validate: ``status`` says how (``interrupted``,
    ``paused``). The transcript is intact: ``resume()`` gets the output."""

    def __init__(self, message: str, *, status: str) -> None:
        super().__init__(message)
        self.status = status


class StoreError(AimuError):
    """Durable storage failed."""


class SessionLockedError(StoreError):
    """Another writer (this process or another) holds the session open for writing."""


class StoreCapacityError(StoreError):
    """The store has no connection left: its own bound (writers, read pool) or the
    database server's. Try again once sessions close, or raise the limit it names.
    ``ran_out`` names that limit in words safe to show anyone (no host, no database)."""

    def __init__(self, message: str, *, ran_out: str = "connections") -> None:
        super().__init__(message)
        self.ran_out = ran_out


class StoreFormatError(StoreError):
    """A store file is unreadable: corrupt, or written by a newer schema."""


class ControlError(AimuError):
    """Controlling a run across processes failed; ``url`` is the Redis URL, password hidden."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class ControlConnectionError(ControlError, ConnectionError):
    """Redis could not be reached, refused the credentials, or is not a Redis server."""


class UnknownRunError(ControlError, LookupError):
    """No run with that id is registered under the control's prefix."""


class RunLostError(ControlError):
    """The run's worker stopped renewing its lease (it died or lost Redis for too long)."""
