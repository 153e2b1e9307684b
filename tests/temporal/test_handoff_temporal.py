"""A run whose agent hands the conversation over, on Temporal (a real dev server): the turn
knows its run's end by the run's own agent, whoever answered, so the run completes with
the target's answer, and its record names the session's agent and every model that wrote."""

from __future__ import annotations

from aimu import aio
from aimu.aio.store import SQLiteStore
from aimu.temporal import AgentWorker, RunsClient
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel


async def test_a_run_that_hands_off_completes_on_a_worker(
    runs: RunsClient, temporal: str, queue: str, store: SQLiteStore
) -> None:
    def agents(session: str) -> aio.Agent:
        billing = aio.Agent(ScriptedModel([Turn(text="billing here")], model="billing-m"),
                            name="billing")
        triage = ScriptedModel(
            [Turn(tool_calls=[ScriptedCall("transfer_to_billing", {}, id="t1")])],
            model="triage-m",
        )
        return aio.Agent(triage, name="agent", handoffs=[billing], store=store,
                         session=session)

    worker = AgentWorker(agents, store, temporal=temporal, task_queue=queue, heartbeat=0.1)
    await worker.start()
    try:
        run_id = await runs.start("h", "my invoice")
        state = await runs.wait(run_id, timeout=60)
        assert (state["status"], state.get("reply")) == ("completed", "billing here"), state
        [record] = await store.runs(session="h")
        assert (record.agent, record.status, record.models) == (
            "agent", "completed", ("scripted:triage-m", "scripted:billing-m"))
    finally:
        await worker.aclose()
