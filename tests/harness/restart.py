"""An exporter restarted on fixed ports over engines that keep running, in owner or relay mode.

The engines are simulated in-process (real ZMQ on 127.0.0.1) and outlive every exporter; the
first exporter handshakes them and writes its state file, which a test may then damage before
the next exporter starts on it. Every engine records the ``client_index`` of every request it
received, so a test can prove that no impossible index was ever sent. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exporter.base.ports import free_listen_port, free_port_range
from exporter.client.fleet import connected_count
from exporter.config.settings import ServeConfig
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions, SimReply
from tests.harness.service import Service, serve_config, start_service
from tests.harness.waiting import eventually

VLLM_VERSION = "0.33.1"


def answering(service: Service) -> bool:
    """Every engine answered the last poll. A restarted exporter counts a reattached engine as
    connected as soon as its connection is back, before it answers (docs/activity.md): a test
    that means "reattached and usable" waits for this, not for ``connected_count``."""
    engines = service.exporter.poller.snapshot.engines
    return bool(engines) and all(e.up for e in engines)


class IndexRecordingEngine(SimEngine):
    """A simulated engine that remembers the ``client_index`` of every request it decoded."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.client_indices: list[int] = []
        self.on_request = self._record

    def _record(
        self, client_index: int, call_id: int, method: str, args: list[Any]
    ) -> SimReply | None:
        self.client_indices.append(client_index)
        return None


@dataclass
class RestartRig:
    """Engines (and, in relay mode, a simulated front end) plus the exporters run over them."""

    mode: str
    tmp_path: Path
    engine_count: int = 3
    base: int = field(default_factory=lambda: free_port_range(8))
    handshake: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_listen_port()}")
    upstream: str = field(default_factory=lambda: f"tcp://127.0.0.1:{free_listen_port()}")
    frontend: SimFrontend | None = None
    engines: list[IndexRecordingEngine] = field(default_factory=list)
    tasks: list[asyncio.Task[str]] = field(default_factory=list)
    services: list[Service] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.path = self.tmp_path / "state.json"

    @property
    def slots(self) -> set[int]:
        """Every client_index the engines may legitimately receive (the front end's is 0)."""
        return {0} if self.mode == "owner" else {0, 1}

    def config(self, **overrides: Any) -> ServeConfig:
        settings: dict[str, Any] = {
            "attach": self.mode,
            "engine_count": self.engine_count,
            "handshake_address": self.handshake,
            "fixed_base_port": self.base,
            "state_file": str(self.path),
            "admin_listen": "off",
            "poll_jitter": 0.0,
        }
        if self.mode == "relay":
            settings["upstream_handshake_address"] = self.upstream
        settings.update(overrides)
        return serve_config(**settings)

    async def start(self, **overrides: Any) -> Service:
        service = await start_service(self.config(**overrides))
        self.services.append(service)
        return service

    async def first_run(self) -> dict[str, Any]:
        """Handshake every engine with a first exporter, stop it; the state file it wrote."""
        if self.mode == "relay":
            self.frontend = SimFrontend(self.upstream, self.engine_count)
            await self.frontend.start()
        first = await self.start()
        for index in range(self.engine_count):
            engine = IndexRecordingEngine(
                self.handshake, index, SimOptions(vllm_version=VLLM_VERSION)
            )
            self.engines.append(engine)
            self.tasks.append(asyncio.create_task(engine.run()))
        await eventually(
            lambda: connected_count(first.client) == self.engine_count, 10, "handshakes"
        )
        await eventually(
            lambda: len(self.recorded().get("engines", [])) == self.engine_count,
            5,
            "every engine in the state file",
        )
        await first.stop()
        return self.recorded()

    def recorded(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return state

    def frontend_answers(self) -> list[int]:
        assert self.frontend is not None
        return [self.frontend.ok_count(i) for i in range(self.engine_count)]

    def healthy(self) -> bool:
        return all(e.input_alive and e.output_alive and not t.done() for e, t in self.pairs())

    def pairs(self) -> list[tuple[IndexRecordingEngine, asyncio.Task[str]]]:
        return list(zip(self.engines, self.tasks, strict=True))

    def indices_received(self) -> set[int]:
        return {i for e in self.engines for i in e.client_indices}

    async def close(self) -> None:
        for service in reversed(self.services):
            await asyncio.wait_for(service.stop(), 15)
        for engine in self.engines:
            engine.stop()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.frontend is not None:
            await self.frontend.close()
