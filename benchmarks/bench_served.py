"""Served runs side by side: ``aimu serve`` beside the servers people deploy instead.

    .venv-peers/bin/python benchmarks/bench_served.py                     # N = 1, 100, 1000
    .venv-peers/bin/python benchmarks/bench_served.py --n 1,100 --servers aimu,langgraph
    python benchmarks/bench_served.py --servers aimu --n 1               # aimu alone

Four servers, each serving the same one-tool agent (``lookup(city)``) against the same
OpenAI-compatible loopback model (``aimu.testing.server`` in its own process): the model
calls the tool, then streams a long answer at 20 tokens/s (6,000 chunks, 0.05 s apart),
so every run is still streaming when it is stopped.

* ``aimu``: ``aimu serve``'s runs API (``POST /sessions/{s}/runs``, SSE from
  ``GET /runs/{id}/events``, ``POST /runs/{id}/cancel``; the cancel-all one bulk
  ``POST /runs/cancel``), SQLite store
  (``benchmarks/peers/aimu_app.py``).
* ``aimu-fleet`` (``--redis URL``): two such processes on one store and one Redis, each
  run started on one and stopped through the other (the Stop crosses Redis to the
  process that holds the run); the cancel-all is sent half to each. CPU and RSS are both
  processes'.
* ``floor``: the least a server of runs does (``peers/floor/app.py``): one task a run
  relaying the model's text as SSE, a cancel that cancels it, nothing kept.
* ``langgraph``: the LangGraph API server, in-memory runtime (``langgraph dev``), a
  ``create_react_agent`` graph on ``ChatOpenAI`` (``benchmarks/peers/langgraph/``): runs
  created in the background (``POST /threads/{t}/runs``), followed with
  ``GET .../runs/{r}/stream``, stopped with ``POST .../cancel?action=interrupt``, the
  cancel-all through its bulk ``POST /runs/cancel``.
* ``adk``: Google ADK's ``adk api_server`` on ``LiteLlm`` (``benchmarks/peers/adk/``),
  ``POST /run_sse``: ADK has no cancel endpoint; a run stops when its client leaves, so
  a Stop here is closing the SSE stream.
* ``agno``: Agno's AgentOS (``benchmarks/peers/agno/app.py``) on ``OpenAILike``,
  ``POST /agents/{a}/runs`` (stream), ``POST /agents/{a}/runs/{r}/cancel``.

Per server and N: start -> first token at the client (p50/p99); a **single** Stop while
the others stream -> the model server saw that run's stream closed (p50/p99 over
``--stops`` runs, one at a time; ``time.monotonic`` is one clock for every process);
cancel-all of the rest -> the last stream closed, and how many never closed; whether a
stopped run's partial reply can be read back through that server's own API; the server's
CPU ms and RSS KiB per run in flight (its whole process tree); with ``--kill``, a kill -9
of the server mid-run at N=1: what the restarted server says of the run, and whether the
run went on. A server that fails at some N is reported as such and skipped for larger N.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PEERS = os.path.join(HERE, "peers")
PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")
CHUNKS = 6000  # 300 s a stream: at N = 1,000 the Stops alone take minutes
DELAY = 0.05  # 20 tokens/s a stream
TAG = "Peer #"  # the task names its run: the model server keys each stream by it
WARM = "Warm #"  # a warm-up run: a short answer
SERVERS = ("aimu", "langgraph", "adk", "agno")
#: Kinds measured when asked (``--servers``), not by default.
MORE = ("aimu-fleet", "floor")
REDIS = ""  # --redis: the fleet's control


# -- the model server process -----------------------------------------------------------------


def model_server() -> None:
    """The loopback model; commands on stdin, one JSON answer a line on stdout."""
    from aimu.testing.script import ScriptedCall, Turn
    from aimu.testing.server import LoopbackServer

    call = Turn(tool_calls=[ScriptedCall("lookup", {"city": "Paris"})])
    long = Turn(text=" ".join(f"w{i}" for i in range(CHUNKS)), chunks=CHUNKS, delay=DELAY)
    short = Turn(text="sunny in Paris", chunks=3)
    tags: dict[int, str] = {}  # a stream (its index) -> the run's tag

    def task_of(body: Mapping[str, Any]) -> str:
        for message in body.get("messages", ()):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):  # parts
                    content = " ".join(str(p.get("text", "")) for p in content)
                return str(content)
        return ""

    def script(body: Mapping[str, Any]) -> Turn:
        task = task_of(body)
        if not any(m.get("role") == "tool" for m in body.get("messages", ())):
            return call
        if task.startswith(WARM):
            return short
        tags[len(server.streams)] = task[len(TAG):].split()[0] if task.startswith(TAG) else task
        return long

    server = LoopbackServer(script)

    def answering(count: int) -> bool:  # at least `count` answers have sent a chunk
        return sum(1 for i, s in enumerate(server.streams) if i in tags and s.chunks_sent) >= count

    def closed(wanted: set[str]) -> bool:
        done = {tags[i] for i, s in enumerate(server.streams)
                if i in tags and (s.abandoned_at or s.finished_at)}
        return wanted <= done

    async def main() -> None:
        await server.start()
        print(json.dumps({"url": server.openai_base_url}), flush=True)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command, *args = line.decode().split()
            answer: dict[str, Any] = {}
            if command == "reset":
                server.requests.clear()
                server.streams.clear()
                tags.clear()
            elif command == "answering":  # wait until N answers stream
                with contextlib.suppress(TimeoutError):
                    await server.wait_until(partial(answering, int(args[0])), float(args[1]))
                answer = {"answering": sum(1 for i, s in enumerate(server.streams)
                                           if i in tags and s.chunks_sent)}
            elif command == "closed":  # wait until these tags' streams ended; when each did
                wanted = set(args[1:])
                with contextlib.suppress(TimeoutError):
                    await server.wait_until(partial(closed, wanted), float(args[0]))
                answer = {tags[i]: (s.abandoned_at or s.finished_at)
                          for i, s in enumerate(server.streams)
                          if i in tags and tags[i] in wanted and (s.abandoned_at or s.finished_at)}
            elif command == "requests":  # model requests made for a tag so far
                answer = {"requests": sum(1 for r in server.requests
                                          if TAG + args[0] in json.dumps(r.body))}
            print(json.dumps(answer), flush=True)
        await server.stop()

    asyncio.run(main())


class Model:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--model-server"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        self.url = str(json.loads(self._line())["url"])

    def _line(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the model server process ended")
        return line

    async def ask(self, *words: object) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(" ".join(map(str, words)) + "\n")
        self.process.stdin.flush()
        return dict(json.loads(await asyncio.to_thread(self._line)))

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(10)


# -- process accounting -----------------------------------------------------------------------


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        found.append(here)
        todo.extend(children.get(here, ()))
    return found


def usage(pid: int) -> tuple[float, int]:
    """CPU seconds and RSS bytes of pid's process tree."""
    cpu, rss = 0.0, 0
    for each in tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{each}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / TICKS
            rss += int(fields[21]) * PAGE
    return cpu, rss


