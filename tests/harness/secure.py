"""The real service as ``serve`` starts it (``exporter.web.app.start_service``: both listeners,
TLS and basic auth from a web config) over in-process simulated engines, for tests of clients
against the secure listeners. Loopback only, kernel-chosen ports, every wait bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import zmq.asyncio

from exporter.config.settings import ServeConfig
from exporter.sim.options import SimOptions
from exporter.web.app import RunningService, start_service
from tests.harness.service import WAIT_S, RecordingSimEngine, make_config
from tests.harness.waiting import eventually


@dataclass
class SecureFleet:
    """A started service (``url`` and ``admin_url`` are ``https://...`` with TLS) and its
    engines."""

    config: ServeConfig
    running: RunningService
    context: zmq.asyncio.Context
    engines: list[RecordingSimEngine] = field(default_factory=list)
    tasks: list[asyncio.Task[str]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def admin_url(self) -> str:
        assert self.running.admin_url is not None
        return self.running.admin_url

    async def stop(self) -> None:
        for engine in self.engines:
            engine.options.shutdown_window_s = 0.0
            engine.stop()
        if self.tasks:
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), WAIT_S)
        await asyncio.wait_for(self.running.stop(), 15)
        self.context.term()


class SecureFleets:
    """Builds secure fleets for one test and stops them all at its end (``close``)."""

    def __init__(self) -> None:
        self.made: list[SecureFleet] = []

    async def build(
        self,
        engine_count: int,
        *,
        options: SimOptions | None = None,
        per_engine: Mapping[str, Mapping[int, Any]] | None = None,
        **settings: Any,
    ) -> SecureFleet:
        """``start_service`` of an owner-mode config (``web_config_file=...``,
        ``admin_token_file=...``) with ``engine_count`` engines, ready."""
        config = make_config(engine_count, **settings)
        running = await start_service(config)
        fleet = SecureFleet(config, running, zmq.asyncio.Context())
        self.made.append(fleet)
        for index in range(engine_count):
            opts = replace(options or SimOptions())
            for name, by in (per_engine or {}).items():
                if index in by:
                    setattr(opts, name, by[index])
            engine = RecordingSimEngine(
                config.handshake_address, index, opts, context=fleet.context
            )
            fleet.engines.append(engine)
            fleet.tasks.append(asyncio.create_task(engine.run()))
        await eventually(lambda: running.exporter.poller.snapshot.ready, what="a ready fleet")
        return fleet

    async def close(self) -> None:
        for fleet in reversed(self.made):
            await fleet.stop()
