"""A page of run records: the checked arguments of :meth:`Store.runs` and the one
implementation of its signature, which every store's :meth:`RunPages._runs` reads."""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aimu.aio.store._protocol import (
    MAX_RUNS_PAGE,
    RUN_COLUMNS,
    RunRecord,
    RunRecordStatus,
    check_run_id,
    check_run_status,
    validate_session_name,
)

__all__ = ["RunPages", "RunsPage", "runs_page", "runs_query", "unknown_run"]


@dataclass(frozen=True, slots=True)
class RunsPage:
    """The checked arguments of :meth:`Store.runs` (see :func:`runs_page`)."""

    session: str | None
    status: RunRecordStatus | None
    limit: int
    before: str | None
    recover: bool | None


def runs_page(
    session: str | None, status: str | None, limit: int, before: str | None,
    recover: bool | None,
) -> RunsPage:
    """Check the arguments of :meth:`Store.runs` (``ValueError`` naming the bad one)."""
    if session is not None:
        validate_session_name(session)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_RUNS_PAGE:
        raise ValueError(f"limit must be an int from 1 to {MAX_RUNS_PAGE}, got {limit!r:.50}")
    return RunsPage(
        session,
        None if status is None else check_run_status(status),
        limit,
        None if before is None else check_run_id(before),
        recover,
    )


class RunPages(abc.ABC):
    """:meth:`Store.runs` of every store: the arguments checked in one place, the page
    read by the store's :meth:`_runs`."""

    async def runs(
        self,
        session: str | None = None,
        status: str | None = None,
        limit: int = 100,
        before: str | None = None,
        *,
        recover: bool | None = None,
    ) -> list[RunRecord]:
        return await self._runs(runs_page(session, status, limit, before, recover))

    @abc.abstractmethod
    async def _runs(self, page: RunsPage) -> list[RunRecord]:
        """The records of ``page``, the latest started first (see :meth:`Store.runs`)."""


def runs_query(table: str, page: RunsPage, mark: Callable[[int], str]) -> tuple[str, list[Any]]:
    """The SQL (and its parameters) of :meth:`Store.runs` on ``table``; ``mark(n)`` is
    the driver's placeholder for the n-th parameter (from 1)."""
    where: list[str] = []
    parameters: list[Any] = []

    def add(clause: str, *values: Any) -> None:
        marks = [mark(len(parameters) + i + 1) for i in range(len(values))]
        where.append(clause.format(*marks))
        parameters.extend(values)

    if page.session is not None:
        add("session = {}", page.session)
    if page.status is not None:
        add("status = {}", page.status)
    if page.recover is not None:
        add("recover = {}", bool(page.recover))
    if page.before is not None:
        add(f"(started, id) < (SELECT started, id FROM {table} WHERE id = {{}})", page.before)
    sql = f"SELECT {', '.join(RUN_COLUMNS)} FROM {table}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    parameters.append(page.limit)
    sql += f" ORDER BY started DESC, id DESC LIMIT {mark(len(parameters))}"
    return sql, parameters


def unknown_run(run_id: str) -> ValueError:
    """The error of :meth:`Store.runs` for a ``before`` that names no run."""
    return ValueError(f"unknown run id {run_id!r}: no run has it (before= takes a run's id)")