def usage_of(pids: list[int]) -> tuple[float, int]:
    """CPU seconds and RSS bytes of the process trees of ``pids``."""
    each = [usage(pid) for pid in pids]
    return sum(cpu for cpu, _ in each), sum(rss for _, rss in each)


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def sse(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event, data) pairs of a Server-Sent Events body."""
    event, data = "message", []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip())


# -- the servers --------------------------------------------------------------------------------


class Served:
    """One server under test: its process, and how a run is started, followed and stopped."""

    name = ""
    ready_path = "/"

    def __init__(self, model_url: str, workdir: str) -> None:
        self.model_url, self.workdir = model_url, workdir
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None
        self.runs: dict[str, dict[str, str]] = {}  # tag -> this server's ids
        self.readers: dict[str, asyncio.Task[None]] = {}
        self.recover = False  # aimu: restart with --recover (the peers have no such option)
        self.http = httpx.AsyncClient(base_url=self.base, timeout=600, limits=httpx.Limits(
            max_connections=2000, max_keepalive_connections=64))

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        raise NotImplementedError

    def _spawn(self) -> subprocess.Popen[bytes]:
        argv, cwd, env = self.command()
        self.log = open(os.path.join(self.workdir, f"{self.name}.log"), "ab")  # noqa: SIM115
        return subprocess.Popen(
            argv, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "BENCH_MODEL_URL": self.model_url, "BENCH_PORT": str(self.port),
                 **env})

    async def launch(self) -> None:
        self.process = await asyncio.to_thread(self._spawn)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start; see {self.log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get(self.ready_path, timeout=2)).status_code < 500:
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name} did not answer in 120 s")

    def pids(self) -> list[int]:
        """The processes whose CPU and memory are the server's."""
        return [] if self.process is None else [self.process.pid]

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    async def close(self) -> None:
        for reader in self.readers.values():
            reader.cancel()
        await asyncio.gather(*self.readers.values(), return_exceptions=True)
        self.readers.clear()
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.to_thread(self.process.wait, 15)
            except subprocess.TimeoutExpired:
                self.kill()
        await self.http.aclose()
        self.log.close()

    # Each server: start the run tagged `tag` and follow it, calling first() at its first
    # text; return when its stream ends. stop(tag) is one Stop; stop_all(tags) all of them.
    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        raise NotImplementedError

    async def stop(self, tag: str) -> None:
        raise NotImplementedError

    async def stop_all(self, tags: list[str]) -> None:
        await asyncio.gather(*(self.stop(tag) for tag in tags))

    async def kept(self, tag: str) -> bool:
        """Whether the stopped run's partial answer reads back through this server's API."""
        raise NotImplementedError

    async def after_crash(self, tag: str) -> str:
        """What the restarted server says of the run the crash cut."""
        raise NotImplementedError

    def start(self, tag: str, first: Callable[[], None]) -> None:
        self.readers[tag] = asyncio.create_task(self._follow(tag, first))

    async def _follow(self, tag: str, first: Callable[[], None]) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.follow(tag, first)


