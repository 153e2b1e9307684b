"""A2A 1.0 (JSON-RPC) at POST /a2a, driven by the ``a2a-sdk`` client, and every answer on the
wire parsed strictly into the SDK's own protobuf types (no unknown field, no bad enum).

Stops land at provable points: an artifact chunk seen, a gated tool entered, the model
server's record of an abandoned stream, a process killed after its first chunk.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aimu.aio.transcript import validate
from tests.serve.harness import GATE, MAILED, Served
from tests.serve.protocols import restarted_after_a_kill

a2a_pb2 = pytest.importorskip("a2a.types.a2a_pb2")
json_format = pytest.importorskip("google.protobuf.json_format")
client_module = pytest.importorskip("a2a.client")


def strict(data: dict[str, Any], message: Any) -> Any:
    """``data`` parsed into the protobuf ``message`` rejecting any unknown field or value."""
    return json_format.ParseDict(data, message)


def user(text: str, context: str | None = None, task: str | None = None) -> Any:
    message = a2a_pb2.Message(message_id=f"m-{os.urandom(4).hex()}", role=a2a_pb2.ROLE_USER,
                              parts=[a2a_pb2.Part(text=text)])
    if context:
        message.context_id = context
    if task:
        message.task_id = task
    return a2a_pb2.SendMessageRequest(message=message)


@contextlib.asynccontextmanager
async def sdk_client(url: str, *, streaming: bool = True) -> AsyncIterator[Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        config = client_module.ClientConfig(streaming=streaming, httpx_client=http)
        client = await client_module.create_client(url, client_config=config)
        try:
            yield client
        finally:
            await client.close()


async def rpc(http: httpx.AsyncClient, method: str, params: dict[str, Any]) -> dict[str, Any]:
    response = await http.post("/a2a", json={"jsonrpc": "2.0", "id": 7, "method": method,
                                             "params": params})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    assert body["id"] == 7
    return body


async def rpc_stream(
    http: httpx.AsyncClient, method: str, params: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The results of a streamed JSON-RPC call, each parsed strictly as a StreamResponse."""
    body = {"jsonrpc": "2.0", "id": "s1", "method": method, "params": params}
    async with http.stream("POST", "/a2a", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                answer = json.loads(line[6:])
                assert answer["id"] == "s1", answer
                strict(answer["result"], a2a_pb2.StreamResponse())
                yield answer["result"]


def message_params(text: str, **fields: str) -> dict[str, Any]:
    return {"message": {"messageId": os.urandom(4).hex(), "role": "ROLE_USER",
                        "parts": [{"text": text}], **fields}}


async def test_the_agent_card_is_what_the_sdk_reads(http: httpx.AsyncClient,
                                                     served: Served) -> None:
    response = await http.get("/.well-known/agent-card.json")
    assert response.status_code == 200
    card = strict(response.json(), a2a_pb2.AgentCard())
    assert card.capabilities.streaming and not card.capabilities.push_notifications
    (interface,) = card.supported_interfaces
    assert interface.url == f"{served.url}/a2a" and interface.protocol_binding == "JSONRPC"


async def test_send_message_answers_with_the_completed_task(served: Served,
                                                            http: httpx.AsyncClient) -> None:
    async with sdk_client(served.url, streaming=False) as client:
        (response,) = [r async for r in client.send_message(user("hello", "a2a-hello"))]
    task = response.task
    assert task.status.state == a2a_pb2.TASK_STATE_COMPLETED
    assert task.context_id == "a2a-hello" and task.id == "a2a-hello:0"
    assert task.artifacts[0].parts[0].text == "answer to hello"
    got = await rpc(http, "GetTask", {"id": task.id, "historyLength": 5})
    strict(got["result"], a2a_pb2.Task())
    assert [m["role"] for m in got["result"]["history"]] == ["ROLE_USER", "ROLE_AGENT"]

    # A second task in the same context; the first keeps its answer.
    async with sdk_client(served.url, streaming=False) as client:
        (second,) = [r async for r in client.send_message(user("again", "a2a-hello"))]
    assert second.task.id == "a2a-hello:2"
    listed = await rpc(http, "ListTasks", {"contextId": "a2a-hello"})
    assert [t["id"] for t in listed["result"]["tasks"]] == ["a2a-hello:0", "a2a-hello:2"]
    assert {t["status"]["state"] for t in listed["result"]["tasks"]} == {"TASK_STATE_COMPLETED"}


async def test_a_streamed_task_with_tools(http: httpx.AsyncClient) -> None:
    results = [r async for r in rpc_stream(http, "SendStreamingMessage",
                                           message_params("tool please", contextId="a2a-tool"))]
    assert results[0]["task"]["status"]["state"] == "TASK_STATE_WORKING"
    updates = [r["statusUpdate"]["status"] for r in results if "statusUpdate" in r]
    data = [p["data"] for s in updates[:-1] for p in s["message"]["parts"]]
    assert data[0]["toolCall"]["name"] == "lookup"
    assert data[1]["toolResult"]["content"] == "found tool please"
    assert updates[-1]["state"] == "TASK_STATE_COMPLETED"
    text = "".join(r["artifactUpdate"]["artifact"]["parts"][0]["text"]
                   for r in results if "artifactUpdate" in r)
    assert text.endswith("answer to tool please")


async def test_cancel_task_stops_the_run_and_keeps_the_partial_answer(
    served: Served, http: httpx.AsyncClient
) -> None:
    abandoned = len([s for s in served.model.streams if s.abandoned])
    async with sdk_client(served.url) as client, sdk_client(served.url) as other:
        seen = []
        async for response in client.send_message(user("long tale", "a2a-cancel")):
            seen.append(response)
            if response.HasField("artifact_update") and len(seen) == 2:
                canceled = await other.cancel_task(a2a_pb2.CancelTaskRequest(id="a2a-cancel:0"))
                assert canceled.status.state == a2a_pb2.TASK_STATE_CANCELED
                assert canceled.artifacts[0].parts[0].text.startswith(
                    response.artifact_update.artifact.parts[0].text)
    assert seen[-1].status_update.status.state == a2a_pb2.TASK_STATE_CANCELED
    await served.model.wait_abandoned(abandoned + 1)
    stored = (await http.get("/sessions/a2a-cancel")).json()["messages"]
    validate(stored)
    assert stored[-1]["aimu_partial"] is True

    # A canceled task cannot be canceled again, nor continued.
    async with sdk_client(served.url) as client:
        with pytest.raises(Exception) as again:
            await client.cancel_task(a2a_pb2.CancelTaskRequest(id="a2a-cancel:0"))
        assert type(again.value).__name__ == "TaskNotCancelableError"
    answer = await rpc(http, "SendMessage", message_params("go on", taskId="a2a-cancel:0"))
    assert answer["error"]["code"] == -32004


async def test_cancel_mid_tool_settles_the_call(served: Served, http: httpx.AsyncClient) -> None:
    GATE.reset()
    stream = rpc_stream(http, "SendStreamingMessage",
                        message_params("gate 1 3", contextId="a2a-midtool"))
    async with contextlib.aclosing(stream):
        async for result in stream:
            status = result.get("statusUpdate", {}).get("status", {})
            if any("toolCall" in p.get("data", {}) for p in status.get("message", {}).get(
                    "parts", [])):
                await GATE.entered(1)
                cancel = await rpc(http, "CancelTask", {"id": "a2a-midtool:0"})
                assert cancel["result"]["status"]["state"] == "TASK_STATE_CANCELED"
        GATE.open()
    stored = (await http.get("/sessions/a2a-midtool")).json()["messages"]
    validate(stored)
    assert stored[-1]["role"] == "tool" and "cancelled" in stored[-1]["content"]


async def test_an_approval_is_input_required_and_a_reply_decides_it(served: Served) -> None:
    MAILED.clear()
    async with sdk_client(served.url, streaming=False) as client:
        (paused,) = [r async for r in client.send_message(user("mail bob", "a2a-mail"))]
        task = paused.task
        assert task.status.state == a2a_pb2.TASK_STATE_INPUT_REQUIRED
        pending = json_format.MessageToDict(task.status.message)["parts"][1]["data"]["pending"]
        assert [p["name"] for p in pending] == ["send_email"] and MAILED == []
        (done,) = [r async for r in client.send_message(user("approve", task=task.id))]
    assert done.task.id == task.id
    assert done.task.status.state == a2a_pb2.TASK_STATE_COMPLETED
    assert done.task.artifacts[0].parts[0].text == "mail result: sent to mail bob"
    assert MAILED == ["mail bob"]


async def test_a_dropped_stream_detaches_and_subscribe_picks_the_task_up(
    served: Served, http: httpx.AsyncClient
) -> None:
    GATE.reset()
    stream = rpc_stream(http, "SendStreamingMessage",
                        message_params("gate 1 3", contextId="a2a-drop"))
    async with contextlib.aclosing(stream):
        first = await anext(stream)
    assert first["task"]["id"] == "a2a-drop:0"
    await GATE.entered(1)  # the run goes on without its client
    async with sdk_client(served.url) as client:
        seen = []
        async for response in client.subscribe(a2a_pb2.SubscribeToTaskRequest(id="a2a-drop:0")):
            seen.append(response)
            if len(seen) == 1:
                GATE.open()
    assert seen[0].task.id == "a2a-drop:0"
    assert seen[-1].status_update.status.state == a2a_pb2.TASK_STATE_COMPLETED
    text = "".join(r.artifact_update.artifact.parts[0].text for r in seen
                   if r.HasField("artifact_update"))
    assert text.endswith("w0 w1 w2")
    ended = await rpc(http, "SubscribeToTask", {"id": "a2a-drop:0"})
    assert ended["error"]["code"] == -32004  # completed: nothing to follow


async def test_bad_input_is_answered_per_protocol_and_changes_nothing(
    served: Served, http: httpx.AsyncClient
) -> None:
    garbage = await http.post("/a2a", content=b"{nope", headers={"Content-Type":
                                                                  "application/json"})
    assert garbage.json()["error"]["code"] == -32700
    for method, params, code in [
        ("Frobnicate", {}, -32601),
        ("SendMessage", {}, -32602),
        ("SendMessage", message_params("  ", contextId="a2a-bad"), -32602),
        ("SendMessage", message_params("hi", contextId="../x"), -32602),
        ("SendMessage", {"message": {"messageId": "m", "role": "ROLE_AGENT",
                                     "parts": [{"text": "hi"}]}}, -32602),
        ("GetTask", {"id": "a2a-bad:0"}, -32001),
        ("GetTask", {"id": "nonsense"}, -32001),
        ("CancelTask", {"id": "a2a-bad:3"}, -32001),
        ("CreateTaskPushNotificationConfig", {}, -32003),
    ]:
        answer = await rpc(http, method, params)
        assert answer["error"]["code"] == code, (method, params, answer)
    assert (await http.get("/sessions/a2a-bad")).status_code == 404

    async with sdk_client(served.url) as client:
        with pytest.raises(Exception) as missing:
            await client.get_task(a2a_pb2.GetTaskRequest(id="a2a-bad:0"))
        assert type(missing.value).__name__ == "TaskNotFoundError"

    # A second task on a context whose task is running is refused; the first goes on.
    GATE.reset()
    stream = rpc_stream(http, "SendStreamingMessage",
                        message_params("gate 1 2", contextId="a2a-busy"))
    async with contextlib.aclosing(stream):
        await anext(stream)
        await GATE.entered(1)
        busy = await rpc(http, "SendMessage", message_params("meanwhile", contextId="a2a-busy"))
        assert busy["error"]["code"] == -32602 and "in progress" in busy["error"]["message"]
        GATE.open()
        rest = [r async for r in stream]
    assert rest[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"

    foreign = await http.post("/a2a", json={"jsonrpc": "2.0", "id": 1, "method": "GetTask",
                                            "params": {"id": "x:0"}},
                              headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403


@pytest.mark.slow
async def test_a_task_outlives_a_killed_server_and_resumes(served: Served,
                                                          tmp_path: Path) -> None:
    def stream(http: httpx.AsyncClient) -> AsyncIterator[dict[str, Any]]:
        return rpc_stream(http, "SendStreamingMessage",
                          message_params("short 300", contextId="a2a-kill"))

    async with restarted_after_a_kill(
        served, tmp_path, stream, lambda result: "artifactUpdate" in result
    ) as http:
        got = await rpc(http, "GetTask", {"id": "a2a-kill:0"})
        assert got["result"]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        resumed = await rpc(http, "SendMessage", message_params("go on", taskId="a2a-kill:0"))
        assert "result" in resumed, resumed
        task = resumed["result"]["task"]
        assert task["id"] == "a2a-kill:0"
        assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        assert task["artifacts"][0]["parts"][0]["text"].endswith("c299")
        stored = (await http.get("/sessions/a2a-kill")).json()["messages"]
    validate(stored)
    assert [m["role"] for m in stored].count("user") == 1
