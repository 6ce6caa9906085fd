"""The demo in owner mode: the engines are started to dial the handshake address the exporter
owns (a free loopback port unless one is given), and are stopped however serving ends.
Processes, ports and serving are replaced by recorders (no sockets, no subprocesses)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exporter.commands.demo import owner
from exporter.commands.demo.common import DemoOptions
from exporter.commands.demo.owner import run_owner_demo
from exporter.config.settings import ServeConfig


class Recorder:
    """What ``run_owner_demo`` started, served and stopped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None) -> None:
        self.spawned: list[tuple[str, int, float, str]] = []
        self.served: list[tuple[ServeConfig, list[str], float]] = []
        self.stopped: list[list[str]] = []
        self.ports = 0
        self.fail = fail
        monkeypatch.setattr(owner, "free_listen_port", self.free_port)
        monkeypatch.setattr(owner, "spawn_engines", self.spawn)
        monkeypatch.setattr(owner, "serve_demo", self.serve)
        monkeypatch.setattr(owner, "stop_processes", self.stopped.append)

    def free_port(self) -> int:
        self.ports += 1
        return 45_000 + self.ports

    def spawn(
        self, handshake: str, count: int, story_period: float, vllm_version: str
    ) -> list[str]:
        self.spawned.append((handshake, count, story_period, vllm_version))
        return [f"engine-process-{i}" for i in range(count)]

    async def serve(
        self, config: ServeConfig, headline: list[str], every: float, stop: Any
    ) -> None:
        self.served.append((config, headline, every))
        if self.fail is not None:
            raise self.fail


@pytest.mark.usefixtures("no_exporter_env")
async def test_the_engines_dial_the_port_the_exporter_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Recorder(monkeypatch, None)
    options = DemoOptions(engines=3, story_period=12.0, reset_every=2.0, vllm_version="0.34.0")
    assert await run_owner_demo(options) == 0
    assert seen.spawned == [("tcp://127.0.0.1:45001", 3, 12.0, "0.34.0")]
    config, headline, every = seen.served[0]
    assert (config.attach, config.engine_count, config.handshake_address) == (
        "owner",
        3,
        "tcp://127.0.0.1:45001",
    )
    assert headline == ["vllm-dp-exporter demo: 3 simulated engines on tcp://127.0.0.1:45001"]
    assert every == 2.0
    assert seen.stopped == [["engine-process-0", "engine-process-1", "engine-process-2"]]


@pytest.mark.usefixtures("no_exporter_env")
async def test_a_given_handshake_address_is_used_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = Recorder(monkeypatch, None)
    await run_owner_demo(DemoOptions(engines=1, handshake_address="tcp://127.0.0.1:6000"))
    assert seen.ports == 0 and seen.spawned[0][0] == "tcp://127.0.0.1:6000"
    assert seen.served[0][0].handshake_address == "tcp://127.0.0.1:6000"


@pytest.mark.usefixtures("no_exporter_env")
@pytest.mark.parametrize("failure", [OSError("address in use"), asyncio.CancelledError()])
async def test_the_engines_are_stopped_however_serving_ends(
    monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    seen = Recorder(monkeypatch, failure)
    with pytest.raises(type(failure)):
        await run_owner_demo(DemoOptions(engines=2))
    assert seen.stopped == [["engine-process-0", "engine-process-1"]]
