"""The demo in relay mode: the engines dial the exporter's relay port, the exporter relays to
the simulated front end's port, and everything started is stopped however serving ends. The
front end, the ports, the processes and serving are replaced by recorders."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.commands.demo import relay
from exporter.commands.demo.common import DemoOptions
from exporter.commands.demo.relay import _report_frontend, run_relay_demo
from exporter.config.settings import ServeConfig


class FakeFrontend:
    """What the demo uses of ``SimFrontend``."""

    made: list[FakeFrontend] = []

    def __init__(
        self, address: str, engines: int, call_period_s: float, call_timeout_s: float
    ) -> None:
        self.args = (address, engines, call_period_s, call_timeout_s)
        self.events: list[str] = []
        self.faults = ProtocolErrorTally()
        self.client = "front end's client"
        FakeFrontend.made.append(self)

    async def start(self) -> None:
        self.events.append("start")

    async def close(self) -> None:
        self.events.append("close")
        raise RuntimeError("socket already closed")  # suppressed: the demo is stopping

    def ok_count(self) -> int:
        return 7


class Demo:
    """Records what ``run_relay_demo`` spawned, served and stopped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail: BaseException | None) -> None:
        self.ports = iter([41001, 41002])
        self.spawned: list[tuple[str, int, float, str]] = []
        self.served: list[tuple[ServeConfig, list[str]]] = []
        self.stopped: list[Any] = []
        self.fail = fail
        FakeFrontend.made = []
        monkeypatch.setattr(relay, "SimFrontend", FakeFrontend)
        monkeypatch.setattr(relay, "free_listen_port", lambda: next(self.ports))
        monkeypatch.setattr(relay, "spawn_engines", self.spawn)
        monkeypatch.setattr(relay, "serve_demo", self.serve)
        monkeypatch.setattr(relay, "stop_processes", self.stopped.append)

    def spawn(
        self, handshake: str, count: int, story_period: float, vllm_version: str
    ) -> list[str]:
        self.spawned.append((handshake, count, story_period, vllm_version))
        return ["procs"]

    async def serve(
        self, config: ServeConfig, headline: list[str], every: float, stop: Any
    ) -> None:
        self.served.append((config, headline))
        if self.fail is not None:
            raise self.fail


@pytest.mark.usefixtures("no_exporter_env")
async def test_engines_dial_the_relay_and_the_relay_dials_the_front_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    demo = Demo(monkeypatch, None)
    assert await run_relay_demo(DemoOptions(engines=2, call_timeout=0.5, story_period=9.0)) == 0
    frontend = FakeFrontend.made[0]
    assert frontend.args == ("tcp://127.0.0.1:41001", 2, 1.0, 0.5)
    assert demo.spawned == [("tcp://127.0.0.1:41002", 2, 9.0, "0.33.0")]  # the default
    config, headline = demo.served[0]
    assert (config.attach, config.engine_count) == ("relay", 2)
    assert config.handshake_address == "tcp://127.0.0.1:41002"
    assert config.upstream_handshake_address == "tcp://127.0.0.1:41001"
    assert headline[1] == "  front end       simulated, handshake at tcp://127.0.0.1:41001"
    assert frontend.events == ["start", "close"] and demo.stopped == [["procs"]]


@pytest.mark.usefixtures("no_exporter_env")
async def test_everything_started_is_stopped_when_serving_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    demo = Demo(monkeypatch, OSError("address in use"))
    before = asyncio.all_tasks()
    with pytest.raises(OSError, match="address in use"):
        await run_relay_demo(DemoOptions(engines=1))
    assert FakeFrontend.made[0].events == ["start", "close"] and demo.stopped == [["procs"]]
    assert asyncio.all_tasks() == before  # the reporter did not outlive the demo


async def test_the_reporter_logs_that_the_front_end_s_calls_keep_working(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    frontend = FakeFrontend("tcp://127.0.0.1:1", 4, 1.0, 1.0)
    frontend.faults.counts["unknown_call_id"] = 3
    monkeypatch.setattr(relay, "connected_count", lambda client: 4)
    with caplog.at_level(logging.INFO, logger="exporter.demo"):
        task = asyncio.create_task(_report_frontend(frontend, every_s=0.001))  # type: ignore[arg-type]
        for _ in range(1000):
            await asyncio.sleep(0.001)
            if caplog.records:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert caplog.records[0].getMessage() == (
        "simulated front end: 4 engines connected, 7 is_sleeping answers on slot 0, "
        "3 unknown call ids"
    )
