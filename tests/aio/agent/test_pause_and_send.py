"""Pause for approval, input sent during a run, and the tool journal after a crash."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from aimu import aio
from aimu.aio.agent import INTERRUPTED
from aimu.aio.approvals import PAUSED, Approvals, Decision
from aimu.aio.errors import StaleDecisionError
from aimu.aio.events import TextChunk
from aimu.aio.journal import IN_DOUBT_RESULT
from aimu.aio.transcript import ToolCall, dangling_calls, validate
from aimu.testing.script import ScriptedCall, Turn
from aimu.testing.scripted import ScriptedModel
from aimu.testing.server import LoopbackServer

charged: list[int] = []


@aio.tool(approval=True)
def charge(amount: int) -> str:
    """Charge the card."""
    charged.append(amount)
    return f"charged {amount}"


def lookup(city: str) -> str:
    """Look a city up."""
    return f"{city} is sunny"


def pay_script() -> list[Turn]:
    return [
        Turn(tool_calls=[ScriptedCall("lookup", {"city": "Oslo"}),
                         ScriptedCall("charge", {"amount": 5})]),
        Turn(text="all done"),
    ]


@pytest.fixture(autouse=True)
def fresh_charges() -> None:
    charged.clear()


def roles(agent: aio.Agent) -> list[str]:
    return [m["role"] for m in agent.model_client.messages]


# -- approvals -------------------------------------------------------------------------------


async def test_a_call_that_needs_approval_pauses_then_approve_and_resume() -> None:
    agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge])
    assert await agent.run("pay for Oslo") == PAUSED
    assert agent.last_status == "paused" and agent.status == "paused"
    (pending,) = agent.pending_approvals
    assert (pending.tool, pending.arguments, pending.in_doubt) == ("charge", {"amount": 5}, False)
    assert charged == []  # nothing half-run: lookup ran, charge waits
    assert roles(agent) == ["user", "assistant", "tool"]
    validate(agent.model_client.messages)
    agent.approve(pending.call_id)
    assert await agent.resume() == "all done"
    assert charged == [5] and agent.pending_approvals == []
    validate(agent.model_client.messages)
    assert roles(agent) == ["user", "assistant", "tool", "tool", "assistant"]


async def test_deny_gives_the_model_the_reason() -> None:
    model = ScriptedModel(pay_script())
    agent = aio.Agent(model, tools=[lookup, charge])
    await agent.run("pay")
    agent.deny(agent.pending_approvals[0].call_id, reason="too expensive")
    assert await agent.resume() == "all done"
    assert charged == []
    sent = model.requests[-1]["messages"]
    assert any(m.get("content") == "[denied: too expensive]" for m in sent)


async def test_bad_decisions_are_refused_and_change_nothing() -> None:
    agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge])
    with pytest.raises(ValueError, match="no call 'nope' waits"):
        agent.approve("nope")
    await agent.run("pay")
    call_id = agent.pending_approvals[0].call_id
    before = copy.deepcopy(agent.model_client.messages)
    with pytest.raises(ValueError, match="calls wait for a decision"):
        agent.resume()
    with pytest.raises(ValueError, match="calls wait for a decision"):
        agent.run("something else")
    with pytest.raises(ValueError, match="no call 'other' waits"):
        agent.deny("other")
    agent.approve(call_id)
    with pytest.raises(ValueError, match="already decided"):
        agent.deny(call_id)
    assert agent.model_client.messages == before


async def test_deciding_while_running_is_refused() -> None:
    release = asyncio.Event()

    started = asyncio.Event()

    async def slow(city: str) -> str:
        """Slow lookup."""
        started.set()
        await release.wait()
        return "ok"

    model = ScriptedModel([Turn(tool_calls=[ScriptedCall("slow", {"city": "x"})]),
                           Turn(text="fine")])
    agent = aio.Agent(model, tools=[slow])
    run = asyncio.ensure_future(agent.run("go"))
    await started.wait()
    with pytest.raises(RuntimeError, match="while a run is in progress"):
        agent.approve("anything")
    release.set()
    assert await run == "fine"


async def test_a_policy_decides_per_call() -> None:
    asked: list[tuple[str, dict[str, Any]]] = []

    def policy(name: str, arguments: dict[str, Any]) -> bool | str:
        asked.append((name, arguments))
        if name == "lookup":
            return True
        return "ask" if arguments["amount"] > 3 else False

    agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge], approve=policy)
    assert await agent.run("pay") == PAUSED
    assert [name for name, _ in asked] == ["lookup", "charge"]
    refusing = aio.Agent(
        ScriptedModel(pay_script()), tools=[lookup, charge], approve=lambda n, a: n == "lookup"
    )
    assert await refusing.run("pay") == "all done"
    results = [m["content"] for m in refusing.model_client.messages if m["role"] == "tool"]
    assert "[denied: refused by the policy]" in results and charged == []


async def test_a_paused_handle_is_done_and_cancel_is_a_no_op(tmp_path: Path) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge],
                          store=store, session="pay")
        handle = aio.RunHandle.start(agent.run("pay"))
        assert await handle == PAUSED
        assert handle.status == "paused" and handle.done
        assert handle.cancel() is False and handle.interrupt() is False
        info = await store.info("pay")
        assert info is not None and info.status == "paused"
        await agent.aclose()


@pytest.mark.parametrize("provider", ["ollama", "openai"])
async def test_decisions_in_a_new_process_resume_over_the_wire(
    provider: str, tmp_path: Path
) -> None:
    async with LoopbackServer(pay_script()) as server:
        def client() -> aio.ModelClient:
            if provider == "ollama":
                return aio.client("ollama:m", host=server.url)
            return aio.client("openai:m", base_url=server.openai_base_url, api_key="x")

        async with aio.SQLiteStore(tmp_path / "s.db") as store:
            first = aio.Agent(client(), tools=[lookup, charge], store=store, session="pay")
            assert await first.run("pay") == PAUSED
            await first.aclose()
            # "A new process": a new agent on the same store and session, decisions later.
            second = aio.Agent(client(), tools=[lookup, charge], store=store, session="pay")
            await second.open()
            (pending,) = second.pending_approvals
            second.approve(pending.call_id)
            assert await second.resume() == "all done"
            assert charged == [5]
            sent = server.requests[-1].body["messages"]
            assert [m["role"] for m in sent] == ["user", "assistant", "tool", "tool"]
            info = await store.info("pay")
            assert info is not None and info.status == "completed"
            await second.aclose()


async def test_a_chain_pauses_with_its_agent_and_resumes_after_the_decision() -> None:
    payer = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge], name="payer")
    writer = aio.Agent(ScriptedModel(lambda request: Turn(text="receipt written")),
                       name="writer")
    chain = aio.Chain([payer, writer])
    handle = aio.RunHandle.start(chain.run("pay"))
    assert await handle == PAUSED and handle.status == "paused"
    assert chain.last_status == "paused" and chain.state["status"] == "paused"
    (pending,) = chain.pending_approvals
    with pytest.raises(ValueError, match="calls wait for a decision"):
        chain.resume()
    chain.approve(pending.call_id)
    assert await chain.resume() == "receipt written"
    assert charged == [5]


# -- send --------------------------------------------------------------------------------------


def held_research_agent(answer: str) -> tuple[aio.Agent, asyncio.Event, asyncio.Event]:
    """An agent whose "go" calls a research tool that holds its tool round until released;
    then it answers ``answer.format(role=..., content=...)`` of the last message. Returns the
    agent, the event set once the tool runs, and the one that releases it."""
    started = asyncio.Event()
    release = asyncio.Event()

    async def research(topic: str) -> str:
        """Research."""
        started.set()
        await release.wait()
        return "notes"

    def script(request: dict[str, Any]) -> Turn:
        last = request["messages"][-1]
        if last["role"] == "user" and last["content"] == "go":
            return Turn(tool_calls=[ScriptedCall("research", {"topic": "t"})])
        return Turn(text=answer.format(role=last["role"], content=last["content"]))

    return aio.Agent(ScriptedModel(script), tools=[research]), started, release


async def test_send_joins_the_run_at_the_next_boundary_in_order() -> None:
    agent, started, release = held_research_agent("answered after {role}: {content}")
    assert agent.send("too early") is False
    run = asyncio.ensure_future(agent.run("go"))
    await started.wait()  # the tool round is in flight
    assert agent.send("focus on 2024") and agent.send("and be brief")
    release.set()
    reply = await run
    assert reply == "answered after user: and be brief"
    users = [m["content"] for m in agent.model_client.messages if m["role"] == "user"]
    assert users == ["go", "focus on 2024", "and be brief"]
    assert [m["role"] for m in agent.model_client.messages] == [
        "user", "assistant", "tool", "user", "user", "assistant"
    ]
    assert agent.send("after the end") is False


async def test_handle_send_reaches_the_agent_inside() -> None:
    model = ScriptedModel(lambda request: Turn(
        text=f"reply to {request['messages'][-1]['content']}", delay=0.001, chunks=3))
    agent = aio.Agent(model)
    handle = aio.RunHandle.start(agent.run("first"))
    sent = False
    async for event in handle.events():
        if isinstance(event, TextChunk) and not sent:
            sent = handle.send("second")
    assert await handle == "reply to second"
    assert [m["content"] for m in agent.model_client.messages if m["role"] == "user"] == [
        "first", "second"
    ]


async def _send_sweep(mode: str) -> int:
    """Send at the n-th loop yield for n = 1, 2, ... until the run finishes first."""
    for n in range(1, 500):
        model = ScriptedModel(lambda request: (
            Turn(text="calling", tool_calls=[ScriptedCall("lookup", {"city": "x"})])
            if request["messages"][-1]["content"] == "go" else Turn(text="done now")
        ))
        agent = aio.Agent(model, tools=[lookup])
        handle = aio.RunHandle.start(agent.run("go"))
        for _ in range(n):
            await asyncio.sleep(0)
            if handle.done:
                break
        if handle.done:
            return n - 1
        accepted = agent.send("extra input") if mode == "agent" else handle.send("extra input")
        await handle
        messages = agent.model_client.messages
        validate(messages)
        assert not dangling_calls(messages)
        count = sum(m["role"] == "user" and m["content"] == "extra input" for m in messages)
        assert count == (1 if accepted else 0), (n, messages)
    raise AssertionError("the run never finished")


@pytest.mark.parametrize("mode", ["agent", "handle"])
async def test_a_send_at_every_await_point_appears_exactly_once(mode: str) -> None:
    assert await _send_sweep(mode) >= 5


# -- the tool journal ---------------------------------------------------------------------------


@aio.tool(idempotent=True)
def read_balance(account: str) -> str:
    """Read a balance (safe to repeat)."""
    charged.append(0)
    return "100"


def transfer(amount: int) -> str:
    """Move money (not safe to repeat)."""
    charged.append(amount)
    return "moved"


async def crashed_session(store: aio.SQLiteStore, calls: list[ScriptedCall]) -> None:
    """A session as a kill -9 leaves it: the calls' turn stored, each call started, no
    result (written through the store's own writer, as the dead process had)."""
    writer = await store.open_session("job")
    await writer.append({"role": "user", "content": "go"})
    tool_calls = [
        {"id": f"c{i}", "type": "function",
         "function": {"name": call.name, "arguments": dict(call.arguments)}}
        for i, call in enumerate(calls)
    ]
    await writer.append({"role": "assistant", "content": "", "tool_calls": tool_calls})  # type: ignore[typeddict-item]
    for i, call in enumerate(calls):
        await writer.record_tool_start(f"c{i}", call.name, dict(call.arguments))
    await writer.aclose()


async def test_calls_in_doubt_after_a_crash_follow_their_tool(tmp_path: Path) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        await crashed_session(store, [
            ScriptedCall("transfer", {"amount": 7}),
            ScriptedCall("read_balance", {"account": "a"}),
            ScriptedCall("charge", {"amount": 9}),
        ])
        model = ScriptedModel([Turn(text="recovered")])
        agent = aio.Agent(model, tools=[transfer, read_balance, charge],
                          store=store, session="job")
        await agent.open()
        results = {m["tool_call_id"]: m["content"]
                   for m in agent.model_client.messages if m["role"] == "tool"}
        assert results == {"c0": IN_DOUBT_RESULT}  # not re-run: the model is told
        (pending,) = agent.pending_approvals
        assert pending.call_id == "c2" and pending.in_doubt  # a person decides
        agent.deny("c2", reason="already charged, says the bank")
        assert await agent.resume() == "recovered"
        assert charged == [0]  # only the idempotent call ran again
        validate(agent.model_client.messages)
        assert not dangling_calls(agent.model_client.messages)
        starts = {s.call_id for s in await store.tool_starts("job")}
        assert starts == {"c0", "c1", "c2"}
        await agent.aclose()


async def test_each_tool_start_is_journaled_before_the_tool_runs(tmp_path: Path) -> None:
    seen: list[set[str]] = []

    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        async def probe(city: str, ctx: aio.ToolContext) -> str:
            """Check the journal from inside the tool."""
            seen.append({s.call_id for s in await store.tool_starts("j")})
            return ctx.call_id

        model = ScriptedModel([Turn(tool_calls=[ScriptedCall("probe", {"city": "x"})]),
                               Turn(text="ok")])
        agent = aio.Agent(model, tools=[probe], store=store, session="j")
        assert await agent.run("go") == "ok"
        call_id = agent.model_client.messages[1]["tool_calls"][0]["id"]  # type: ignore[typeddict-item]
        assert seen == [{call_id}]
        await agent.aclose()


async def _pause_sweep(mode: str) -> int:
    """Cancel or interrupt at the n-th loop yield of a run that pauses, for every n."""
    for n in range(1, 500):
        agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge])
        handle = aio.RunHandle.start(agent.run("pay"))
        for _ in range(n):
            await asyncio.sleep(0)
            if handle.done:
                break
        if handle.done:
            assert handle.status == "paused"
            return n - 1
        if mode == "cancel":
            handle.cancel()
            with pytest.raises(asyncio.CancelledError):
                await handle
            assert agent.pending_approvals == [] and agent.status == "cancelled"
        else:
            handle.interrupt()
            assert await handle in (PAUSED, INTERRUPTED)
        messages = agent.model_client.messages
        validate(messages)
        open_ids = {call["id"] for _, call in dangling_calls(messages)}
        assert open_ids == {p.call_id for p in agent.pending_approvals}
        assert charged == []
        if agent.pending_approvals:  # paused: a person's decision still finishes it
            agent.approve(agent.pending_approvals[0].call_id)
            assert await agent.resume() == "all done"
            assert charged == [5]
            charged.clear()
    raise AssertionError("the run never paused")


