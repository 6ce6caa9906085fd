"""Fixtures for the HTTP attach mode: simulated vLLM API servers and a full exporter on
127.0.0.1 free ports. Every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from exporter.config import ServeConfig, resolve_config
from exporter.runtime import Exporter
from exporter.server import ADMIN_URL_KEY, EXPORTER_KEY, create_app
from exporter.sim.api_server import SimApiServer, sim_of, start_api_server

HOST = "127.0.0.1"


@dataclass
class ApiServer:
    url: str
    sim: SimApiServer
    runner: web.AppRunner


StartApi = Callable[..., Awaitable[ApiServer]]


@pytest.fixture
async def start_api() -> AsyncIterator[StartApi]:
    runners: list[web.AppRunner] = []

    async def start(**options: Any) -> ApiServer:
        runner, url = await start_api_server(HOST, 0, **options)
        runners.append(runner)
        return ApiServer(url, sim_of(runner), runner)

    yield start
    for runner in runners:
        await asyncio.wait_for(runner.cleanup(), 5)


@dataclass
class RunningExporter:
    exporter: Exporter
    url: str
    admin_url: str
    session: aiohttp.ClientSession

    async def metrics(self) -> str:
        async with self.session.get(f"{self.url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()

    async def status(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/status") as resp:
            assert resp.status == 200
            data: dict[str, Any] = await resp.json()
            return data

    async def poll(self) -> None:
        """Wait (bounded) for a poll that started after this call."""
        poller = self.exporter.poller
        after = poller.snapshot.poll_number
        # A poll may be running already; two more completed polls guarantee a fresh one.
        poller.poll_soon()
        await poller.wait_for_poll(after, 5)
        poller.poll_soon()
        await poller.wait_for_poll(after + 1, 5)


StartExporter = Callable[..., Awaitable[RunningExporter]]


def http_config(targets: list[str], **overrides: Any) -> ServeConfig:
    settings: dict[str, Any] = {
        "attach": "http",
        "http_target": tuple(targets),
        "listen": f"{HOST}:0",
        "admin_listen": f"{HOST}:0",
        "poll_interval": 30.0,
        "call_timeout": 2.0,
        "reset_min_interval": 0.0,
    }
    settings.update(overrides)
    return resolve_config(None, environ={}, **settings)


@pytest.fixture
async def start_exporter() -> AsyncIterator[StartExporter]:
    runners: list[web.AppRunner] = []
    sessions: list[aiohttp.ClientSession] = []

    async def start(config: ServeConfig, *, first_poll: bool = True) -> RunningExporter:
        app = create_app(config)
        runner = web.AppRunner(app, access_log=None)
        await asyncio.wait_for(runner.setup(), 10)
        runners.append(runner)
        site = web.TCPSite(runner, HOST, 0)
        await site.start()
        server = getattr(site, "_server", None)
        assert server is not None and server.sockets
        port = server.sockets[0].getsockname()[1]
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        sessions.append(session)
        exporter = app[EXPORTER_KEY]
        running = RunningExporter(exporter, f"http://{HOST}:{port}", app[ADMIN_URL_KEY], session)
        if first_poll:
            await exporter.poller.wait_for_poll(0, 5)
        return running

    yield start
    for session in sessions:
        await session.close()
    for runner in runners:
        await asyncio.wait_for(runner.cleanup(), 10)
