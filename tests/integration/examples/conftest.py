"""Fixtures of the examples' tests: simulated API servers (``tests/harness/apiservers.py``)
beside the exporter's service (``fleet_factory``, ``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.apiservers import ApiServers, StartApi


@pytest.fixture
async def start_api() -> AsyncIterator[StartApi]:
    """``await start_api(**options)`` → a running simulated API server."""
    servers = ApiServers()
    yield servers.start
    await servers.close()