@pytest.mark.parametrize("mode", ["cancel", "interrupt"])
async def test_a_stop_at_every_await_point_of_a_pausing_run(mode: str) -> None:
    assert await _pause_sweep(mode) >= 3


async def test_a_parallel_branch_that_pauses_pauses_the_workflow() -> None:
    payer = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge], name="payer")
    other = aio.Agent(ScriptedModel(lambda request: Turn(text="other done")), name="other")
    parallel = aio.Parallel([payer, other])
    assert await parallel.run("go") == PAUSED
    assert parallel.status == "paused"
    branches = parallel.state["branches"]
    assert [b["status"] for b in branches] == ["in_flight", "finished"]
    parallel.approve(parallel.pending_approvals[0].call_id)
    final = await parallel.resume()
    assert "all done" in final and "other done" in final and charged == [5]


async def test_handle_send_reaches_an_agent_inside_a_workflow() -> None:
    agent, started, release = held_research_agent("saw {content}")
    chain = aio.Chain([agent])
    handle = aio.RunHandle.start(chain.run("go"))
    await started.wait()
    assert handle.send("narrow it down")
    release.set()
    assert await handle == "saw narrow it down"


# -- a send into a run that pauses (issue 21 item 1) --------------------------------------------


def held_pay_agent(
    store: aio.Store | None, mode: str = "agent"
) -> tuple[aio.Agent, asyncio.Event, asyncio.Event, ScriptedModel]:
    """An agent whose first turn calls a held tool and the approval tool ``charge``, then
    answers ``"saw: <the user messages after the task>"``."""
    started, release = asyncio.Event(), asyncio.Event()

    async def research(topic: str) -> str:
        """Research."""
        started.set()
        await release.wait()
        return "notes"

    def script(request: dict[str, Any]) -> Turn:
        messages = request["messages"]
        if [m["role"] for m in messages] == ["user"]:
            return Turn(tool_calls=[ScriptedCall("research", {"topic": "t"}),
                                    ScriptedCall("charge", {"amount": 5})])
        users = [m["content"] for m in messages[1:] if m["role"] == "user"]
        return Turn(text="saw: " + " | ".join(users))

    model = ScriptedModel(script)
    kwargs: dict[str, Any] = {} if store is None else {"store": store, "session": "pay"}
    agent = aio.Agent(model, tools=[research, charge], **kwargs)
    return agent, started, release, model


