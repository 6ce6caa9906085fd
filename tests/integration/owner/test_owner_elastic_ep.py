"""Elastic-EP notifications in owner mode, over real ZMQ and real HTTP with simulated engines: a
notification is the sender's. vLLM's engine names ``parallel_config.data_parallel_rank`` (0 on
every dense engine, a MoE engine's new rank after a reconfiguration), so the exporter records it
on the engine whose connection carried it, shows the rank it named as ``reported_rank`` and
changes no other engine's record; nothing is a bad push (docs/protocol.md C.6)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.sim.options import SimOptions
from tests.harness.scrape import metric_value, samples
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
EVENTS = ("RECONFIGURE_FINISHED", "SHUTDOWN_COMPLETE")
TIMESTAMPS = "vllm_dp_engine_membership_event_timestamp_seconds"


async def notify(svc: Service, index: int, event: str) -> None:
    """Engine ``index`` sends ``event`` as vLLM builds it; returns once the exporter read it
    and a fresh poll published."""
    before = sum(svc.client.pushes.counts.values())
    await svc.engines[index].notify_elastic_ep(event)
    await eventually(lambda: sum(svc.client.pushes.counts.values()) > before, what="the push")
    await svc.fresh_poll()


def records(doc: dict[str, Any]) -> list[dict[str, Any] | None]:
    return [e["membership_event"] for e in doc["engines"]]


def bad_pushes(svc: Service) -> int:
    return svc.exporter.faults.counts.get("bad_push", 0)


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_dense_engines_notifications_naming_rank_0_are_the_senders(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(3)
    assert [e.data_parallel_rank for e in fleet.engines] == [0, 0, 0]  # vLLM's dense value
    me = str(position)
    for count, event in enumerate(EVENTS, start=1):
        await notify(fleet, position, event)
        doc = await fleet.status()
        validate_status(doc)
        mine = doc["engines"][position]["membership_event"]
        assert (mine["event"], mine["dp_rank"], mine["reported_rank"]) == (event, position, 0)
        assert [r is not None for r in records(doc)] == [i == position for i in range(3)]
        assert doc["last_membership_event"] == {"engine": me, **mine}
        assert doc["engines"][position]["pushes"] == {"elastic_ep": count}
    m = await fleet.scrape()
    series = [(s.labels["engine"], s.labels["event"]) for s in samples(m, TIMESTAMPS)]
    assert series == [(me, "SHUTDOWN_COMPLETE")]
    assert metric_value(m, "vllm_dp_engine_pushes_total", engine=me, kind="elastic_ep") == 2.0
    assert metric_value(m, "vllm_dp_protocol_errors_total", kind="bad_push") in (None, 0.0)
    assert bad_pushes(fleet) == 0
    assert [e["up"] for e in doc["engines"]] == [True] * 3


async def test_every_engine_naming_rank_0_keeps_its_own_record(
    fleet_factory: ServiceFactory,
) -> None:
    """First, middle and last all name rank 0: three records, each on its sender."""
    fleet = await fleet_factory(3)
    for index, event in ((2, "SHUTDOWN_COMPLETE"), (0, "RECONFIGURE_FINISHED")):
        await notify(fleet, index, event)
    await notify(fleet, 1, "RECONFIGURE_FINISHED")
    doc = await fleet.status()
    got = [(r["event"], r["dp_rank"], r["reported_rank"]) for r in records(doc) if r]
    assert got == [
        ("RECONFIGURE_FINISHED", 0, 0),
        ("RECONFIGURE_FINISHED", 1, 0),
        ("SHUTDOWN_COMPLETE", 2, 0),
    ]
    assert doc["last_membership_event"]["engine"] == "1"
    assert bad_pushes(fleet) == 0


async def test_a_renumbered_moe_style_engines_new_rank_is_shown_on_its_record(
    fleet_factory: ServiceFactory,
) -> None:
    """The last engine reports DP rank 1 (a MoE engine renumbered by a scale-down), the middle
    one its own rank 1: each is recorded on its sender, neither touches the other."""
    fleet = await fleet_factory(3, per_engine={"data_parallel_rank": {1: 1, 2: 1}})
    await notify(fleet, 1, "RECONFIGURE_FINISHED")
    middle = (await fleet.status())["engines"][1]["membership_event"]
    await notify(fleet, 2, "RECONFIGURE_FINISHED")
    doc = await fleet.status()
    validate_status(doc)
    assert doc["engines"][1]["membership_event"] == middle
    last = doc["engines"][2]["membership_event"]
    assert (last["dp_rank"], last["reported_rank"]) == (2, 1)
    assert doc["engines"][0]["membership_event"] is None
    assert bad_pushes(fleet) == 0


async def test_the_simulated_engine_names_vllms_rank(fleet_factory: ServiceFactory) -> None:
    """The simulator sends what vLLM's ``run_engine_core`` leaves in ``data_parallel_rank``:
    0 on a dense engine, the engine index on a MoE one, or a rank a test sets."""
    fleet = await fleet_factory(2, start=False)
    await fleet.start_engines(SimOptions(), by_index={1: SimOptions(data_parallel_rank=7)})
    assert [e.data_parallel_rank for e in fleet.engines] == [0, 7]
    fleet.engines[1].options.coordinated_dp = True
    fleet.engines[1].options.data_parallel_rank = None
    assert fleet.engines[1].data_parallel_rank == 1
