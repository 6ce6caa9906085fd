"""Fixtures of the RL-invariant suite (the harness: ``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.service import ServiceFactory, Services


@pytest.fixture
async def rl_fleet() -> AsyncIterator[ServiceFactory]:
    """``await rl_fleet(n, options=..., per_engine=..., **config)`` → a ready owner-mode fleet."""
    services = Services(start=True)
    yield services.build
    await services.close()
