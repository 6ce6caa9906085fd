"""docs/reliability.md, row A1: one engine down must never blank the fleet, whatever position
it holds.

Three engines, one (or all but one) down, in every position and every attach mode: the engines
that are up are reported up with their real values, only the down ones are down, polls still
wait for the live engines' replies (none of them is counted as ``unknown_call_id``), and an
admin reset names only the down engines (``disconnected``) while the others confirm.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions
from tests.harness.apiservers import ApiServers
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import Service, serve_config, start_service
from tests.harness.waiting import eventually

ENGINES = 3
POSITIONS = {
    "first": {0},
    "middle": {1},
    "last": {2},
    "all_but_one": {0, 1},
}


@contextlib.asynccontextmanager
async def fleet(mode: str, down: set[int]) -> AsyncIterator[Service]:
    """An exporter in ``mode`` over three simulated engines, those in ``down`` never started."""
    up = [i for i in range(ENGINES) if i not in down]
    engines: list[SimEngine] = []
    tasks: list[asyncio.Task[str]] = []
    frontend: SimFrontend | None = None
    api_servers = ApiServers()
    if mode == "http":
        targets = []
        for i in range(ENGINES):
            if i in down:  # nothing listens there
                targets.append(f"{i}=http://127.0.0.1:{free_listen_port()}")
            else:
                targets.append(f"{i}={(await api_servers.start(engines=1)).url}")
        settings: dict[str, Any] = {"attach": "http", "http_target": tuple(targets)}
    else:
        handshake = f"tcp://127.0.0.1:{free_listen_port()}"
        settings = {"attach": mode, "engine_count": ENGINES, "handshake_address": handshake}
        if mode == "relay":
            upstream = f"tcp://127.0.0.1:{free_listen_port()}"
            settings["upstream_handshake_address"] = upstream
            frontend = SimFrontend(upstream, ENGINES)
            await frontend.start(call_loop=False)
    service = await start_service(serve_config(poll_interval=0.2, call_timeout=1.0, **settings))
    try:
        if mode != "http":
            for i in up:
                engine = SimEngine(handshake, i, SimOptions(sleeping=True))
                engines.append(engine)
                tasks.append(asyncio.create_task(engine.run()))
            await eventually(
                lambda: connected_count(service.exporter.client) == len(up), 10, "handshakes"
            )
        yield service
    finally:
        for engine in engines:
            engine.stop()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await service.stop()
        if frontend is not None:
            await frontend.close()
        await api_servers.close()


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("mode", ["owner", "relay", "http"])
async def test_down_engine_in_any_position_is_the_only_one_down(mode: str, position: str) -> None:
    down = POSITIONS[position]
    async with fleet(mode, down) as run:
        await run.fresh_poll(10)
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
        status_code, body, _ = await run.reset()
        assert status_code == 502
        assert sorted(body["failed_engines"]) == sorted(down)
        for entry in body["engines"]:
            if entry["engine"] in down:
                assert entry["reason"] == "disconnected", entry
            else:
                assert entry["ok"] is True, entry