async def paused_after_sending(
    store: aio.Store | None, *texts: str, mode: str = "agent"
) -> aio.Agent:
    """A held_pay_agent that was sent ``texts`` (by the agent or its handle) during its
    tool round, then paused for ``charge``."""
    agent, started, release, _ = held_pay_agent(store)
    handle = aio.RunHandle.start(agent.run("pay"))
    await started.wait()  # the tool round is in flight: the send waits for a boundary
    sender = agent if mode == "agent" else handle
    assert all([sender.send(text) for text in texts])
    release.set()
    assert await handle == PAUSED
    return agent


@pytest.mark.parametrize("mode", ["agent", "handle"])
async def test_a_send_into_a_run_that_pauses_reaches_the_resumed_run_in_another_agent(
    mode: str, tmp_path: Path
) -> None:
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = await paused_after_sending(store, "use the blue card", "and email me", mode=mode)
        await agent.aclose()  # "the process ends": nothing of the send is only in memory
        # "Another process": a new agent object on the same store and session.
        second, _, _, _ = held_pay_agent(store)
        await second.open()
        (pending,) = second.pending_approvals
        second.approve(pending.call_id)
        assert await second.resume() == "saw: use the blue card | and email me"
        users = [m["content"] for m in second.model_client.messages if m["role"] == "user"]
        assert users == ["pay", "use the blue card", "and email me"]  # exactly once
        state = await store.load_state("pay")
        assert state["approvals"] == {"pending": [], "decisions": {}} and "sent" not in state
        await second.aclose()
        third, _, _, _ = held_pay_agent(store)  # and never again
        await third.open()
        assert third.model_client.messages == await store.load("pay")
        assert third._session.durable.carried.messages == []
        await third.aclose()


