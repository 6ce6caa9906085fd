"""A sidecar in HTTP mode over plugin-enabled vLLM servers (targets ending in ``/dp``): each
server's engines become the sidecar's engines, ``<target>/<rank>``, read one by one from the
server's ``/dp/gate`` — so one exporter watches many servers with per-engine truth. Real HTTP
both ways: the sidecar (``start_service``) and the plugin's app (uvicorn), simulated engines on
real ZMQ behind a simulated ``AsyncLLM``."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from exporter.sim.engine import SimOptions
from exporter.web.app import RunningService, start_service
from tests.harness.plugin_app import PluginApps
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import serve_config
from tests.harness.waiting import eventually


async def sidecar(**targets: str) -> RunningService:
    entries = tuple(f"{name}={url}/dp" for name, url in targets.items())
    return await start_service(serve_config(attach="http", http_target=entries))


async def scrape(service: RunningService) -> str:
    async with aiohttp.ClientSession() as session, session.get(service.url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_every_engine_of_every_server_is_one_engine_of_the_sidecar(
    plugin_apps: PluginApps,
) -> None:
    a = await plugin_apps(2, by_index={1: SimOptions(sleeping=True)})
    b = await plugin_apps(3)
    service = await sidecar(a=a.url, b=b.url)
    try:
        labels = ["a/0", "a/1", "b/0", "b/1", "b/2"]
        await eventually(
            lambda: service.exporter.poller.snapshot.ready, 10, "the sidecar's first polls"
        )
        assert service.exporter.client.engine_labels == labels
        families = parse_metrics(await scrape(service))
        for label in labels:
            assert metric_value(families, "vllm_dp_engine_up", engine=label) == 1.0
        assert metric_value(families, "vllm_dp_engine_sleeping", engine="a/1") == 1.0
        assert metric_value(families, "vllm_dp_engine_sleeping", engine="b/2") == 0.0
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        assert [e["engine"] for e in doc["engines"]] == labels
        assert doc["aggregate"]["is_sleeping"]["consistent"] is False
        # The sidecar's gate names the one engine that is asleep.
        status, body = await get_json(service.url + "/gate?sleeping=false")
        assert status == 412 and body["failing_engines"] == ["a/1"]
    finally:
        await service.stop()


@pytest.mark.parametrize("hung", [0, 1, 2])
async def test_a_hung_engine_behind_a_plugin_is_that_engine_alone(
    plugin_apps: PluginApps, hung: int
) -> None:
    app = await plugin_apps(3, ready=False, by_index={hung: SimOptions(hang=True)})
    service = await sidecar(a=app.url)
    try:
        await eventually(
            lambda: len(service.exporter.client.engine_labels) == 3, 10, "the server's engines"
        )

        def settled() -> bool:
            snap = service.exporter.poller.snapshot
            ups = {e.engine: e.up for e in snap.engines}
            return ups == {f"a/{i}": i != hung for i in range(3)}

        await eventually(settled, 10, "only the hung engine down")
        families = parse_metrics(await scrape(service))
        ups = [metric_value(families, "vllm_dp_engine_up", engine=f"a/{i}") for i in range(3)]
        assert ups == [0.0 if i == hung else 1.0 for i in range(3)]
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        engine = doc["engines"][hung]
        assert engine["invariants"]["is_sleeping"]["outcome"] == "timeout", engine
    finally:
        await service.stop()


async def test_actions_are_not_relayed_to_a_plugin_server(plugin_apps: PluginApps) -> None:
    app = await plugin_apps(2)
    service = await sidecar(a=app.url)
    try:
        await eventually(lambda: service.exporter.poller.snapshot.ready, 10, "a ready sidecar")
        assert service.admin_url is not None
        async with (
            aiohttp.ClientSession() as session,
            session.post(service.admin_url + "/admin/reset_prefix_cache") as resp,
        ):
            status, body = resp.status, await resp.json(content_type=None)
        assert status == 502, body
        assert body["failed_engines"] == ["a/0", "a/1"]
        assert all("POST" in (e["error"] or "") for e in body["engines"]), body
        assert app.fleet is not None
        assert [len(e.args_of("reset_prefix_cache")) for e in app.fleet.engines] == [0, 0]
    finally:
        await service.stop()


async def test_a_server_without_the_plugin_or_down_is_one_engine_that_says_why(
    plugin_apps: PluginApps,
) -> None:
    app = await plugin_apps(2)
    await app.runtime.stop()  # the plugin answers 503 "stopped"
    service = await sidecar(a=app.url, gone="http://127.0.0.1:9")
    try:
        await eventually(lambda: service.exporter.poller.snapshot.poll_number >= 2, 10, "two polls")
        assert service.exporter.client.engine_labels == ["a", "gone"]
        status, doc = await get_json(service.url + "/status")
        assert status == 200
        outcomes = [e["invariants"]["is_sleeping"] for e in doc["engines"]]
        assert [o["outcome"] for o in outcomes] == ["disconnected", "disconnected"]
        assert "stopped" in outcomes[0]["error"]
        assert "cannot connect" in outcomes[1]["error"]
    finally:
        await service.stop()
