"""Sleep that no longer pauses the scheduler (vLLM's draft PR #53082): ``is_sleeping`` true with
``is_scheduler_paused`` false is a state, never a breach. Owner mode over real ZMQ shows every
rank ``asleep`` (not ``paused``), both aggregates consistent, nothing counted as inconsistent;
the sleep action is verified by ``is_sleeping`` alone, and the gate answers each condition on
its own (docs/status.md)."""

from __future__ import annotations

from typing import Any

from tests.harness.scrape import metric_value, samples
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status

ENGINES = 3


async def admin(fleet: Service, path: str) -> tuple[int, Any]:
    assert fleet.admin_url is not None
    async with fleet.session.post(fleet.admin_url + path) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_asleep_without_a_pause_is_a_state_not_a_breach(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(
        ENGINES,
        gate_min_interval=0.0,
        per_engine={"sleep_pauses": dict.fromkeys(range(ENGINES), False)},
    )
    code, body = await admin(fleet, "/admin/sleep?level=1")
    assert code == 200, body
    assert body["outcome"] == "success", body
    await fleet.fresh_poll()
    doc = await fleet.status()
    validate_status(doc)
    assert {e["state"] for e in doc["engines"]} == {"asleep"}
    aggregate = doc["aggregate"]
    assert aggregate["is_sleeping"]["state"] == "consistent"
    assert aggregate["is_sleeping"]["value"] is True
    assert aggregate["is_scheduler_paused"]["state"] == "consistent"
    assert aggregate["is_scheduler_paused"]["value"] is False
    m = await fleet.scrape()
    for engine in map(str, range(ENGINES)):
        assert metric_value(m, "vllm_dp_engine_sleeping", engine=engine) == 1
        assert metric_value(m, "vllm_dp_engine_paused", engine=engine) == 0
        assert metric_value(m, "vllm_dp_engine_state", engine=engine, state="asleep") == 1
        assert metric_value(m, "vllm_dp_engine_state", engine=engine, state="paused") == 0
    assert metric_value(m, "vllm_dp_fleet_state", state="consistent") == 1
    counted = samples(m, "vllm_dp_inconsistent_utility_results_total")
    assert counted and sum(s.value for s in counted) == 0
    code, gate = await fleet.get_json("/gate?sleeping=true&paused=false")
    assert code == 200, gate
    code, gate = await fleet.get_json("/gate?paused=true")
    assert code == 412, gate
    code, body = await admin(fleet, "/admin/wake_up")
    assert code == 200 and body["outcome"] == "success", body