class Aimu(Served):
    name = "aimu"
    ready_path = "/health"

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        store = os.path.join(self.workdir, "aimu.db")
        return ([sys.executable, os.path.join(PEERS, "aimu_app.py")], self.workdir,
                {"BENCH_STORE": store, "PYTHONPATH": ROOT,
                 "BENCH_RECOVER": "1" if self.recover else ""})

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        started = await self.http.post(f"/sessions/s{tag}/runs", json={"task": task(tag)})
        started.raise_for_status()
        run = started.json()["run_id"]
        self.runs[tag] = {"run": run}
        async with self.http.stream("GET", f"/runs/{run}/events") as response:
            async for _event, data in sse(response):
                if '"text"' in data and json.loads(data).get("type") == "text":
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:
        await self.http.post(f"/runs/{self.runs[tag]['run']}/cancel")

    async def stop_all(self, tags: list[str]) -> None:
        await _cancel_many(self.http, [self.runs[tag]["run"] for tag in tags])

    async def kept(self, tag: str) -> bool:
        session = (await self.http.get(f"/sessions/s{tag}")).json()
        return any(m.get("role") == "assistant" and "w0" in str(m.get("content"))
                   for m in session.get("messages", ()))

    async def after_crash(self, tag: str) -> str:
        records = (await self.http.get("/runs", params={"session": f"s{tag}"})).json()["runs"]
        return "record " + ",".join(str(r.get("status")) for r in records) + " (--recover)"


class Floor(Served):
    """The least a server of runs does (``peers/floor/app.py``): a task a run relaying
    the model's text as SSE, a cancel that cancels it; nothing kept."""

    name = "floor"
    ready_path = "/health"

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        return ([sys.executable, os.path.join(PEERS, "floor", "app.py")], self.workdir, {})

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        started = await self.http.post("/runs", json={"task": task(tag)})
        started.raise_for_status()
        run = started.json()["run_id"]
        self.runs[tag] = {"run": run}
        async with self.http.stream("GET", f"/runs/{run}/events") as response:
            async for event, _data in sse(response):
                if event == "text":
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:
        await self.http.post(f"/runs/{self.runs[tag]['run']}/cancel")

    async def kept(self, tag: str) -> bool:
        return False  # nothing is kept: the floor


