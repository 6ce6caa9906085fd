"""Simulated vLLM API servers (``exporter.sim.api_server``) for the HTTP attach mode, and the
exporter's config over them. 127.0.0.1, kernel-chosen ports; every wait is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exporter.config.settings import ServeConfig
from exporter.sim.api_server import SimApiServer, sim_of, start_api_server
from tests.harness.service import serve_config

HOST = "127.0.0.1"


@dataclass
class ApiServer:
    url: str
    sim: SimApiServer
    runner: web.AppRunner


StartApi = Callable[..., Awaitable[ApiServer]]


class ApiServers:
    """Starts API servers for one test (``start``) and stops them all at its end (``close``)."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []

    async def start(self, **options: Any) -> ApiServer:
        runner, url = await start_api_server(HOST, 0, **options)
        self.runners.append(runner)
        return ApiServer(url, sim_of(runner), runner)

    async def close(self) -> None:
        for runner in self.runners:
            await asyncio.wait_for(runner.cleanup(), 5)


def http_config(targets: list[str], **overrides: Any) -> ServeConfig:
    """HTTP attach mode over ``targets``; polls only when asked (``Service.fresh_poll``)."""
    settings: dict[str, Any] = {
        "attach": "http",
        "http_target": tuple(targets),
        "poll_interval": 30.0,
        "call_timeout": 2.0,
    }
    settings.update(overrides)
    return serve_config(**settings)
