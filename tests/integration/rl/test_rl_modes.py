"""RL actions in relay and HTTP mode over real sockets: relay refuses state changes beside a
stock front end unless allowed; HTTP mode runs them through vLLM's dev and RL routes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions
from tests.harness.apiservers import ApiServers, http_config
from tests.harness.service import Service, Services, serve_config
from tests.harness.waiting import eventually


async def post(svc: Service, action: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    assert svc.admin_url is not None
    async with svc.session.post(f"{svc.admin_url}/admin/{action}", **kwargs) as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def services() -> AsyncIterator[Services]:
    made = Services(start=False)
    yield made
    await made.close()


async def relay_service(services: Services, **overrides: Any) -> tuple[Service, SimFrontend]:
    upstream = f"tcp://127.0.0.1:{free_listen_port()}"
    frontend = SimFrontend(upstream, 2)
    await frontend.start(call_loop=False)
    config = serve_config(
        attach="relay",
        engine_count=2,
        handshake_address=f"tcp://127.0.0.1:{free_listen_port()}",
        upstream_handshake_address=upstream,
        **overrides,
    )
    svc = await services.serve(config, first_poll=False)
    for index in range(2):
        engine = SimEngine(config.handshake_address, index, SimOptions(), context=svc.context)
        svc.engines.append(engine)  # type: ignore[arg-type]
        svc.engine_tasks.append(asyncio.create_task(engine.run()))
    await eventually(lambda: connected_count(svc.exporter.client) == 2, what="handshakes")
    return svc, frontend


@pytest.mark.parametrize("allowed", [False, True])
async def test_relay_refuses_state_changes_unless_allowed(
    services: Services, allowed: bool
) -> None:
    svc, frontend = await relay_service(services, relay_allow_state_changes=allowed)
    try:
        status, body = await post(svc, "sleep")
        if allowed:
            assert status == 200 and body["success"], body
        else:
            assert status == 403 and "--relay-allow-state-changes" in body["error"]
            assert not any(e.state.sleeping_tags for e in svc.engines)
        # Cache resets change nothing the front end tracks: allowed either way.
        status, body = await post(svc, "reset_mm_cache")
        assert status == 200, body
    finally:
        await svc.stop_engines()
        await frontend.close()


async def test_http_mode_runs_actions_through_the_routes_and_verifies_them() -> None:
    apis = ApiServers()
    made = Services(start=False)
    try:
        nodes = [await apis.start(engines=2) for _ in range(2)]
        config = http_config([f"node{i}={n.url}" for i, n in enumerate(nodes)])
        svc = await made.serve(config)
        status, body = await post(svc, "sleep", params={"level": "1"})
        assert status == 200 and body["success"] and body["verified"], body
        assert [e["engine"] for e in body["engines"]] == ["node0", "node1"]
        status, body = await post(svc, "weight_version", json={"weight_version": "w2"})
        assert status == 200 and [e["state"] for e in body["engines"]] == ["w2", "w2"], body
        status, body = await post(svc, "wake_up")
        assert status == 200, body
        async with svc.session.get(f"{svc.url}/gate", params={"weight_version": "w2"}) as resp:
            assert resp.status == 200, await resp.text()
    finally:
        await made.close()
        await apis.close()
