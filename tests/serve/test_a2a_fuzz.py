"""POST /a2a under hostile input: task ids with non-ASCII or endless digits, ids JSON-RPC
forbids, ``NaN``, batches, bodies that are not JSON, and a seeded, bounded fuzz of the
whole JSON-RPC surface (ids, methods, params, batches) against a real Uvicorn.

Every answer is a 2xx carrying strict JSON (no ``NaN``) and a valid JSON-RPC 2.0 response
object (SSE answers: every ``data:`` line). Set ``AIMU_A2A_FUZZ_SEED`` to try another seed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from aimu import aio, serve
from tests.serve.harness import uvicorn_serving

SEED = int(os.environ.get("AIMU_A2A_FUZZ_SEED", "4242"))
EXAMPLES = 100
METHODS = ["SendMessage", "SendStreamingMessage", "GetTask", "ListTasks", "CancelTask",
           "SubscribeToTask", "CreateTaskPushNotificationConfig", "GetExtendedAgentCard"]
CONTEXTS = ["fz-a", "fz-b", "a2a-fz"]
HEADERS = {"Content-Type": "application/json"}


def note(text: str) -> str:
    """Write a note down."""
    return f"noted {text}"


@aio.tool(approval=True)
def wire(amount: int) -> str:
    """Wire money (needs approval)."""
    return f"wired {amount}"


@pytest.fixture(scope="module")
def a2a(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A client of a server on the offline test model, which calls every tool once: each
    task pauses on an approval, so decisions are fuzzed as well as new tasks."""
    store: Path = tmp_path_factory.mktemp("a2a-fuzz") / "sessions.db"
    application = serve.app(aio.client("test"), store=store, tools=[note, wire])
    with uvicorn_serving(application) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


def _no_constant(name: str) -> object:
    raise AssertionError(f"the answer holds {name}, which is not JSON")


def answers_of(response: httpx.Response) -> list[Any]:
    """The JSON-RPC answers in ``response``, parsed as strict JSON."""
    assert response.status_code < 500, response.text[:300]
    assert response.status_code == 200, response.text[:300]
    if response.headers["content-type"].startswith("text/event-stream"):
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines, response.text[:300]
    else:
        lines = [response.text]
    return [json.loads(line, parse_constant=_no_constant) for line in lines]


def valid_id(call_id: object) -> bool:
    return call_id is None or (isinstance(call_id, str | int | float)
                               and not isinstance(call_id, bool)
                               and not (isinstance(call_id, float) and not math.isfinite(call_id)))


def check(answer: Any, sent: Any) -> None:
    """``answer`` is a JSON-RPC 2.0 response object, to ``sent`` where it could be read."""
    assert isinstance(answer, dict), answer
    assert answer.get("jsonrpc") == "2.0", answer
    assert "id" in answer and valid_id(answer["id"]), answer
    assert ("result" in answer) != ("error" in answer), answer
    if "error" in answer:
        error = answer["error"]
        assert isinstance(error, dict) and isinstance(error.get("message"), str), answer
        assert isinstance(error.get("code"), int) and not isinstance(error["code"], bool)
    else:
        assert isinstance(answer["result"], dict), answer
    if isinstance(sent, dict) and sent.get("jsonrpc") == "2.0" and valid_id(sent.get("id")):
        with contextlib.suppress(ValueError):  # NaN somewhere: a parse error, answered to null
            json.dumps(sent, allow_nan=False)
            assert answer["id"] == sent.get("id"), (answer, sent)


def post(a2a: httpx.Client, body: bytes) -> list[Any]:
    return answers_of(a2a.post("/a2a", content=body, headers=HEADERS))


def rpc(a2a: httpx.Client, method: str, params: Any, call_id: Any = 1) -> dict[str, Any]:
    envelope = {"jsonrpc": "2.0", "id": call_id, "method": method, "params": params}
    (answer,) = post(a2a, json.dumps(envelope).encode())
    check(answer, envelope)
    assert isinstance(answer, dict)
    return answer


def send(a2a: httpx.Client, text: str, context: str) -> dict[str, Any]:
    params = {"message": {"messageId": "m", "role": "ROLE_USER", "contextId": context,
                          "parts": [{"text": text}]}}
    answer = rpc(a2a, "SendMessage", params)
    task: dict[str, Any] = answer["result"]["task"]
    return task


