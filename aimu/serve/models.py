"""The shapes on the wire of the runs API: request bodies and answers, as pydantic models.

FastAPI validates each request body against its model and writes the OpenAPI document
from these, so the contract and the checks cannot drift. Bodies are strict (no ``"yes"``
for ``true``, no ``3`` for a string) and refuse unknown fields; text refuses lone
surrogates, which no store can write.

A model whose Python name would repeat a name of :mod:`aimu.aio` (``RunRecordSchema``)
keeps its wire name as its title; :func:`name_schemas_by_title` names the document's
schemas by title, so the API's schema names stay as they were.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from aimu.aio._ids import RUN_ID_PATTERN
from aimu.aio.status import ControlStatus, RunRecordStatus, words

__all__ = [
    "MAX_CANCEL_MANY",
    "CancelBody",
    "CancelManyBody",
    "CancelledMany",
    "DecisionBody",
    "DecisionSchema",
    "EmptyBody",
    "Error",
    "Health",
    "Refused",
    "Run",
    "RunRecordList",
    "RunRecordSchema",
    "SendBody",
    "SessionInfoSchema",
    "SessionList",
    "SessionSchema",
    "StartBody",
    "Started",
    "name_schemas_by_title",
]

#: A run's status: its handle's, or ``lost`` (its server died; with --redis).
STATUSES = words(ControlStatus)
#: A run record's status: ``running``, or how the run ended.
RECORD_STATUSES = words(RunRecordStatus)
RunId = Annotated[str, Field(pattern=RUN_ID_PATTERN)]


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"holds a lone surrogate at character {error.start}: send valid Unicode"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class EmptyBody(_Body):
    """No fields: the body may be empty or ``{}``."""


class StartBody(_Body):
    task: Annotated[Text, Field(min_length=1, description="What the run should do")]


class CancelBody(_Body):
    reason: Text | None = Field(None, description="Why; shown as the run's reason")


#: The most runs one ``POST /runs/cancel`` names.
MAX_CANCEL_MANY = 1000


def _each_once(run_ids: list[str]) -> list[str]:
    seen: set[str] = set()
    for run_id in run_ids:
        if run_id in seen:
            raise ValueError(f"names run {run_id} twice: name each run once")
        seen.add(run_id)
    return run_ids


class CancelManyBody(_Body):
    run_ids: Annotated[
        list[RunId],
        Field(min_length=1, max_length=MAX_CANCEL_MANY,
              description=f"The runs to cancel, each once (at most {MAX_CANCEL_MANY})"),
        AfterValidator(_each_once),
    ]
    reason: Text | None = Field(None, description="Why; shown as each run's reason")


class SendBody(_Body):
    text: Annotated[Text, Field(min_length=1, description="A user message for the run")]
    images: list[str] = Field(
        default_factory=list,
        description="Images beside the text, each a data:image/...;base64,... URL (PNG, "
        "JPEG, GIF or WebP); the request's body limit bounds their size",
    )


class DecisionBody(_Body):
    approve: bool
    reason: Text | None = Field(None, description="Why (told to the model on a denial)")
    pause_id: Annotated[str, Field(min_length=1, max_length=64)] | None = Field(
        None,
        description="The pause_id of the waiting call the person was shown: the decision "
        "holds only while that pause waits (409 otherwise, and nothing runs)",
    )
    result: Annotated[str, Field(max_length=1_000_000)] | None = Field(
        None,
        description="The result of a call of an external (client-side) tool, which the "
        "server cannot run: the model reads it as the tool's result (approve: true)",
    )


class Error(BaseModel):
    """Every error: a message saying what to do, and the HTTP status again."""

    error: str
    status: int


class Health(BaseModel):
    status: str = Field(json_schema_extra={"const": "ok"})


class Started(BaseModel):
    run_id: RunId
    session: str
    status: str = Field(json_schema_extra={"enum": list(STATUSES)})


class UsageSchema(BaseModel):
    model_config = ConfigDict(title="Usage")

    input_tokens: int
    output_tokens: int


class Pending(BaseModel):
    """A tool call a paused run waits on."""

    call_id: str
    name: str
    arguments: dict[str, Any]
    in_doubt: bool
    pause_id: str = Field(description="This pause of the call; send it with the decision")
    path: list[str] | None = Field(
        None,
        description="For a call an agent called as a tool waits on: the ids of the calls "
        "that lead from the run's agent down to it (decide it here, by its call_id)",
    )
    external: bool = Field(
        False, description="A call of an external (client-side) tool: it waits for its "
        "result (send it as the decision's result), not for a yes or no",
    )


class Run(BaseModel):
    """The live view of a run (``serve.runs.RunView``, whatever backend holds it), its
    status one of :data:`aimu.aio.status.ControlStatus`. The durable shape is
    :class:`RunRecord`; the result, the terminal event in its events."""

    run_id: RunId
    session: str
    task: str | None
    status: str = Field(json_schema_extra={"enum": list(STATUSES)})
    reason: str | None
    reply: str | None
    error: str | None
    usage: UsageSchema | None
    created_at: float
    finished_at: float | None
    duration: float | None
    events: int | None = Field(ge=0)
    pending: list[Pending]


class Refused(BaseModel):
    """A run a bulk request did not reach: the error a request for it alone answers."""

    run_id: RunId
    error: str
    status: int


class CancelledMany(BaseModel):
    """What ``POST /runs/cancel`` did: the runs it was accepted for, each as the request
    found it (its partial reply kept), and those it refused, with why."""

    runs: list[Run]
    refused: list[Refused]


class DecisionSchema(BaseModel):
    model_config = ConfigDict(title="Decision")

    run_id: RunId
    call_id: str
    approve: bool
    pending: list[Pending]
    resumed_run_id: RunId | None


class SessionInfoSchema(BaseModel):
    model_config = ConfigDict(title="SessionInfo")

    name: str
    created: float
    updated: float
    message_count: int = Field(ge=0)
    status: str | None
    run_id: str | None


class SessionList(BaseModel):
    sessions: list[SessionInfoSchema]


class RunRecordSchema(BaseModel):
    """A run as its store keeps it (``aimu.aio.store.RunRecord``): ``running`` from its
    start until it ends; a run whose process died stays ``running``."""

    model_config = ConfigDict(title="RunRecord")

    id: str
    session: str
    agent: str
    parent: str | None
    started: float
    ended: float | None
    status: str = Field(json_schema_extra={"enum": list(RECORD_STATUSES)})
    reason: str | None
    stop_reason: str | None
    usage: dict[str, int] | None
    spend: dict[str, Any] | None
    limit: str | None
    models: list[str]
    recover: bool
    messages_from: int | None = Field(
        default=None, ge=0, description="Where the run's messages begin in its session's "
        "transcript; null in records of an older aimu"
    )


class RunRecordList(BaseModel):
    runs: list[RunRecordSchema]
    next_before: str | None = Field(
        description="Pass as before= for the next page; null on the last page"
    )


class SessionSchema(BaseModel):
    model_config = ConfigDict(title="Session")

    name: str
    status: str | None
    run_id: str | None
    run_messages_from: int | None = Field(ge=0)
    paused_run_id: RunId | None
    pending: list[Pending]
    messages: list[dict[str, Any]]


def name_schemas_by_title(document: dict[str, Any]) -> None:
    """Key each schema of the OpenAPI ``document`` by its title (FastAPI keys it by its
    class name), its references with it; the order stays alphabetical, as FastAPI's."""
    schemas: dict[str, Any] = document.get("components", {}).get("schemas", {})
    names = {name: schema.get("title", name) for name, schema in schemas.items()}
    if all(name == title for name, title in names.items()):
        return
    document["components"]["schemas"] = {
        names[name]: schemas[name] for name in sorted(schemas, key=names.__getitem__)
    }
    refs = {f"#/components/schemas/{name}": f"#/components/schemas/{title}"
            for name, title in names.items()}
    _rename_refs(document, refs)


def _rename_refs(node: object, refs: dict[str, str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in refs:
            node["$ref"] = refs[ref]
        for value in node.values():
            _rename_refs(value, refs)
    elif isinstance(node, list):
        for value in node:
            _rename_refs(value, refs)
