"""Tools the worker processes of the Temporal tests import with ``--tool``."""

from __future__ import annotations

import os
import time
from pathlib import Path


def charge(amount: int) -> str:
    """Charge the card: not idempotent. Each call appends this process's pid to the file
    ``$AIMU_TEST_CHARGES`` (the side effect, durable), then waits until the file
    ``$AIMU_TEST_GATE`` exists, so a test can kill the worker inside the call."""
    with open(os.environ["AIMU_TEST_CHARGES"], "a", encoding="utf-8") as charges:
        charges.write(f"{os.getpid()}\n")
        charges.flush()
        os.fsync(charges.fileno())
    gate = Path(os.environ["AIMU_TEST_GATE"])
    while not gate.exists():
        time.sleep(0.02)
    return f"charged {amount}"
