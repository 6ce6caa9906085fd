"""Suite-wide fixtures; they only wire the helpers of ``tests/harness/``.

The fixtures of one tier or topic live in that directory's ``conftest.py``; a fixture used in
more than one tier lives here (``fleet_factory``: ``tests/integration/service/`` and the
browser test in ``tests/system/browser/``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.harness.service import ServiceFactory, Services
from tests.harness.wire import load_vectors


@pytest.fixture
def vectors() -> dict[str, bytes]:
    """Vector name → bytes of ``tests/data/engine-core.json``."""
    return dict(load_vectors())


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
