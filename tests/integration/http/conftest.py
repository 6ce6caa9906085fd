"""Fixtures of the HTTP attach mode (the harness: ``tests/harness/apiservers.py`` and
``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from exporter.client.http.client import HttpFleetClient
from tests.harness.apiservers import ApiServers, StartApi
from tests.harness.service import ServiceFactory, Services


@pytest.fixture
async def start_api() -> AsyncIterator[StartApi]:
    """``await start_api(**options)`` → a running simulated API server."""
    servers = ApiServers()
    yield servers.start
    await servers.close()


@pytest.fixture
async def start_exporter() -> AsyncIterator[ServiceFactory]:
    """``await start_exporter(config, first_poll=True)`` → the exporter served over HTTP."""
    services = Services(start=False)
    yield services.serve
    await services.close()


@pytest.fixture
async def clients() -> AsyncIterator[list[HttpFleetClient]]:
    """A list to append ``HttpFleetClient``s to; each is closed at the end of the test."""
    made: list[HttpFleetClient] = []
    yield made
    for c in made:
        await c.close()
