"""Relay mode: a simulated stock front end, the relay exporter, simulated engines.

Everything runs in the test's event loop on real ZMQ sockets bound to free 127.0.0.1 ports;
every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from exporter.base.faults import ProtocolErrorTally
from exporter.base.ports import free_listen_port
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import EngineOutcome
from exporter.client.observe import counters_of
from exporter.client.relay.transport import RelayTransport
from exporter.config.settings import ServeConfig
from exporter.control.attach import build_fleet
from exporter.metrics.stats import Stats
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions


@dataclass
class Relay:
    """One relay exporter: the FleetClient, its transport, tally and stats."""

    client: EngineCoreClient
    faults: ProtocolErrorTally
    stats: Stats

    @property
    def transport(self) -> RelayTransport:
        return cast(RelayTransport, self.client.transport)

    @property
    def handshakes(self) -> Counter[str]:
        """Relayed handshakes by result (``vllm_dp_relay_handshakes_total``; 0 when none)."""
        return Counter(counters_of(self.client.observations)["vllm_dp_relay_handshakes_total"])

    async def call(
        self, method: str = "is_sleeping", timeout_s: float = 1.0
    ) -> list[EngineOutcome]:
        return await self.client.call_utility(method, timeout_s=timeout_s)


@dataclass
class RelayHarness:
    """A simulated stock front end, relay exporters (the last one is ``relay``) and simulated
    engines, for one test."""

    engine_count: int
    tmp_path: Path
    frontend_address: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_listen_port()}")
    relay_address: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_listen_port()}")
    frontend: SimFrontend | None = None
    relays: list[Relay] = field(default_factory=list)
    engines: list[SimEngine] = field(default_factory=list)
    engine_tasks: list[asyncio.Task[str]] = field(default_factory=list)

    @property
    def relay(self) -> Relay:
        return self.relays[-1]

    @property
    def fe(self) -> SimFrontend:
        assert self.frontend is not None
        return self.frontend

    async def start_frontend(
        self,
        *,
        call_loop: bool = True,
        coordinator: Callable[[], list[Any] | bytes] | None = None,
    ) -> SimFrontend:
        """The stock front end; with ``coordinator`` also vLLM's DP coordinator publishing
        what it returns (each engine's (running, waiting))."""
        self.frontend = SimFrontend(
            self.frontend_address, self.engine_count, coordinator=coordinator
        )
        await self.frontend.start(call_loop=call_loop)
        return self.frontend

    def serve_config(self, **overrides: Any) -> ServeConfig:
        values: dict[str, Any] = {
            "attach": "relay",
            "engine_count": self.engine_count,
            "handshake_address": self.relay_address,
            "upstream_handshake_address": self.frontend_address,
            "admin_listen": "off",
            "listen": "127.0.0.1:0",
        }
        values.update(overrides)
        return ServeConfig(**values)

    async def start_relay(self, **overrides: Any) -> Relay:
        faults = ProtocolErrorTally()
        stats = Stats()
        client = build_fleet(self.serve_config(**overrides), faults)
        assert isinstance(client, EngineCoreClient)
        relay = Relay(client, faults, stats)
        await client.start()
        self.relays.append(relay)
        return relay

    def start_engine(self, index: int, options: SimOptions | None = None) -> SimEngine:
        engine = SimEngine(self.relay_address, index, options or SimOptions())
        self.engines.append(engine)
        self.engine_tasks.append(asyncio.create_task(engine.run()))
        return engine

    def start_engines(self, options: dict[int, SimOptions] | None = None) -> list[SimEngine]:
        return [self.start_engine(i, (options or {}).get(i)) for i in range(self.engine_count)]

    async def wait_handshakes(self, timeout_s: float = 5.0) -> None:
        await self.relay.transport.wait_connected(timeout_s)
        await self.fe.wait_connected(timeout_s)

    async def close(self) -> None:
        stopping = []
        for engine, task in zip(self.engines, self.engine_tasks, strict=True):
            if engine.connected.is_set() and not task.done():
                engine.stop()
                stopping.append(task)
            else:  # still waiting for INIT (or done): nothing graceful to do
                task.cancel()
        if stopping:
            await asyncio.wait(stopping, timeout=2.0)
        for task in self.engine_tasks:
            task.cancel()
        await asyncio.gather(*self.engine_tasks, return_exceptions=True)
        for relay in self.relays:
            with contextlib.suppress(Exception):
                await relay.client.close()
        if self.frontend is not None:
            await self.frontend.close()


def cross_talk(faults: ProtocolErrorTally) -> Counter[str]:
    """Error kinds that would mean a reply reached the wrong client or engine."""
    kinds = ("unknown_call_id", "wrong_engine", "wrong_engine_index", "non_utility_output")
    return Counter({k: faults.counts[k] for k in kinds if faults.counts.get(k)})


class RelayHarnesses:
    """Builds harnesses for one test (``make``) and closes them all at its end (``close``)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.made: list[RelayHarness] = []

    def make(self, engine_count: int) -> RelayHarness:
        harness = RelayHarness(engine_count, self.tmp_path)
        self.made.append(harness)
        return harness

    async def close(self) -> None:
        for harness in self.made:
            await harness.close()


MakeHarness = Callable[[int], RelayHarness]
