"""The old home of :class:`~aimu.serve.slow_clients.DeadlineH11Protocol` (kept so
``from aimu.serve.connections import DeadlineH11Protocol`` goes on working)."""

from aimu.serve.slow_clients import DeadlineH11Protocol

__all__ = ["DeadlineH11Protocol"]
