"""The OpenAPI 3.1 document of the runs API, served at ``/openapi.json``.

Written out by hand, not derived: it is the contract the server is tested against
(``tests/serve/test_openapi.py`` runs schemathesis on it), so every status a route can
answer is listed with its body.
"""

from __future__ import annotations

import functools
from typing import Any, get_args

from aimu import __version__
from aimu.aio._ids import EVENT_NUMBER_PATTERN, RUN_ID_PATTERN, STREAM_ID_PATTERN
from aimu.aio.events import HandleStatus

__all__ = ["openapi_document"]

_JSON = "application/json"
_RUN_ID = {"type": "string", "pattern": RUN_ID_PATTERN}
_SESSION = {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,128}$", "not": {"enum": [".", ".."]}}
#: A run's status: its handle's, or ``lost`` (its server died; with --redis).
_STATUS = {"type": "string", "enum": [*get_args(HandleStatus), "lost"]}
_NULLABLE_STR = {"type": ["string", "null"]}
#: A local server numbers events 1, 2, ...; servers sharing Redis use its stream ids.
_EVENT_ID = {
    "anyOf": [
        {"type": "string", "maxLength": 0},
        {"type": "string", "pattern": EVENT_NUMBER_PATTERN},
        {"type": "string", "pattern": STREAM_ID_PATTERN},
    ]
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {_JSON: {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    what = {
        400: "Malformed request: bad JSON, a bad session name, event id or grace, or a "
        "host name this server does not answer to",
        401: "Missing or wrong bearer token (when the server has one)",
        403: "A cross-site request: another origin may not change state here",
        404: "No such run or session",
        409: "The session or run is in a state that does not allow this",
        413: "The request body is over the server's limit",
        415: "The request body is not declared application/json",
        422: "The JSON body has missing, unknown or mistyped fields",
        501: "Not supported by this server",
        503: "Redis, shared by the servers, cannot be reached",
    }
    return {str(s): _json(_ref("Error"), what[s]) for s in sorted({400, 401, *statuses, 503})}


def _body(schema: dict[str, Any], *, required: bool) -> dict[str, Any]:
    return {"required": required, "content": {_JSON: {"schema": schema}}}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


#: The tool calls a paused run waits on (empty unless paused).
_PENDING = {
    "type": "array",
    "items": _object(
        {
            "call_id": {"type": "string"},
            "name": {"type": "string"},
            "arguments": {"type": "object"},
            "in_doubt": {"type": "boolean"},
        },
        ("call_id", "name", "arguments", "in_doubt"),
    ),
}
_SESSION_PARAM = {"name": "session", "in": "path", "required": True, "schema": _SESSION}
_RUN_PARAM = {"name": "run_id", "in": "path", "required": True, "schema": _RUN_ID}
_EMPTY = _body(_object({}), required=False)


def _control(summary: str, body: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "parameters": [_RUN_PARAM, *extra.pop("parameters", [])],
        "requestBody": body or _EMPTY,
        "responses": {
            "202": _json(_ref("Run"), "Accepted: the run's state as the request found it"),
            **_errors(400, 403, 404, 409, 413, 415, 422, *extra.pop("errors", ())),
        },
    }
    operation.update(extra)
    return operation


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document (one shared dict: do not modify it)."""
    started = _json(_ref("Started"), "Accepted: the run started; follow /runs/{run_id}/events")
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "aimu runs API",
            "version": __version__,
            "description": (
                "Start, follow, stop, steer and resume agent runs. Every route but /health "
                "needs 'Authorization: Bearer <token>' when the server has a token."
            ),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Error": _object(
                    {"error": {"type": "string"}, "status": {"type": "integer"}},
                    ("error", "status"),
                ),
                "Started": _object(
                    {"run_id": _RUN_ID, "session": _SESSION, "status": _STATUS},
                    ("run_id", "session", "status"),
                ),
                "Run": _object(
                    {
                        "run_id": _RUN_ID,
                        "session": _SESSION,
                        "task": _NULLABLE_STR,
                        "status": _STATUS,
                        "reason": _NULLABLE_STR,
                        "reply": _NULLABLE_STR,
                        "error": _NULLABLE_STR,
                        "usage": {"anyOf": [{"type": "null"}, _object(
                            {
                                "input_tokens": {"type": "integer"},
                                "output_tokens": {"type": "integer"},
                            },
                            ("input_tokens", "output_tokens"),
                        )]},
                        "created_at": {"type": "number"},
                        "finished_at": {"type": ["number", "null"]},
                        "duration": {"type": ["number", "null"]},
                        "events": {"type": ["integer", "null"], "minimum": 0},
                        "pending": _PENDING,
                    },
                    (
                        "run_id", "session", "task", "status", "reason", "reply", "error",
                        "usage", "created_at", "finished_at", "duration", "events", "pending",
                    ),
                ),
                "Decision": _object(
                    {
                        "run_id": _RUN_ID,
                        "call_id": {"type": "string"},
                        "approve": {"type": "boolean"},
                        "pending": _PENDING,
                        "resumed_run_id": {"anyOf": [{"type": "null"}, _RUN_ID]},
                    },
                    ("run_id", "call_id", "approve", "pending", "resumed_run_id"),
                ),
                "SessionInfo": _object(
                    {
                        "name": _SESSION,
                        "created": {"type": "number"},
                        "updated": {"type": "number"},
                        "message_count": {"type": "integer", "minimum": 0},
                        "status": _NULLABLE_STR,
                        "run_id": {"type": ["string", "null"]},
                    },
                    ("name", "created", "updated", "message_count", "status", "run_id"),
                ),
                "Session": _object(
                    {
                        "name": _SESSION,
                        "status": _NULLABLE_STR,
                        "run_id": {"type": ["string", "null"]},
                        "run_messages_from": {"type": ["integer", "null"], "minimum": 0},
                        "paused_run_id": {"anyOf": [{"type": "null"}, _RUN_ID]},
                        "pending": _PENDING,
                        "messages": {
                            "type": "array",
                            "items": {"type": "object", "required": ["role"]},
                        },
                    },
                    (
                        "name", "status", "run_id", "run_messages_from", "paused_run_id",
                        "pending", "messages",
                    ),
                ),
            },
        },
        "security": [{"bearer": []}],
        "paths": {
            "/health": {
                "get": {
                    "summary": "Health check (no token needed)",
                    "security": [],
                    "responses": {
                        "200": _json(
                            _object({"status": {"const": "ok"}}, ("status",)), "The server is up"
                        ),
                        "400": _json(_ref("Error"), "A host name this server does not answer to"),
                    },
                }
            },
            "/sessions": {
                "get": {
                    "summary": "Every stored session",
                    "responses": {
                        "200": _json(
                            _object(
                                {"sessions": {"type": "array", "items": _ref("SessionInfo")}},
                                ("sessions",),
                            ),
                            "The sessions, by name",
                        ),
                        **_errors(),
                    },
                }
            },
            "/sessions/{session}": {
                "parameters": [_SESSION_PARAM],
                "get": {
                    "summary": "A session's transcript",
                    "responses": {
                        "200": _json(_ref("Session"), "The stored transcript"),
                        **_errors(400, 404),
                    },
                },
                "delete": {
                    "summary": "Delete a session",
                    "responses": {
                        "204": {"description": "Deleted"},
                        **_errors(403, 404, 409, 415),
                    },
                },
            },
            "/sessions/{session}/runs": {
                "parameters": [_SESSION_PARAM],
                "post": {
                    "summary": "Start a run on the session (409 if one is in progress)",
                    "requestBody": _body(
                        _object({"task": {"type": "string", "minLength": 1}}, ("task",)),
                        required=True,
                    ),
                    "responses": {"202": started, **_errors(403, 409, 413, 415, 422)},
                },
            },
            "/sessions/{session}/resume": {
                "parameters": [_SESSION_PARAM],
                "post": {
                    "summary": "Continue the session exactly where its last run stopped",
                    "requestBody": _EMPTY,
                    "responses": {"202": started, **_errors(403, 409, 413, 415, 422)},
                },
            },
            "/runs/{run_id}": {
                "get": {
                    "summary": "A run's status, reply, usage and timing",
                    "parameters": [_RUN_PARAM],
                    "responses": {"200": _json(_ref("Run"), "The run"), **_errors(404)},
                }
            },
            "/runs/{run_id}/events": {
                "get": {
                    "summary": "The run's events as Server-Sent Events, the terminal one last",
                    "description": (
                        "Each event has an id; reconnect with Last-Event-ID (or ?after=) to "
                        "continue after it, missing nothing and repeating nothing. The last "
                        "event is handle_finished."
                    ),
                    "parameters": [
                        _RUN_PARAM,
                        {
                            "name": "Last-Event-ID",
                            "in": "header",
                            "required": False,
                            "schema": _EVENT_ID,
                        },
                        {
                            "name": "after",
                            "in": "query",
                            "required": False,
                            "schema": _EVENT_ID,
                        },
                    ],
                    "responses": {
                        "200": {
                            "description": "An event stream",
                            "content": {"text/event-stream": {"schema": {"type": "string"}}},
                        },
                        **_errors(400, 404),
                    },
                }
            },
            "/runs/{run_id}/cancel": {
                "post": _control(
                    "Cancel the run now (its partial reply is kept)",
                    _body(_object({"reason": _NULLABLE_STR}), required=False),
                )
            },
            "/runs/{run_id}/interrupt": {
                "post": _control("Stop the run at its next step boundary")
            },
            "/runs/{run_id}/stop": {
                "post": _control(
                    "Interrupt, then cancel if still running after grace seconds",
                    parameters=[
                        {
                            "name": "grace",
                            "in": "query",
                            "required": False,
                            "schema": {"type": "number", "minimum": 0, "maximum": 3600},
                        }
                    ],
                )
            },
            "/runs/{run_id}/send": {
                "post": _control(
                    "Add a user message to the running run at its next step boundary "
                    "(409 once it has ended)",
                    _body(
                        _object({"text": {"type": "string", "minLength": 1}}, ("text",)),
                        required=True,
                    ),
                )
            },
            "/runs/{run_id}/approvals/{call_id}": {
                "post": _control(
                    "Approve or deny a tool call the paused run waits on; the last decision "
                    "resumes it (404: the run waits on no such call; 409: not paused, or "
                    "decided already)",
                    _body(
                        _object(
                            {"approve": {"type": "boolean"}, "reason": _NULLABLE_STR},
                            ("approve",),
                        ),
                        required=True,
                    ),
                    parameters=[
                        {
                            "name": "call_id",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 200},
                        }
                    ],
                    responses={
                        "202": _json(
                            _ref("Decision"),
                            "Decided; after the last decision the run resumed as "
                            "resumed_run_id",
                        ),
                        **_errors(403, 404, 409, 413, 415, 422),
                    },
                )
            },
        },
    }