async def test_a_send_carried_by_a_pause_is_joined_once_after_a_crash_between_writes(
    tmp_path: Path
) -> None:
    """A crash after the carried text was recorded but before the state dropped it:
    the next load sees the text in the transcript and does not join it again."""
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        agent = await paused_after_sending(store, "use the blue card")
        stored_state = await store.load_state("pay")
        assert stored_state["sent"]["texts"] == ["use the blue card"]
        await agent.aclose()
        second, _, _, _ = held_pay_agent(store)
        await second.open()
        second.approve(second.pending_approvals[0].call_id)
        assert await second.resume() == "saw: use the blue card"
        await second.aclose()
        writer = await store.open_session("pay")  # put the state back as the crash left it
        await writer.save_state(stored_state)
        await writer.aclose()
        third, _, _, _ = held_pay_agent(store)
        await third.open()
        assert third._session.durable.carried.messages == []
        assert await third.run("again") == "saw: use the blue card | again"
        await third.aclose()


async def test_a_send_carried_by_a_pause_is_in_the_snapshot_and_joins_the_resumed_run() -> None:
    agent = await paused_after_sending(None, "first note")
    snapshot = agent.snapshot()
    assert snapshot["sent"]["texts"] == ["first note"]
    copy_of = agent.session_from(snapshot)  # a workflow's state carries it too
    assert copy_of is not None
    assert copy_of._session.durable.carried.messages == [{"role": "user", "content": "first note"}]
    agent.approve(agent.pending_approvals[0].call_id)
    assert await agent.resume() == "saw: first note"


