"""Fixtures of the service tests (the harness: ``tests/harness/service.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.service import ServiceFactory, Services


@pytest.fixture
async def fleet_factory() -> AsyncIterator[ServiceFactory]:
    """``await fleet_factory(n, start=True, audit=None, **config)`` → a running ``Service``
    whose engines have handshaken and whose fleet is ready (``start=False``: no engines yet).

    With ``audit`` (a callable), the admin app is served by the test with that audit sink
    instead of the server's own listener (``create_admin_app(exporter, audit=...)``).
    """
    services = Services(start=True)
    yield services.build
    await services.close()
