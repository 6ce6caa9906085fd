"""Relay mode over real ZMQ and HTTP, beside a simulated stock front end: each engine's
KV-events publisher comes from the registration the engine sends the exporter's own input
socket (the front end gets its own copy), and prefix-cache resets count per engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value
from tests.harness.service import Service, relay_service
from tests.harness.statusschema import validate_status

KV_EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6557", "topic": "relay"}


@pytest.fixture
async def relayed() -> AsyncIterator[tuple[Service, SimFrontend]]:
    async with relay_service(SimOptions(kv_events=KV_EVENTS)) as found:
        yield found


async def test_relay_mode_names_each_ranks_publisher(relayed: tuple[Service, SimFrontend]) -> None:
    svc, frontend = relayed
    status, targets = await svc.get_json("/kv_events_targets")
    assert status == 200
    assert [(t["targets"], t["labels"]["engine"], t["labels"]["topic"]) for t in targets] == [
        (["127.0.0.1:6557"], "0", "relay"),
        (["127.0.0.1:6558"], "1", "relay"),
    ]
    doc = await svc.status()
    validate_status(doc)
    assert doc["attach"] == "relay"
    # The stock front end read the same registrations (as vLLM's keeps them per rank).
    upstream = [d.kv_events.endpoint for d in frontend.client.engine_details() if d.kv_events]
    assert upstream == ["tcp://*:6557", "tcp://*:6558"]


async def test_relay_mode_counts_resets_per_engine(relayed: tuple[Service, SimFrontend]) -> None:
    svc, _ = relayed
    svc.engines[1].state.refuse_reset = True
    status, body, _ = await svc.reset()
    assert status == 502, body
    m = await svc.scrape()
    assert metric_value(m, "vllm_dp_prefix_cache_confirmed_resets_total", engine="0") == 1.0
    assert metric_value(m, "vllm_dp_prefix_cache_confirmed_resets_total", engine="1") == 0.0
    gauge = m["vllm_dp_prefix_cache_last_reset_timestamp_seconds"]
    assert [s.labels["engine"] for s in gauge.samples] == ["0"]
    # A pause is refused beside a stock front end (state it tracks): nothing ran, nothing counts.
    assert svc.admin_url is not None
    async with svc.session.post(svc.admin_url + "/admin/pause") as resp:
        assert resp.status == 403
    doc = await svc.status()
    assert [e["prefix_cache"]["confirmed_resets"] for e in doc["engines"]] == [1, 0]