class AimuFleet(Aimu):
    """Two ``aimu serve`` processes on one store and Redis: a run started on one is
    followed there and stopped through the other."""

    name = "aimu-fleet"

    def __init__(self, model_url: str, workdir: str) -> None:
        super().__init__(model_url, workdir)
        self.prefix = f"bench-fleet-{uuid.uuid4().hex[:8]}"
        self.second = Aimu(model_url, workdir)
        self.second.name = "aimu-fleet-2"
        self.second.command = self.command  # type: ignore[method-assign]
        self.members = (self.http, self.second.http)

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        argv, cwd, env = super().command()
        if not REDIS:
            raise RuntimeError("aimu-fleet needs --redis URL")
        return argv, cwd, {**env, "BENCH_REDIS": REDIS, "BENCH_PREFIX": self.prefix}

    def pids(self) -> list[int]:
        return [p.pid for p in (self.process, self.second.process) if p is not None]

    async def launch(self) -> None:
        await asyncio.gather(super().launch(), self.second.launch())

    def kill(self) -> None:
        super().kill()
        self.second.kill()

    async def close(self) -> None:
        await asyncio.gather(super().close(), self.second.close())

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        at = len(self.runs) % 2
        http = self.members[at]
        started = await http.post(f"/sessions/s{tag}/runs", json={"task": task(tag)})
        started.raise_for_status()
        run = started.json()["run_id"]
        self.runs[tag] = {"run": run, "at": str(at)}
        async with http.stream("GET", f"/runs/{run}/events") as response:
            async for _event, data in sse(response):
                if '"text"' in data and json.loads(data).get("type") == "text":
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:
        other = self.members[1 - int(self.runs[tag]["at"])]  # not the process holding it
        await other.post(f"/runs/{self.runs[tag]['run']}/cancel")

    async def stop_all(self, tags: list[str]) -> None:
        """Each process's runs in one bulk cancel sent through the other process."""
        await asyncio.gather(*(
            _cancel_many(self.members[1 - at], [self.runs[tag]["run"] for tag in tags
                                                if self.runs[tag]["at"] == str(at)])
            for at in (0, 1)
        ))


async def _cancel_many(http: httpx.AsyncClient, run_ids: list[str]) -> None:
    """aimu's cancel-all: ``POST /runs/cancel``, 1,000 runs a request at most."""
    answers = await asyncio.gather(*(
        http.post("/runs/cancel", json={"run_ids": run_ids[i:i + 1000]})
        for i in range(0, len(run_ids), 1000)
    ))
    for answer in answers:
        answer.raise_for_status()


def _nothing() -> None:
    pass


def task(tag: str) -> str:
    """The task of the run tagged `tag`: a warm-up run's is answered at once."""
    return f"{WARM}{tag}" if tag.startswith("warm") else f"{TAG}{tag} weather?"


class LangGraph(Served):
    name = "langgraph"
    ready_path = "/ok"

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        # Its own copy of the graph's folder: the dev server keeps its runs and threads
        # there (.langgraph_api) and takes them up again when it starts.
        folder = os.path.join(self.workdir, "langgraph")
        if not os.path.isdir(folder):
            shutil.copytree(os.path.join(PEERS, "langgraph"), folder)
        binary = os.path.join(os.path.dirname(sys.executable), "langgraph")
        return ([binary, "dev", "--no-browser", "--no-reload", "--port", str(self.port),
                 "--n-jobs-per-worker", "2000", "--server-log-level", "WARNING"],
                folder,
                {"LANGGRAPH_NO_ANALYTICS": "1", "LANGSMITH_TRACING": "false"})

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        thread = (await self.http.post("/threads", json={})).json()["thread_id"]
        run = (await self.http.post(f"/threads/{thread}/runs", json={
            "assistant_id": "agent", "stream_mode": ["messages-tuple"],
            "input": {"messages": [{"role": "user", "content": task(tag)}]},
        })).json()["run_id"]
        self.runs[tag] = {"thread": thread, "run": run}
        async with self.http.stream("GET", f"/threads/{thread}/runs/{run}/stream") as response:
            async for event, data in sse(response):
                if event == "messages" and '"content":"w' in data:
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:
        ids = self.runs[tag]
        await self.http.post(f"/threads/{ids['thread']}/runs/{ids['run']}/cancel",
                             params={"action": "interrupt", "wait": "false"})

    async def stop_all(self, tags: list[str]) -> None:
        await self.http.post("/runs/cancel", json={
            "run_ids": [self.runs[tag]["run"] for tag in tags], "action": "interrupt"})

    async def kept(self, tag: str) -> bool:
        state = (await self.http.get(f"/threads/{self.runs[tag]['thread']}/state")).json()
        return "w0" in json.dumps((state.get("values") or {}).get("messages", []))

    async def after_crash(self, tag: str) -> str:
        ids = self.runs[tag]
        answer = await self.http.get(f"/threads/{ids['thread']}/runs/{ids['run']}")
        return (f"run {answer.json().get('status')}" if answer.status_code == 200
                else f"run: HTTP {answer.status_code}")


