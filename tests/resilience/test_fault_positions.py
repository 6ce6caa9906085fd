"""Issue 12 item 1: one engine down must never blank the fleet, whatever position it holds.

Three engines, one (or all but one) down, in every position and every attach mode: the engines
that are up are reported up with their real values, only the down ones are down, polls still
wait for the live engines' replies (none of them is counted as ``unknown_call_id``), and an
admin reset names only the down engines (``disconnected``) while the others confirm.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from exporter.config import resolve_config
from exporter.ports import free_listen_port
from exporter.runtime import Exporter
from exporter.server import ADMIN_URL_KEY, create_app
from exporter.sim.api_server import start_api_server
from exporter.sim.engine import SimEngine, SimOptions
from exporter.sim.frontend import SimFrontend
from tests.helpers import eventually, metric_value, parse_metrics

ENGINES = 3
POSITIONS = {
    "first": {0},
    "middle": {1},
    "last": {2},
    "all_but_one": {0, 1},
}


@dataclass
class Running:
    exporter: Exporter
    url: str
    admin_url: str
    session: aiohttp.ClientSession
    cleanups: list[Any] = field(default_factory=list)


async def _serve(settings: dict[str, Any]) -> tuple[Exporter, web.AppRunner, str, str]:
    config = resolve_config(
        None,
        environ={},
        listen="127.0.0.1:0",
        admin_listen="127.0.0.1:0",
        poll_interval=0.2,
        call_timeout=1.0,
        reset_min_interval=0,
        **settings,
    )
    exporter = Exporter(config)
    app = create_app(config, exporter)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return exporter, runner, f"http://127.0.0.1:{runner.addresses[0][1]}", app[ADMIN_URL_KEY]


@contextlib.asynccontextmanager
async def fleet(mode: str, down: set[int]) -> AsyncIterator[Running]:
    """An exporter in ``mode`` over three simulated engines, those in ``down`` never started."""
    up = [i for i in range(ENGINES) if i not in down]
    engines: list[SimEngine] = []
    tasks: list[asyncio.Task[str]] = []
    frontend: SimFrontend | None = None
    api_runners: list[web.AppRunner] = []
    if mode == "http":
        targets = []
        for i in range(ENGINES):
            if i in down:  # nothing listens there
                targets.append(f"{i}=http://127.0.0.1:{free_listen_port()}")
            else:
                runner, url = await start_api_server("127.0.0.1", 0, engines=1)
                api_runners.append(runner)
                targets.append(f"{i}={url}")
        settings: dict[str, Any] = {"attach": "http", "http_target": tuple(targets)}
    else:
        handshake = f"tcp://127.0.0.1:{free_listen_port()}"
        settings = {"attach": mode, "engine_count": ENGINES, "handshake_address": handshake}
        if mode == "relay":
            upstream = f"tcp://127.0.0.1:{free_listen_port()}"
            settings["upstream_handshake_address"] = upstream
            frontend = SimFrontend(upstream, ENGINES)
            await frontend.start(call_loop=False)
    exporter, runner, url, admin_url = await _serve(settings)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    try:
        if mode != "http":
            for i in up:
                engine = SimEngine(settings["handshake_address"], i, SimOptions(sleeping=True))
                engines.append(engine)
                tasks.append(asyncio.create_task(engine.run()))
            await eventually(
                lambda: exporter.client.connected_count() == len(up), 10, "handshakes"
            )
        yield Running(exporter, url, admin_url, session)
    finally:
        await session.close()
        for engine in engines:
            engine.stop()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await runner.cleanup()
        if frontend is not None:
            await frontend.close()
        for api in api_runners:
            await api.cleanup()


async def _fresh_poll(exporter: Exporter) -> None:
    poller = exporter.poller
    after = poller.snapshot.poll_number
    poller.poll_soon()
    await poller.wait_for_poll(after + 1, 10)


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("mode", ["owner", "relay", "http"])
async def test_down_engine_in_any_position_is_the_only_one_down(mode: str, position: str) -> None:
    down = POSITIONS[position]
    async with fleet(mode, down) as run:
        await _fresh_poll(run.exporter)
        await _fresh_poll(run.exporter)
        async with run.session.get(run.url + "/metrics") as resp:
            families = parse_metrics(await resp.text())
        for i in range(ENGINES):
            expected_up = 0.0 if i in down else 1.0
            assert metric_value(families, "vllm_dp_engine_up", engine=str(i)) == expected_up, i
            outcome = "disconnected" if i in down else "ok"
            calls = metric_value(
                families,
                "vllm_dp_utility_calls_total",
                method="is_sleeping",
                engine=str(i),
                outcome=outcome,
            )
            assert calls is not None and calls >= 1, (i, outcome)
            timeouts = metric_value(
                families,
                "vllm_dp_utility_calls_total",
                method="is_sleeping",
                engine=str(i),
                outcome="timeout",
            )
            assert not timeouts, f"engine {i} reported as timed out"
        assert not metric_value(families, "vllm_dp_protocol_errors_total", kind="unknown_call_id")
        async with run.session.get(run.url + "/status") as resp:
            status = await resp.json()
        for entry in status["engines"]:
            index = int(entry["engine"])
            assert entry["up"] is (index not in down), entry
        async with run.session.post(run.admin_url + "/admin/reset_prefix_cache") as resp:
            assert resp.status == 502
            body = await resp.json()
        assert sorted(body["failed_engines"]) == sorted(down)
        for entry in body["engines"]:
            if entry["engine"] in down:
                assert entry["reason"] == "disconnected", entry
            else:
                assert entry["ok"] is True, entry
