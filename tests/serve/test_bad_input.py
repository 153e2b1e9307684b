"""Bad input and bad clients (issue 21, items 7, 8, 17): a short 4xx, nothing changed,
nothing leaked, no ERROR in the log.

Event ids that ``str.isdigit()`` took ('²'), JSON nested past the recursion limit, Redis
stream ids past 64 bits; a session lock held elsewhere (its path, pid, host or database
stay in the log); a client that sends its request a byte at a time, or leaves mid-body.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aimu.aio.errors import ControlConnectionError
from aimu.aio.store import PostgresStore, SQLiteStore
from aimu.serve.errors import answer, unavailable
from aimu.serve.slow_clients import DeadlineH11Protocol, DeadlineHttpToolsProtocol
from aimu.testing.server import LoopbackServer
from tests.serve.harness import (
    Served,
    collect,
    make_app,
    postgres_database,
    sse_events,
    start,
    uvicorn_serving,
)

JSON_BODY = {"Content-Type": "application/json"}


class Records(logging.Handler):
    """Every record of the server's loggers (Uvicorn's do not reach the root logger)."""

    NAMES = ("aimu", "uvicorn", "uvicorn.error", "uvicorn.access")

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= logging.ERROR]

    def text(self) -> str:
        return "\n".join(r.getMessage() for r in self.records)

    async def seen(self, words: str) -> None:
        """Wait until a record says ``words`` (the server reached that point)."""
        for _ in range(600):
            if words in self.text():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no log record says {words!r}: {self.text()}")


@pytest.fixture
def log() -> Iterator[Records]:
    handler = Records()
    loggers = [logging.getLogger(name) for name in Records.NAMES]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(handler)
            logger.setLevel(level)


async def expect_400(response: httpx.Response, words: str) -> None:
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["status"] == 400 and words in body["error"], body
    assert len(body["error"]) < 300


# -- event ids and JSON (item 17) -------------------------------------------------------------

LOCAL_BAD_IDS = [b"\xb2", b"1\xb2", "²".encode(), b"\xef\xbc\x91", b"-1", b"1-0", b"1e3",
                 b"0x1", b"9" * 13]
BAD_AFTER = ["%C2%B2", "%B2", "1%C2%B2", "%EF%BC%91", "-1", "1e3", "%201"]


async def test_bad_event_ids_are_400(http: httpx.AsyncClient) -> None:
    run_id = await start(http, "ids", "short 3")
    whole = await collect(http, run_id)
    for value in LOCAL_BAD_IDS:
        response = await http.get(f"/runs/{run_id}/events", headers={"Last-Event-ID": value})
        await expect_400(response, "Last-Event-ID")
    for after in BAD_AFTER:
        await expect_400(await http.get(f"/runs/{run_id}/events?after={after}"), "Last-Event-ID")
    assert [e.id for e in await collect(http, run_id)] == [e.id for e in whole]


@pytest.mark.parametrize("depth", [100_000, 5_000])
async def test_json_nested_deep_is_400(http: httpx.AsyncClient, depth: int) -> None:
    deep = b"[" * depth + b"]" * depth
    for body in (deep, b'{"task": ' + deep + b"}"):
        response = await http.post("/sessions/deep/runs", content=body, headers=JSON_BODY)
        assert response.status_code in (400, 422), response.text
        assert response.json()["status"] == response.status_code
    assert (await http.get("/sessions/deep")).status_code == 404


async def test_bogus_event_ids_with_redis_are_400(
    model_server: LoopbackServer, tmp_path: Path, redis_url: str
) -> None:
    shared = make_app(
        model_server, tmp_path / "s.db", redis=redis_url,
        redis_prefix=f"aimu_test_ids-{secrets.token_hex(4)}",
    )
    with uvicorn_serving(shared) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            run_id = await start(http, "ids", "short 3")
            whole = await collect(http, run_id)
            assert whole[-1].type == "handle_finished"
            bad = [b"\xb2", b"1-\xb2", b"\xb2-0", b"18446744073709551616-0",
                   b"1-18446744073709551616", b"99999999999999999999-0", b"12", b"1-", b"-1"]
            for value in bad:
                response = await http.get(
                    f"/runs/{run_id}/events", headers={"Last-Event-ID": value}
                )
                await expect_400(response, "Last-Event-ID")
            for after in BAD_AFTER:
                response = await http.get(f"/runs/{run_id}/events?after={after}")
                await expect_400(response, "Last-Event-ID")
            past = {"Last-Event-ID": "18446744073709551615-18446744073709551615"}
            await expect_400(await http.get(f"/runs/{run_id}/events", headers=past), "past")
            last = {"Last-Event-ID": whole[-1].id}
            assert [e async for e in sse_events(http, f"/runs/{run_id}/events", last)] == []
            tail = await collect(http, run_id, {"Last-Event-ID": whole[-3].id})
            assert [e.id for e in tail] == [e.id for e in whole[-2:]]


# -- 409 without a path, pid, host name or database (item 7) ----------------------------------


def leaks(text: str, *secrets_: str) -> list[str]:
    return [s for s in (*secrets_, str(os.getpid()), socket.gethostname()) if s and s in text]


async def test_a_locked_session_is_409_with_the_details_in_the_log(
    http: httpx.AsyncClient, served: Served, log: Records
) -> None:
    async with SQLiteStore(served.store) as store:
        writer = await store.open_session("held")
        try:
            for response in (
                await http.post("/sessions/held/runs", json={"task": "x"}),
                await http.post("/sessions/held/resume"),
                await http.delete("/sessions/held"),
            ):
                assert response.status_code == 409, response.text
                error = response.json()["error"]
                assert "session 'held' is open for writing elsewhere" in error
                assert leaks(response.text, str(served.store.parent), ".lock") == []
        finally:
            await writer.aclose()
    assert str(served.store.parent) in log.text()  # the operator still learns where


async def test_a_locked_postgres_session_is_409_naming_no_database(
    model_server: LoopbackServer, log: Records
) -> None:
    async with postgres_database() as url:
        database = url.rsplit("/", 1)[1]
        store = PostgresStore(url)
        try:
            writer = await store.open_session("held")
            with uvicorn_serving(make_app(model_server, url)) as base:
                async with httpx.AsyncClient(base_url=base, timeout=20) as http:
                    for response in (
                        await http.post("/sessions/held/runs", json={"task": "x"}),
                        await http.delete("/sessions/held"),
                    ):
                        assert response.status_code == 409, response.text
                        assert leaks(response.text, database, ":5432", "127.0.0.1",
                                     "localhost", "advisory") == []
            await writer.aclose()
        finally:
            await store.aclose()
    assert database in log.text()


# -- slow clients and clients that leave (item 8) --------------------------------------------


class QuickH11(DeadlineH11Protocol):
    request_seconds = 0.3


class QuickHttpTools(DeadlineHttpToolsProtocol):
    request_seconds = 0.3


#: Both of Uvicorn's HTTP/1.1 protocols as aimu serve runs them: each test of slow and
#: malformed clients holds for either.
@pytest.fixture(params=[QuickH11, QuickHttpTools], ids=["h11", "httptools"])
def quick(request: pytest.FixtureRequest) -> type[asyncio.Protocol]:
    protocol: type[asyncio.Protocol] = request.param
    return protocol


def until_closed(sock: socket.socket) -> bytes:
    sock.settimeout(60)  # a bound on a hung test, not a timing: the server closes first
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def one_answer(sock: socket.socket) -> bytes:
    """Read one whole response (it has a content-length) off a kept-alive connection;
    its head."""
    sock.settimeout(60)  # a bound on a hung test, as above
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data + body!r}"
        body += chunk
    assert len(body) == length, "no more than the one answer"
    return head


def address_of(url: str) -> tuple[str, int]:
    return ("127.0.0.1", int(url.rsplit(":", 1)[1]))


def nothing_private(answer: bytes) -> None:
    """An error answer names no path, process or host of the server."""
    for private in (str(Path.cwd()), str(Path(__file__).parent), f"pid {os.getpid()}",
                    str(os.getpid()), socket.gethostname()):
        assert private.encode() not in answer.partition(b"\r\n\r\n")[2], answer


async def test_slow_clients_are_cut_off_and_event_streams_are_not(
    model_server: LoopbackServer, tmp_path: Path, log: Records, quick: type[asyncio.Protocol]
) -> None:
    with uvicorn_serving(make_app(model_server, tmp_path / "s.db"), quick) as url:

        def connect() -> socket.socket:
            return socket.create_connection(address_of(url))

        async with httpx.AsyncClient(base_url=url, timeout=20) as http:
            run_id = await start(http, "streamed", "long tale")
            events = sse_events(http, f"/runs/{run_id}/events")
            async for event in events:
                if event.type == "text":
                    break

            # Nothing at all, then half a head, then half a body: each answered with the
            # 408's JSON body and closed.
            with connect() as idle:
                answer = until_closed(idle)
                assert answer.startswith(b"HTTP/1.1 408 "), answer
                assert json.loads(answer.partition(b"\r\n\r\n")[2])["status"] == 408
                nothing_private(answer)
            # ... so the stream has now been open longer than a request may take.
            with connect() as slow:
                slow.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                assert until_closed(slow).startswith(b"HTTP/1.1 408 ")
            with connect() as slow_body:
                slow_body.sendall(
                    b"POST /sessions/slow/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"task\""
                )
                assert until_closed(slow_body).startswith(b"HTTP/1.1 408 ")

            async for event in events:  # the event stream goes on
                if event.type == "text":
                    break
            await events.aclose()
            await http.post(f"/runs/{run_id}/cancel")
            assert (await collect(http, run_id))[-1].data["status"] == "cancelled"
            # The route reading the slow body saw its client gone: no run was started.
            assert (await http.get("/sessions/slow")).status_code == 404
            # A request that arrives whole on a kept-alive connection is unaffected.
            assert (await http.get("/health")).status_code == 200
    assert log.errors() == []


async def test_each_request_on_a_kept_alive_connection_has_its_own_deadline(
    model_server: LoopbackServer, tmp_path: Path, log: Records, quick: type[asyncio.Protocol]
) -> None:
    health = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    with (
        uvicorn_serving(make_app(model_server, tmp_path / "s.db"), quick) as url,
        socket.create_connection(address_of(url)) as kept,
    ):
        kept.sendall(health + b"\r\n")
        assert one_answer(kept).startswith(b"HTTP/1.1 200 ")
        # A connection opened after it is cut off: the kept one is now older than a
        # request may take, and idle between requests, which no deadline times.
        with socket.create_connection(address_of(url)) as idle:
            assert until_closed(idle).startswith(b"HTTP/1.1 408 ")
        kept.sendall(health + b"\r\n")
        assert one_answer(kept).startswith(b"HTTP/1.1 200 ")
        # The next request's deadline runs from its first byte: half a head is a 408.
        kept.sendall(health)
        answer = until_closed(kept)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["status"] == 408
    assert log.errors() == []


async def test_a_client_leaving_mid_body_logs_no_error(
    model_server: LoopbackServer, tmp_path: Path, log: Records, quick: type[asyncio.Protocol]
) -> None:
    with uvicorn_serving(make_app(model_server, tmp_path / "s.db"), quick) as url:
        with socket.create_connection(address_of(url)) as gone:
            gone.sendall(
                b"POST /sessions/left/runs HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"task\": \"x"
            )
        await log.seen("disconnected before sending its body")
        async with httpx.AsyncClient(base_url=url) as http:
            assert (await http.get("/sessions/left")).status_code == 404
    assert log.errors() == []


@pytest.mark.parametrize("head", [
    b"GET /runs/r HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-length: Ue~\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx: \x00\r\n\r\n",
], ids=["content-length not a number", "header without a colon", "a NUL in a header"])
async def test_a_request_too_malformed_to_route_is_400_with_the_json_error_body(
    model_server: LoopbackServer, tmp_path: Path, quick: type[asyncio.Protocol], head: bytes
) -> None:
    with uvicorn_serving(make_app(model_server, tmp_path / "s.db"), quick) as url:
        with socket.create_connection(address_of(url)) as client:
            client.sendall(head)
            answer = until_closed(client)
        status, _, rest = answer.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        assert status == b"HTTP/1.1 400 Bad Request", answer
        assert b"content-type: application/json" in headers.lower(), answer
        said = json.loads(body)
        assert said == {"error": said["error"], "status": 400} and said["error"], said
        nothing_private(answer)
        async with httpx.AsyncClient(base_url=url) as http:  # the server goes on
            assert (await http.get("/health")).status_code == 200


# -- a store out of connections (item 16) -----------------------------------------------------


async def test_a_store_out_of_connections_is_503_saying_what_ran_out(
    model_server: LoopbackServer, log: Records
) -> None:
    async with postgres_database() as url:
        database = url.rsplit("/", 1)[1]
        store = PostgresStore(url, max_writers=1)
        application = make_app(model_server, store)
        application._closers.append(store.aclose)  # on the server's loop, which used it
        with uvicorn_serving(application) as base:
            async with httpx.AsyncClient(base_url=base, timeout=20) as http:
                run_id = await start(http, "first", "long tale")  # holds the one writer
                events = sse_events(http, f"/runs/{run_id}/events")
                async for event in events:
                    if event.type == "text":
                        break
                await events.aclose()
                response = await http.post("/sessions/second/runs", json={"task": "x"})
                assert response.status_code == 503, response.text
                assert response.headers["retry-after"] == "5"
                error = response.json()["error"]
                assert "ran out of connections: the 1 writer connections" in error
                assert leaks(response.text, database, ":5432", "127.0.0.1") == []
                await http.post(f"/runs/{run_id}/cancel")
                assert (await collect(http, run_id))[-1].data["status"] == "cancelled"
                again = await start(http, "second", "x")  # free again
                assert (await collect(http, again))[-1].data["status"] == "completed"
    assert "max_writers" in log.text()


def test_a_control_that_failed_is_503_naming_no_address(log: Records) -> None:
    url = "redis://:hunter2@10.9.8.7:6390/0"
    error = ControlConnectionError(f"cannot reach Redis at {url}: refused", url=url)
    told = answer(unavailable("list the runs", error))
    assert told.status == 503 and "cannot list the runs" in told.message
    assert leaks(told.message, "10.9.8.7", "6390", "hunter2") == []
    assert "10.9.8.7" in log.text()  # the operator still learns where
