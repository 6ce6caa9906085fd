"""Fixtures of the HTTP attach mode (the harness: ``tests/harness/apiservers.py`` and
``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

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