class Adk(Served):
    name = "adk"
    ready_path = "/list-apps"

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        binary = os.path.join(os.path.dirname(sys.executable), "adk")
        db = os.path.join(self.workdir, "adk.db")
        return ([binary, "api_server", "--port", str(self.port), "--no-reload",
                 "--log_level", "warning", "--session_service_uri", f"sqlite:///{db}", "."],
                self._agents(), {"LITELLM_LOCAL_MODEL_COST_MAP": "True"})

    def _agents(self) -> str:
        """Its own copy of the agents' folder (ADK keeps artifacts beside the agent)."""
        folder = os.path.join(self.workdir, "adk")
        if not os.path.isdir(folder):
            shutil.copytree(os.path.join(PEERS, "adk"), folder)
        return folder

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        session = f"s{tag}"
        (await self.http.post(f"/apps/peer_agent/users/u/sessions/{session}", json={}))
        self.runs[tag] = {"session": session}
        body = {"app_name": "peer_agent", "user_id": "u", "session_id": session,
                "new_message": {"role": "user", "parts": [{"text": task(tag)}]},
                "streaming": True}
        async with self.http.stream("POST", "/run_sse", json=body) as response:
            async for _event, data in sse(response):
                if '"text":"w' in data:
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:  # no cancel endpoint: the client leaves
        reader = self.readers.pop(tag)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)

    async def kept(self, tag: str) -> bool:
        session = (await self.http.get(f"/apps/peer_agent/users/u/sessions/s{tag}")).json()
        return "w0" in json.dumps([e.get("content") for e in session.get("events", [])])

    async def after_crash(self, tag: str) -> str:
        session = (await self.http.get(f"/apps/peer_agent/users/u/sessions/s{tag}")).json()
        return f"session of {len(session.get('events', []))} events, no run status"


class Agno(Served):
    name = "agno"
    ready_path = "/health"

    def command(self) -> tuple[list[str], str, dict[str, str]]:
        return ([sys.executable, os.path.join(PEERS, "agno", "app.py")], self.workdir,
                {"BENCH_AGNO_DB": os.path.join(self.workdir, "agno.db"),
                 "AGNO_TELEMETRY": "false"})

    async def follow(self, tag: str, first: Callable[[], None]) -> None:
        data = {"message": task(tag), "stream": "true", "session_id": f"s{tag}",
                "user_id": "u"}
        async with self.http.stream("POST", "/agents/peer-agent/runs", data=data) as response:
            async for _event, payload in sse(response):
                if tag not in self.runs and '"run_id"' in payload:
                    self.runs[tag] = {"run": json.loads(payload)["run_id"]}
                if '"RunContent"' in payload and '"content":"w' in payload:
                    first()
                    first = _nothing

    async def stop(self, tag: str) -> None:
        await self.http.post(f"/agents/peer-agent/runs/{self.runs[tag]['run']}/cancel")

    async def kept(self, tag: str) -> bool:
        runs = await self.http.get(f"/sessions/s{tag}/runs", params={"type": "agent"})
        return runs.status_code == 200 and "w0" in runs.text

    async def after_crash(self, tag: str) -> str:
        runs = await self.http.get(f"/sessions/s{tag}/runs", params={"type": "agent"})
        if runs.status_code != 200:
            return f"runs: HTTP {runs.status_code}"
        return "runs " + ",".join(str(r.get("status")) for r in runs.json()) if runs.json() \
            else "no run stored"