# -- a send joins the run; it buys no rounds (issue 21 item 24) ----------------------------------


async def test_sends_do_not_renew_the_round_budget() -> None:
    agent_ref: list[aio.Agent] = []

    def script(request: dict[str, Any]) -> Turn:
        # A send on every turn that offers tools (at most 10: a renewed budget never ends).
        if request["tools"] and len(model.requests) <= 10:
            agent_ref[0].send("one more thing")
            return Turn(tool_calls=[ScriptedCall("lookup", {"city": "x"})])
        return Turn(text="final")

    model = ScriptedModel(script)
    agent = aio.Agent(model, tools=[lookup], max_rounds=2)
    agent_ref.append(agent)
    assert await agent.run("go") == "final"
    # Two tool rounds, then the last turn without tools: the sends joined, bought nothing.
    assert len(model.requests) == 3
    users = [m["content"] for m in agent.model_client.messages if m["role"] == "user"]
    assert users.count("one more thing") == 2


async def test_messages_and_pending_approvals_before_open_say_so(tmp_path: Path) -> None:
    """They looked like an empty session until the agent was opened."""
    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        first = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge],
                          store=store, session="pay")
        assert await first.run("pay") == PAUSED
        await first.aclose()
        agent = aio.Agent(ScriptedModel(pay_script()), tools=[lookup, charge],
                          store=store, session="pay")
        for read in (lambda: agent.messages, lambda: agent.pending_approvals,
                     lambda: agent.approve("anything")):
            with pytest.raises(RuntimeError, match=r"session 'pay' is not open.*agent.open\(\)"):
                read()
        await agent.open()
        assert agent.messages is agent.model_client.messages and len(agent.messages) == 3
        (pending,) = agent.pending_approvals
        await agent.aclose()
        assert agent.pending_approvals == [pending]  # what was loaded stays readable
        fresh = aio.Agent(ScriptedModel([Turn(text="hi")]), store=store, session="new")
        assert await fresh.run("hello") == "hi"  # a run opens the session itself
        await fresh.aclose()
    no_store = aio.Agent(ScriptedModel([Turn(text="hi")]))
    assert no_store.messages == [] and no_store.pending_approvals == []


