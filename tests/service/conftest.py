"""Fixtures for the service tests (helpers live in ``service_support.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from service_support import Fleet, FleetFactory, make_config

from exporter.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.runtime import Exporter
from exporter.server import ADMIN_URL_KEY, create_app
from exporter.sim.engine import SimOptions


@pytest.fixture
async def fleet_factory() -> AsyncIterator[FleetFactory]:
    """``await fleet_factory(n, start=True, audit=None, **config)`` → a running ``Fleet``.

    With ``audit`` (a callable), the admin app is served by the test with that audit sink
    instead of the server's own listener (``create_admin_app(exporter, audit=...)``).
    """
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def build(
        engine_count: int = 2,
        *,
        start: bool = True,
        audit: Callable[[dict[str, Any]], None] | None = None,
        options: SimOptions | None = None,
        per_engine: dict[str, dict[int, Any]] | None = None,
        **overrides: Any,
    ) -> Fleet:
        if audit is not None:
            overrides["admin_listen"] = "off"
        config = make_config(engine_count, **overrides)
        exporter = Exporter(config)
        app = create_app(config, exporter)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        context = zmq.asyncio.Context()
        fleet = Fleet(config, exporter, app, f"http://127.0.0.1:{port}", context)
        fleet.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        fleet.admin_url = app.get(ADMIN_URL_KEY)
        admin_runner: web.AppRunner | None = None
        if audit is not None:
            admin_app = create_admin_app(exporter, audit=audit)
            admin_runner = web.AppRunner(admin_app, access_log=None, shutdown_timeout=0.5)
            await admin_runner.setup()
            admin_site = web.TCPSite(admin_runner, "127.0.0.1", 0)
            await admin_site.start()
            fleet.admin_url = f"http://127.0.0.1:{admin_runner.addresses[0][1]}"

        async def cleanup() -> None:
            assert fleet.session is not None
            await fleet.session.close()
            await fleet.stop_engines()
            if admin_runner is not None:
                await admin_runner.app[ADMIN_SHUTDOWN_KEY]()
                await admin_runner.cleanup()
            await runner.cleanup()
            context.term()

        cleanups.append(cleanup)
        if start:
            await fleet.start_engines(options, **(per_engine or {}))
            await fleet.ready()
        return fleet

    yield build
    for cleanup in reversed(cleanups):
        await asyncio.wait_for(cleanup(), 15)