KINDS: dict[str, type[Served]] = {"aimu": Aimu, "langgraph": LangGraph, "adk": Adk, "agno": Agno,
                                  "aimu-fleet": AimuFleet, "floor": Floor}


# -- one measurement ----------------------------------------------------------------------------


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] if ordered else float("nan")


async def measure(kind: type[Served], model: Model, n: int, stops: int, workdir: str
                  ) -> dict[str, Any]:
    server = kind(model.url, workdir)
    row: dict[str, Any] = {"server": kind.name, "n": n}
    try:
        await server.launch()
        assert server.process is not None
        await model.ask("reset")
        await asyncio.wait_for(server.follow("warm", _nothing), 120)  # a warm-up run
        server.runs.pop("warm", None)
        cpu0, rss0 = usage_of(server.pids())
        firsts: dict[str, float] = {}
        sent: dict[str, float] = {}
        tags = [uuid.uuid4().hex[:10] for _ in range(n)]
        for tag in tags:
            sent[tag] = time.monotonic()
            server.start(tag, _stamp(firsts, tag))
        answering = (await model.ask("answering", n, 60 + n * 0.2))["answering"]
        with contextlib.suppress(TimeoutError):  # the clients saw every first token
            await asyncio.wait_for(_until(lambda: len(firsts) >= answering), 30)
        cpu1, rss1 = usage_of(server.pids())
        row.update(streaming=answering, first_p50=1000 * percentile(
            [firsts[t] - sent[t] for t in firsts], 0.5), first_p99=1000 * percentile(
            [firsts[t] - sent[t] for t in firsts], 0.99),
            cpu_ms=1000 * (cpu1 - cpu0) / max(answering, 1),
            rss_kib=(rss1 - rss0) / 1024 / max(answering, 1))
        live = [t for t in tags if (t in firsts and t in server.runs) or (
            kind is Adk and t in firsts)]
        single: list[float] = []
        # The cores each side kept busy while the single Stops ran (every other run
        # streaming): the server's processes, the model server's, this client's.
        busy0 = (usage_of(server.pids())[0], usage(model.process.pid)[0],
                 time.process_time(), time.monotonic())
        for tag in live[:stops]:
            began = time.monotonic()
            await server.stop(tag)
            ended = (await model.ask("closed", 10, tag)).get(tag)
            single.append(1000 * (ended - began) if ended else float("inf"))
        busy1 = (usage_of(server.pids())[0], usage(model.process.pid)[0],
                 time.process_time(), time.monotonic())
        wall = max(busy1[3] - busy0[3], 1e-9)
        row["cores"] = "/".join(f"{(b - a) / wall:.2f}"
                                for a, b in zip(busy0[:3], busy1[:3], strict=True))
        row.update(stop_p50=percentile(single, 0.5), stop_p99=percentile(single, 0.99),
                   stops=len(single))
        rest = live[stops:]
        if rest:
            began = time.monotonic()
            await server.stop_all(rest)
            ended_at = await model.ask("closed", 30, *rest)
            row.update(all_ms=1000 * (max(ended_at.values(), default=began) - began),
                       all_open=len(rest) - len(ended_at), all_n=len(rest))
        checked = live[: min(len(live), 5)]
        kept = [await server.kept(tag) for tag in checked]
        row["kept"] = f"{sum(kept)}/{len(kept)}"
    except Exception as error:  # a server that fails at this N: said, not hidden
        row["error"] = f"{type(error).__name__}: {error}"[:200]
    finally:
        await server.close()
    return row


async def _until(condition: Callable[[], bool]) -> None:
    """Wait until condition() holds, looking every 50 ms (client-side state only)."""
    while not condition():  # noqa: ASYNC110 (the state is plain data set by reader tasks)
        await asyncio.sleep(0.05)


def _stamp(firsts: dict[str, float], tag: str) -> Callable[[], None]:
    return lambda: firsts.setdefault(tag, time.monotonic())