# -- a decision binds to the pause it was given for (issue 29 item 6) -------------------------


def _mail_call(to: str) -> ToolCall:
    return {"id": "c1", "type": "function",
            "function": {"name": "send_email", "arguments": {"to": to}}}


def test_a_decision_binds_to_the_pause_it_was_given_for() -> None:
    approvals = Approvals()
    approvals.ask(_mail_call("Alice"), run_id="r1")
    (alice,) = approvals.waiting()
    approvals.ask(_mail_call("Alice"), run_id="r1")  # the same call asked again: same pause
    assert approvals.waiting() == [alice]
    approvals.ask(_mail_call("Mallory"))  # replaced under the same call id: a new pause
    (mallory,) = approvals.waiting()
    assert mallory.pause_id != alice.pause_id
    with pytest.raises(StaleDecisionError, match="which no longer waits") as raised:
        approvals.decide("c1", Decision(True, pause_id=alice.pause_id), "session s")
    assert raised.value.call_id == "c1" and approvals.decisions == {}
    approvals.decide("c1", Decision(True), "session s")  # bound to the pause that waits
    assert approvals.decisions["c1"].pause_id == mallory.pause_id
    # A stored decision for a pause that no longer waits is dropped, never applied.
    data = approvals.dump()
    data["decisions"]["c1"]["pause_id"] = alice.pause_id
    loaded = Approvals.load(data, "session s")
    assert loaded.decisions == {} and loaded.waiting() == [mallory]
    approvals.decisions["c1"] = Decision(True, None, alice.pause_id)
    assert approvals.take("c1") is None


def test_approvals_stored_before_pauses_had_ids_get_one_from_the_call() -> None:
    old = {"pending": [{"call_id": "c1", "tool": "t", "arguments": {"a": 1}}],
           "decisions": {"c1": {"approved": True, "reason": None}}}
    first, again = Approvals.load(old, "s"), Approvals.load(old, "s")
    assert first.pending["c1"].pause_id == again.pending["c1"].pause_id != ""
    assert first.take("c1") == Decision(True)  # its decision still holds