OTHER_DIGITS = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")  # Arabic-Indic: str.isdigit() is True


def test_only_ascii_digits_within_range_name_a_task(a2a: httpx.Client) -> None:
    first = send(a2a, "first", "fz-ids")
    decided = rpc(a2a, "SendMessage", {"message": {
        "messageId": "m2", "role": "ROLE_USER", "taskId": first["id"], "parts": [{"text": "no"}],
    }})
    assert decided["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
    second = send(a2a, "second", "fz-ids")
    index = second["id"].rpartition(":")[2]
    assert int(index) > 0
    assert rpc(a2a, "GetTask", {"id": second["id"]})["result"]["id"] == second["id"]
    for task_id in [f"fz-ids:{index.translate(OTHER_DIGITS)}",  # was read as the task
                    "fz-ids:²", "fz-ids:" + "9" * 5000,  # were HTTP 500
                    "fz-ids:" + "0" * 13, "fz-ids:-1", "fz-ids: 1", "fz-ids:1_0", ":0"]:
        for method in ("GetTask", "CancelTask", "SubscribeToTask"):
            answer = rpc(a2a, method, {"id": task_id})
            assert answer["error"]["code"] == -32001, (method, task_id[:20], answer)
            assert len(answer["error"]["message"]) < 200
        answer = rpc(a2a, "SendMessage", {"message": {
            "messageId": "m3", "role": "ROLE_USER", "taskId": task_id, "parts": [{"text": "y"}],
        }})
        assert answer["error"]["code"] == -32001, (task_id[:20], answer)


@pytest.mark.parametrize("body, code", [
    (b'{"jsonrpc": "2.0", "id": NaN, "method": "GetTask", "params": {"id": "x:0"}}', -32700),
    (b'{"jsonrpc": "2.0", "id": Infinity, "method": "GetTask", "params": {}}', -32700),
    (b'{"jsonrpc": "2.0", "id": 1e999, "method": "GetTask", "params": {}}', -32600),
    (b'{"jsonrpc": "2.0", "id": [1], "method": "GetTask", "params": {}}', -32600),
    (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "GetTask", "params": {}}', -32600),
    (b'{"jsonrpc": "2.0", "id": true, "method": "GetTask", "params": {}}', -32600),
    (b'[{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "x:0"}}]', -32600),
    (b"[]", -32600),
    (b"[" * 100_000 + b"]" * 100_000, -32700),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, -32700),
    (b'{"jsonrpc": "2.0", "id": ' + b"7" * 5000 + b', "method": "GetTask"}', -32700),
], ids=["nan", "infinity", "overflow", "list", "object", "bool", "batch", "empty-batch",
        "deep-list", "deep-object", "5000-digit-id"])
def test_ids_json_rpc_forbids_are_refused_as_invalid(a2a: httpx.Client, body: bytes,
                                                     code: int) -> None:
    (answer,) = post(a2a, body)
    check(answer, None)
    assert answer["id"] is None and answer["error"]["code"] == code, answer


# -- the fuzz -------------------------------------------------------------------------------

junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=6,
)
digits = st.text(alphabet="0123456789²³٣١߀۵𝟘-+ _", max_size=6) | st.sampled_from(
    ["0", "1", "2", "3", "9" * 5000, "0" * 30, str(2**64)])
task_ids = st.builds(lambda context, place: f"{context}:{place}",
                     st.sampled_from([*CONTEXTS, "", "../x", "a:b"]) | st.text(max_size=6),
                     digits) | st.text(max_size=10) | junk
words = st.sampled_from(["approve", "deny", "yes", "no", "hello", "  ", "", "wire 5"]) | (
    st.text(max_size=12))
