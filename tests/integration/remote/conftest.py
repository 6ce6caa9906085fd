"""Fixtures of the ``exporter.remote`` suite (the harness: ``tests/harness/service.py`` and
``tests/harness/secure.py``; certificates: ``tests/harness/tls.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from tests.harness.apiservers import ApiServer, ApiServers, http_config
from tests.harness.secure import SecureFleets
from tests.harness.service import Service, ServiceFactory, Services
from tests.harness.tls import Pki, make_pki


@pytest.fixture
async def fleet() -> AsyncIterator[ServiceFactory]:
    """``await fleet(n, options=..., per_engine=..., **config)`` → a ready owner-mode fleet
    (``start=False``: no engines)."""
    services = Services(start=True)
    yield services.build
    await services.close()


@pytest.fixture
async def secure_fleets() -> AsyncIterator[SecureFleets]:
    """``await secure_fleets.build(n, web_config_file=..., ...)`` → a ready fleet served as
    ``serve`` serves it (TLS and basic auth from the web config)."""
    fleets = SecureFleets()
    yield fleets
    await fleets.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


AppServer = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve_app() -> AsyncIterator[AppServer]:
    """``await serve_app(app)`` → ``http://127.0.0.1:<port>``: a stand-in for an exporter
    (hostile, failing, redirecting) on a kernel-chosen loopback port, stopped at the end."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def http_fleet() -> AsyncIterator[tuple[Service, list[ApiServer]]]:
    """HTTP mode over two simulated API servers of one engine each (targets ``0`` and ``1``):
    vLLM's ``/metrics`` publishes each one's running and waiting requests."""
    apis, services = ApiServers(), Services(start=False)
    try:
        servers = [await apis.start(engines=1), await apis.start(engines=1)]
        svc = await services.serve(http_config([s.url for s in servers], gate_min_interval=0.0))
        yield svc, servers
    finally:
        await services.close()
        await apis.close()