async def test_a_decision_on_a_replaced_session_runs_nothing(tmp_path: Path) -> None:
    """An agent decides on the call it saw after another process replaced the session
    (same call id, other arguments): resuming loads the stored pause, the decision is not
    applied to it (StaleDecisionError naming what waits now), and nothing runs; a decision
    given while closed for the pause that still waits holds across the reopening."""
    mailed: list[str] = []

    @aio.tool(approval=True)
    def send_email(to: str) -> str:
        """Send an email."""
        mailed.append(to)
        return "sent"

    def script(to: str) -> ScriptedModel:
        return ScriptedModel([Turn(tool_calls=[ScriptedCall("send_email", {"to": to}, "c1")]),
                              Turn(text="sent")])

    async with aio.SQLiteStore(tmp_path / "s.db") as store:
        first = aio.Agent(script("Alice"), tools=[send_email], store=store, session="s")
        assert await first.run("mail") == PAUSED
        await first.aclose()
        assert await store.delete("s")
        second = aio.Agent(script("Mallory"), tools=[send_email], store=store, session="s")
        assert await second.run("mail") == PAUSED
        await second.aclose()
        (shown,) = first.pending_approvals
        first.approve("c1")  # it saw Alice
        with pytest.raises(StaleDecisionError, match="Mallory") as raised:
            await first.resume()
        assert raised.value.call_id == "c1" and mailed == []
        assert [p.arguments for p in first.pending_approvals] == [{"to": "Mallory"}]
        with pytest.raises(StaleDecisionError, match="no longer waits"):
            first.approve(shown)  # the PendingApproval of Alice's pause
        stored = Approvals.from_state(await store.load_state("s"), "s")
        assert stored.decisions == {} and len(stored.waiting()) == 1
        # Decided while closed, for the pause that waits: it holds once the session opens.
        first.deny(first.pending_approvals[0], "not Mallory")
        assert await first.resume() == "sent"
        assert mailed == []
        assert first.model_client.messages[-2]["content"] == "[denied: not Mallory]"
        await first.aclose()


@pytest.mark.parametrize("stored", [False, True], ids=["memory", "sqlite"])
async def test_a_resume_counts_the_rounds_from_the_task_not_from_a_sent_text(
    stored: bool, tmp_path: Path
) -> None:
    """Issue 29 item 19: max_rounds=2, a tool every turn; a send() and an interrupt() at
    the first StepFinished; resume() makes 3 model turns in all (2 rounds and the last
    without tools), not 4: the sent text is marked ``aimu_sent`` (kept by the store,
    never sent), so the rounds are counted from the task."""

    def script(request: dict[str, Any]) -> Turn:
        if request["tools"]:
            return Turn(tool_calls=[ScriptedCall("lookup", {"city": "x"})])
        return Turn(text="final")

    model = ScriptedModel(script)
    store = aio.SQLiteStore(tmp_path / "s.db") if stored else None
    agent = aio.Agent(model, tools=[lookup], max_rounds=2, store=store,
                      session="s" if stored else None)
    async for event in agent.run("go", stream=True):
        if isinstance(event, aio.StepFinished):
            agent.send("also check y")
            agent.interrupt()
    assert agent.last_status == "interrupted" and len(model.requests) == 1
    sent = [m for m in agent.messages if m.get("aimu_sent")]
    assert sent == [{"role": "user", "content": "also check y", "aimu_sent": True}]
    if store is not None:
        await agent.aclose()
        assert (await store.load("s"))[-1] == sent[0]  # kept through the store
        agent = aio.Agent(model, tools=[lookup], max_rounds=2, store=store, session="s")
    assert await agent.resume() == "final"
    assert len(model.requests) == 3
    last = model.requests[-1]["messages"]
    assert {"role": "user", "content": "also check y"} in last  # sent without the mark
    assert not any("aimu_sent" in m for m in last)
    await agent.aclose()
    if store is not None:
        await store.aclose()
