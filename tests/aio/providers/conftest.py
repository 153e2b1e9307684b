"""Every client a provider test made through ``closed_after_test`` is closed when it ends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from provider_support import MADE


@pytest.fixture(autouse=True)
async def _clients_closed() -> AsyncIterator[None]:
    yield
    while MADE:
        await MADE.pop().aclose()