parts = st.lists(
    st.fixed_dictionaries({"text": words}) | st.fixed_dictionaries({"data": st.one_of(
        st.fixed_dictionaries({"approved": st.booleans() | junk}, optional={"reason": junk}),
        st.fixed_dictionaries({"decisions": st.dictionaries(st.text(max_size=8),
                                                            st.booleans() | junk,
                                                            max_size=2) | junk}),
        junk,
    )}) | junk,
    max_size=3,
) | junk
messages = st.fixed_dictionaries({}, optional={
    "messageId": st.text(max_size=6) | junk,
    "role": st.sampled_from(["ROLE_USER", "user", "ROLE_AGENT"]) | junk,
    "parts": parts,
    "contextId": st.sampled_from(CONTEXTS) | st.text(max_size=8) | junk,
    "taskId": task_ids,
}) | junk
params = st.one_of(
    st.fixed_dictionaries({"message": messages}, optional={
        "configuration": st.fixed_dictionaries({}, optional={"returnImmediately":
                                                             st.booleans() | junk}) | junk}),
    st.fixed_dictionaries({"id": task_ids}, optional={"historyLength": st.integers() | junk}),
    st.fixed_dictionaries({"contextId": st.sampled_from(CONTEXTS) | junk},
                          optional={"historyLength": st.integers() | junk}),
    junk,
)
call_ids = st.none() | st.integers() | st.floats() | st.text(max_size=6) | junk
envelopes = st.fixed_dictionaries({"jsonrpc": st.just("2.0") | junk}, optional={
    "id": call_ids,
    "method": st.sampled_from(METHODS) | st.text(max_size=12) | junk,
    "params": params,
})
# Well-formed requests, most of them on the contexts' real tasks: these reach the methods.
places = st.sampled_from([str(i) for i in range(8)])
contexts = st.sampled_from(CONTEXTS) | st.sampled_from("abcdefgh").map(lambda c: f"fz-{c}")
real_task_ids = st.builds(lambda context, place: f"{context}:{place}", contexts,
                          places | places | digits)
answers = st.sampled_from(["approve", "deny", "hello", "yes", "no.", "go on"])
decisions = st.one_of(
    st.fixed_dictionaries({"approved": st.booleans()}),
    st.fixed_dictionaries({"decisions": st.dictionaries(st.text(max_size=8), st.booleans(),
                                                        max_size=2)}),
)
good_parts = st.lists(
    st.fixed_dictionaries({"text": answers | answers | words})
    | st.fixed_dictionaries({"data": decisions}),
    min_size=1, max_size=2,
)
good_messages = st.fixed_dictionaries(
    {"messageId": st.text(max_size=6), "role": st.just("ROLE_USER"), "parts": good_parts},
    optional={"contextId": contexts, "taskId": real_task_ids},
)
send_params = st.fixed_dictionaries({"message": good_messages}, optional={
    "configuration": st.fixed_dictionaries({"returnImmediately": st.booleans()})})
task_params = st.fixed_dictionaries({"id": real_task_ids},
                                    optional={"historyLength": st.integers(-1, 3)})
list_params = st.fixed_dictionaries({"contextId": contexts},
                                    optional={"historyLength": st.integers(-1, 3)})
good_ids = st.none() | st.integers(-(2**53), 2**53) | st.text(max_size=6)


def requests(methods: st.SearchStrategy[str],
             params: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"jsonrpc": st.just("2.0"), "id": good_ids,
                                  "method": methods, "params": params})


well_formed = st.one_of(
    requests(st.sampled_from(["SendMessage", "SendStreamingMessage"]), send_params),
    requests(st.sampled_from(["GetTask", "CancelTask", "SubscribeToTask"]), task_params),
    requests(st.just("ListTasks"), list_params),
    requests(st.sampled_from(METHODS), send_params | task_params | list_params),
)
bodies = st.one_of(
    well_formed.map(lambda e: (e, json.dumps(e).encode())),
    well_formed.map(lambda e: (e, json.dumps(e).encode())),  # as often as all the rest
    envelopes.map(lambda e: (e, json.dumps(e).encode())),
    st.lists(envelopes | well_formed, max_size=3).map(
        lambda batch: (batch, json.dumps(batch).encode())),
    st.binary(max_size=40).map(lambda raw: (None, raw)),
    st.text(alphabet=string.printable, max_size=40).map(lambda raw: (None, raw.encode())),
)

@seed(SEED)
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(bodies)
def test_the_json_rpc_surface_answers_everything_in_json_rpc(
    a2a: httpx.Client, body: tuple[Any, bytes]
) -> None:
    sent, raw = body
    for answer in post(a2a, raw):
        check(answer, sent)
