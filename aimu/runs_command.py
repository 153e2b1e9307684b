"""``aimu runs list|show|cancel|resume``: the run records of a store, from a terminal.

The store is a SQLite file, a JSONL directory (``jsonl:DIR``, or a directory that
exists) or a ``postgresql://`` URL; by default the store of ``aimu chat`` and ``aimu
serve`` (``$AIMU_HOME/sessions.db``). ``list`` and ``show`` only read: nothing is created
or changed. ``cancel`` reaches a live run through Redis or Temporal (``--redis``,
``--temporal``, as ``aimu serve`` and its workers share them), and ``list`` and ``show``
put each run's live state there beside its record. ``resume`` starts a run that resumes
a run's session on Temporal's workers (``--temporal``), or marks the run in the store to
be resumed, as a drain does, by a server that recovers runs (``aimu serve --recover``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Awaitable
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from aimu.aio.ends import ANSWERED
from aimu.aio.errors import ControlError, SessionLockedError, StoreError, UnknownRunError
from aimu.aio.store import RunRecord, Store

if TYPE_CHECKING:
    from aimu.aio.control import RunInfo
    from aimu.temporal import RunsClient

__all__ = ["add_runs_options", "run_runs"]


def add_runs_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="runs_action", metavar="ACTION", required=True)
    listing = actions.add_parser(
        "list", help="the runs, the latest started first",
        description="List the store's runs, the latest started first. A run whose process "
        "died stays 'running'.",
    )
    _add_store(listing)
    listing.add_argument("--session", help="only this session's runs")
    listing.add_argument("--status", help="only runs with this status (running, completed, ...)")
    listing.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    listing.add_argument("--before", metavar="RUN_ID", help="the runs started before this one")
    listing.add_argument("--json", action="store_true", help="print JSON, as GET /runs does")
    _add_live(listing, required=False)
    show = actions.add_parser("show", help="one run's record as JSON")
    _add_store(show)
    show.add_argument("run_id", help="the run's id (from aimu runs list)")
    _add_live(show, required=False)
    cancel = actions.add_parser(
        "cancel", help="cancel a live run through Redis or Temporal",
        description="Cancel a run wherever it runs: through the Redis that aimu serve --redis "
        "and its workers share, or the Temporal that runs it (aimu serve --temporal). Exit 0 "
        "if it was cancelled, 1 if it had already ended or is unknown.",
    )
    cancel.add_argument("run_id", help="the run's id")
    _add_live(cancel, required=True)
    cancel.add_argument("--reason", help="why, as the run's record and events will say")
    resume = actions.add_parser(
        "resume", help="resume a run's session: on Temporal's workers, or by --recover servers",
        description="With --temporal, start a run that resumes the session of RUN_ID where "
        "it stopped, on the workers of a Temporal task queue (aimu serve --temporal, aimu "
        "worker), and print the new run's id. Without it, mark RUN_ID in the store to be "
        "resumed: a server started with --recover on that store goes on with it within "
        "seconds (as with a run a drain stopped). Exit 1 if the run cannot go on (it "
        "answered, waits for a decision, its session went on or is in use).",
    )
    resume.add_argument("run_id", help="the run whose session to resume")
    _add_store(resume)
    resume.add_argument("--temporal", metavar="HOST:PORT", help="the Temporal frontend")
    _add_temporal(resume)


def _add_live(parser: argparse.ArgumentParser, *, required: bool) -> None:
    """--redis or --temporal: where the live runs are (for list and show, their live
    state beside each record)."""
    where = parser.add_mutually_exclusive_group(required=required)
    where.add_argument("--redis", metavar="URL", help="redis://host:port/db")
    where.add_argument("--temporal", metavar="HOST:PORT", help="the Temporal frontend")
    parser.add_argument(
        "--redis-prefix", default="aimu", help="the key prefix in Redis (default aimu)"
    )
    _add_temporal(parser)


def _add_temporal(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task-queue", default="aimu", help="the runs' Temporal task queue (default aimu)"
    )
    parser.add_argument("--namespace", default="default", help="the Temporal namespace")


def _add_store(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store",
        help="a SQLite file, jsonl:DIR or a postgresql:// URL (default: sessions.db in "
        "$AIMU_HOME, else in ~/.aimu)",
    )


def run_runs(options: argparse.Namespace, out: IO[str] | None = None) -> int:
    """``aimu runs ...``: 0 when done; 1 with one line for a store that fails or a run
    that is not there; 2 for bad input (an unknown status, a bad run id)."""
    out = out or sys.stdout
    try:
        return asyncio.run(_run(options, out))
    except ValueError as error:
        print(f"aimu runs: {error}", file=sys.stderr)
        return 2
    except (StoreError, ControlError) as error:
        print(f"aimu runs: {error}", file=sys.stderr)
        return 1


def open_existing(spec: str | None) -> Store:
    """The store ``spec`` names, which must exist (``ValueError`` if it does not)."""
    if spec is not None and spec.startswith(("postgres://", "postgresql://")):
        from aimu.aio.store import PostgresStore

        return PostgresStore(spec)
    if spec is None:
        from aimu.assistant import default_home

        path = default_home() / "sessions.db"
    else:
        path = Path(spec.removeprefix("jsonl:"))
    if not path.exists():
        raise ValueError(f"no store at {path}")
    if (spec is not None and spec.startswith("jsonl:")) or path.is_dir():
        from aimu.aio.store import JSONLStore

        return JSONLStore(path)
    from aimu.aio.store import SQLiteStore

    return SQLiteStore(path)


async def _temporal(options: argparse.Namespace) -> RunsClient:
    from aimu.temporal import RunsClient

    return await RunsClient.connect(
        options.temporal, options.task_queue, namespace=options.namespace
    )


async def _resume(options: argparse.Namespace, out: IO[str]) -> int:
    if options.temporal is not None:
        client = await _temporal(options)
        print(await client.resume(options.run_id), file=out)
        return 0
    store = open_existing(options.store)
    try:
        return await _mark(store, options.run_id, out)
    finally:
        await store.aclose()


#: Why a run with this status cannot be marked to go on.
_CANNOT_GO_ON: Final[dict[str, str]] = {
    **{status: f"it ended with an answer ({status})" for status in ANSWERED},
    "paused": "its tool calls wait for a decision (approve or deny them; that resumes it)",
}


async def _mark(store: Store, run_id: str, out: IO[str]) -> int:
    """Mark ``run_id`` to be resumed by a recovering server (as a drain marks a run),
    under its session's write lock: a live run's session cannot be taken."""
    found = await store.run(run_id)
    if found is None:
        return _fail(f"no run {run_id!r} in the store")
    try:
        writer = await store.open_session(found.session)
    except SessionLockedError:
        return _fail(f"run {run_id!r}: session {found.session!r} is in use by a live "
                     "process; cancel or interrupt its run first")
    try:
        record = await store.run(run_id) or found  # again, now that the session is held
        latest = await store.runs(session=record.session, limit=1)
        why = _CANNOT_GO_ON.get(record.status)
        if record.parent is not None:
            why = f"it ran for an agent called as a tool: resume its parent run {record.parent}"
        elif latest and latest[0].id != run_id:
            why = f"its session went on with run {latest[0].id}: resume that one"
        if why is not None:
            return _fail(f"run {run_id!r} cannot go on: {why}")
        await writer.record_run(dataclasses.replace(record, recover=True))
    finally:
        await writer.aclose()
    print(f"run {run_id} marked to be resumed: a server started with --recover on this "
          "store goes on with it", file=out)
    return 0


def _fail(message: str) -> int:
    print(f"aimu runs: {message}", file=sys.stderr)
    return 1


async def _live(options: argparse.Namespace, run_ids: list[str]) -> dict[str, str | None]:
    """Each run's state where it runs live, with --redis or --temporal (None: not known
    there); {} without either."""
    if getattr(options, "redis", None) is not None:
        from aimu.aio.control import RedisControl

        async with RedisControl(options.redis, options.redis_prefix) as control:
            return {run_id: await _known(control.status(run_id)) for run_id in run_ids}
    if getattr(options, "temporal", None) is not None:
        client = await _temporal(options)
        # after=maxsize: the run's state without its events
        return {run_id: await _known(client.status(run_id, after=sys.maxsize))
                for run_id in run_ids}
    return {}


async def _known(state: Awaitable[RunInfo | dict[str, Any]]) -> str | None:
    try:
        found = await state
    except UnknownRunError:
        return None
    return str(found["status"] if isinstance(found, dict) else found.status)


async def _cancel(options: argparse.Namespace, out: IO[str]) -> int:
    if options.temporal is not None:
        cancelled = await (await _temporal(options)).cancel(options.run_id, options.reason)
    else:
        from aimu.aio.control import RedisControl

        async with RedisControl(options.redis, options.redis_prefix) as control:
            cancelled = await control.cancel(options.run_id, options.reason)
    if cancelled:
        print(f"run {options.run_id} cancelled", file=out)
        return 0
    print(f"aimu runs: run {options.run_id!r} had already ended", file=sys.stderr)
    return 1


async def _run(options: argparse.Namespace, out: IO[str]) -> int:
    if options.runs_action == "cancel":
        return await _cancel(options, out)
    if options.runs_action == "resume":
        return await _resume(options, out)
    store = open_existing(options.store)
    try:
        if options.runs_action == "show":
            record = await store.run(options.run_id)
            if record is None:
                return _fail(f"no run {options.run_id!r} in the store")
            shown = record.to_json()
            live = await _live(options, [record.id])
            if live:
                shown["live"] = live[record.id]
            print(json.dumps(shown, indent=2), file=out)
            return 0
        found = await store.runs(options.session, options.status, options.limit, options.before)
    finally:
        await store.aclose()
    live = await _live(options, [r.id for r in found])
    if options.json:
        next_before = found[-1].id if len(found) == options.limit else None
        runs = [r.to_json() | ({"live": live[r.id]} if live else {}) for r in found]
        print(json.dumps({"runs": runs, "next_before": next_before}), file=out)
    elif not found:
        print("no runs", file=out)
    else:
        _table(found, live, out)
    return 0


def _table(found: list[RunRecord], live: dict[str, str | None], out: IO[str]) -> None:
    """One row a run; with live states, a LIVE column after STATUS ("-": not known)."""
    rows = [
        (r.id, r.session, r.status, *([live[r.id] or "-"] if live else []),
         _time(r.started), "" if r.ended is None else f"{r.ended - r.started:.1f}s",
         r.reason or "")
        for r in found
    ]
    heads = ("ID", "SESSION", "STATUS", *(["LIVE"] if live else []), "STARTED", "TOOK",
             "REASON")
    widths = [max(len(row[i]) for row in (heads, *rows)) for i in range(len(heads) - 1)]
    for row in (heads, *rows):
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
        print("  ".join([*cells, row[-1]]).rstrip(), file=out)


def _time(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S")