async def crash(kind: type[Served], model: Model, workdir: str) -> str:
    """kill -9 mid-run at N=1, restart on the same state: what the server then says."""
    server = kind(model.url, workdir)
    try:
        await server.launch()
        await model.ask("reset")
        tag = uuid.uuid4().hex[:10]
        seen: list[float] = []
        server.start(tag, lambda: seen.append(time.monotonic()))
        await model.ask("answering", 1, 60)
        await asyncio.wait_for(_until(lambda: bool(seen)), 30)
        ids = dict(server.runs.get(tag, {}))
        server.kill()
        for reader in server.readers.values():
            reader.cancel()
        server.readers.clear()
        before = (await model.ask("requests", tag))["requests"]
        restarted = kind(model.url, workdir)
        restarted.port, restarted.base, restarted.http = server.port, server.base, server.http
        restarted.runs = {tag: ids}
        restarted.recover = True
        try:
            await restarted.launch()
            said = await restarted.after_crash(tag)
            went_on = "does not go on (30 s)"  # does the run go on by itself?
            for _ in range(60):
                if (await model.ask("requests", tag))["requests"] > before:
                    went_on = "goes on"
                    break
                await asyncio.sleep(0.5)
            return f"{said}; {went_on}"
        finally:
            restarted.log = server.log
            await restarted.close()
    except Exception as error:
        return f"{type(error).__name__}: {error}"[:200]
    finally:
        server.kill()


# -- the report -----------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return "not in 10 s" if value == float("inf") else f"{value:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| server | N | streaming | first token p50/p99 ms | single Stop p50/p99 ms "
            "| cancel-all ms (left open) | partial kept | CPU ms/run | RSS KiB/run "
            "| cores busy: server / model / client |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |")
    lines, nan = [head], float("nan")
    for row in rows:
        if "error" in row and "streaming" not in row:
            lines.append(f"| {row['server']} | {row['n']} | failed: {row['error']} "
                         "| | | | | | | |")
            continue
        all_ms = (f"{row['all_ms']:.0f} ({row['all_open']} of {row['all_n']})"
                  if "all_ms" in row else "-")
        lines.append(
            f"| {row['server']} | {row['n']} | {row.get('streaming', '-')} "
            f"| {row.get('first_p50', nan):.0f} / {row.get('first_p99', nan):.0f} "
            f"| {_ms(row.get('stop_p50'))} / {_ms(row.get('stop_p99'))} "
            f"| {all_ms} | {row.get('kept', '-')} | {row.get('cpu_ms', float('nan')):.1f} "
            f"| {row.get('rss_kib', float('nan')):.0f} | {row.get('cores', '-')} |"
            + (f" error: {row['error']}" if "error" in row else ""))
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> int:
    """The tables; exit status 1 if a server failed at the smallest N (a setup that does
    not work, not a limit reached)."""
    model = Model()
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    try:
        for n in args.n:
            for name in args.servers:  # interleaved: each N runs every server in turn
                if name in failed:
                    continue
                with tempfile.TemporaryDirectory(prefix=f"bench-served-{name}-") as workdir:
                    row = await measure(KINDS[name], model, n, min(args.stops, n), workdir)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if "error" in row or row.get("streaming", 0) < n:
                    failed.add(name)
        print()
        print(table(rows))
        if args.kill:
            print()
            for name in [s for s in args.servers if s not in MORE]:  # a fleet: not here
                with tempfile.TemporaryDirectory(prefix=f"bench-served-{name}-") as workdir:
                    print(f"kill -9 mid-run, {name}: {await crash(KINDS[name], model, workdir)}",
                          flush=True)
    finally:
        model.close()
    smallest = min(args.n)
    return int(any("error" in row for row in rows if row["n"] == smallest))


if __name__ == "__main__":
    if sys.argv[1:] == ["--model-server"]:
        model_server()
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", default="1,100,1000",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--servers", default=",".join(SERVERS),
                        type=lambda s: [x for x in s.split(",") if x])
    parser.add_argument("--stops", type=int, default=20, help="single Stops at each N")
    parser.add_argument("--kill", action="store_true", help="also kill -9 each server mid-run")
    parser.add_argument("--redis", default="", help="Redis URL: the aimu-fleet's control")
    options = parser.parse_args()
    REDIS = options.redis
    sys.exit(asyncio.run(main(options)))
