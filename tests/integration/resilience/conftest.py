"""Fixtures of the fault-injection suite (the harness: ``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.service import ServiceFactory, Services


@pytest.fixture
async def service_factory() -> AsyncIterator[ServiceFactory]:
    """``await service_factory(n, guarded=False, **config)`` → a running ``Service`` (engines
    not started)."""
    services = Services(start=False)
    yield services.build
    await services.close()
