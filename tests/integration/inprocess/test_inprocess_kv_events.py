"""In-process mode's view of each engine's KV-events publisher: vLLM's own record of the
registrations (``get_kv_event_sources``, simulated with vLLM's semantics over real ZMQ), on the
trainer API's ``/kv_events_targets`` and the plugin's ``/dp/kv_events_targets``. vLLM does not
keep the address each engine connected from, so a wildcard host stays unresolved here."""

from __future__ import annotations

from typing import Any

import aiohttp

from exporter.sim.options import SimOptions
from tests.harness.inprocess import EmbeddedExporters, SimVllmFactory, fresh_poll
from tests.harness.plugin_app import PluginApps
from tests.harness.statusschema import validate_status

#: A concrete bind address (vLLM binds ``[::1]`` as given, as it does the IP of ``tcp://*:0``).
CONCRETE = {"enable_kv_cache_events": True, "endpoint": "tcp://[::1]:7557", "topic": "t"}
WILDCARD = {"enable_kv_cache_events": True, "endpoint": "tcp://*:7557"}


async def test_the_fleet_client_reads_vllms_kv_event_sources(
    sim_vllm_factory: SimVllmFactory,
) -> None:
    sim = await sim_vllm_factory(
        3, by_index={0: SimOptions(kv_events=CONCRETE), 2: SimOptions(kv_events=WILDCARD)}
    )
    assert set(sim.core.get_kv_event_sources()) == {0, 2}
    details = sim.fleet_client().engine_details()
    first, second, third = (d.kv_events for d in details)
    assert first is not None and (first.target, first.topic) == ("[::1]:7557", "t")
    assert second is None
    assert third is not None and third.endpoint == "tcp://*:7559" and third.target is None
    assert third.note is not None and "unknown" in third.note


async def test_the_trainer_apis_service_serves_the_targets(
    sim_vllm_factory: SimVllmFactory, embedded: EmbeddedExporters
) -> None:
    sim = await sim_vllm_factory(2, SimOptions(kv_events=CONCRETE))
    service = await embedded(sim.llm)
    await fresh_poll(service)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        async with session.get(service.url + "/kv_events_targets") as resp:
            assert resp.status == 200
            targets: list[dict[str, Any]] = await resp.json()
        async with session.get(service.url + "/status") as resp:
            doc = await resp.json()
    assert [t["targets"] for t in targets] == [["[::1]:7557"], ["[::1]:7558"]]
    validate_status(doc)
    assert doc["engines"][1]["kv_events"]["endpoint"] == "tcp://[::1]:7558"


async def test_the_plugins_route(plugin_apps: PluginApps) -> None:
    app = await plugin_apps(2, by_index={1: SimOptions(kv_events=CONCRETE)})
    status, headers, _ = await app.get("/dp/kv_events_targets")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    status, targets = await app.get_json("/dp/kv_events_targets")
    assert [(t["labels"]["engine"], t["targets"]) for t in targets] == [("1", ["[::1]:7558"])]
    status, doc = await app.get_json("/dp/status")
    validate_status(doc)
    assert [e["kv_events"] is None for e in doc["engines"]] == [True, False]
    _, openapi = await app.get_json("/openapi.json")
    assert "/dp/kv_events_targets" in openapi["paths"]
