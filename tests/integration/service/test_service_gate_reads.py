"""``GET /gate`` asks each engine only what its conditions need (``is_sleeping`` always: every
engine must answer), every read method without conditions (what HTTP mode reads from a
plugin-enabled server's ``/dp/gate``). Real ZMQ and real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.harness.service import RecordingSimEngine, ServiceFactory

QUERIES = {
    "healthy": ("/gate?healthy=true", {"is_sleeping"}),
    "paused": ("/gate?paused=false", {"is_sleeping", "is_scheduler_paused"}),
    "weights": ("/gate?weight_version=v1&healthy=true", {"is_sleeping", "get_weight_version"}),
    "drained": ("/gate?drained=true", {"is_sleeping", "has_work"}),
    "none": ("/gate", {"is_sleeping", "is_scheduler_paused", "get_weight_version", "has_work"}),
}


def asked(engines: list[RecordingSimEngine], since: list[int]) -> list[Counter[str]]:
    return [Counter(m for m, _ in e.received[n:]) for e, n in zip(engines, since, strict=True)]


@pytest.mark.parametrize("query", QUERIES.values(), ids=QUERIES.keys())
async def test_the_gate_asks_only_what_its_conditions_need(
    fleet_factory: ServiceFactory, query: tuple[str, set[str]]
) -> None:
    path, methods = query
    fleet = await fleet_factory(3, poll_interval=30.0, gate_min_interval=0.0)
    await fleet.fresh_poll()
    engines = list(fleet.engines)
    since = [len(e.received) for e in engines]
    polls = fleet.exporter.poller.snapshot.poll_number
    code, body = await fleet.get_json(path)
    assert code in (200, 412), body
    assert fleet.exporter.poller.snapshot.poll_number == polls  # no poll in between
    assert [set(c) for c in asked(engines, since)] == [methods] * 3
    assert all(n == 1 for c in asked(engines, since) for n in c.values())


async def test_a_narrow_sample_is_not_reused_for_a_wider_question(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(2, poll_interval=30.0, gate_min_interval=1.0)
    await fleet.fresh_poll()
    assert (await fleet.get_json("/gate?healthy=true"))[0] == 200
    since = [len(e.received) for e in fleet.engines]
    code, body = await fleet.get_json("/gate?paused=false")
    assert code == 200 and all("paused" in e["values"] for e in body["engines"]), body
    assert all(c["is_scheduler_paused"] == 1 for c in asked(list(fleet.engines), since))
    since = [len(e.received) for e in fleet.engines]
    assert (await fleet.get_json("/gate?healthy=true"))[0] == 200  # the wider one serves it
    assert all(not c for c in asked(list(fleet.engines), since))


@pytest.mark.parametrize("position", [0, 1, 2], ids=["first", "middle", "last"])
async def test_alternating_conditions_cannot_buy_a_fan_out_each(
    fleet_factory: ServiceFactory, position: int
) -> None:
    """Callers cycling ``drained``, ``weight_version``, ``paused`` and ``sleeping`` as fast as
    the gate answers, for 1.5 s with a 0.25 s bound: each engine answers at most one fan-out
    per bound (every read method at most 1.5 / 0.25 + 2 times), the answers stay right (the
    engine at ``position`` is paused: every ``paused=false`` names it)."""
    fleet = await fleet_factory(3, poll_interval=30.0, gate_min_interval=0.25)
    await fleet.fresh_poll()
    fleet.engines[position].state.paused = True
    engines = list(fleet.engines)
    since = [len(e.received) for e in engines]
    cycle = [
        "/gate?drained=true",
        "/gate?weight_version=v1",
        "/gate?paused=false",
        "/gate?sleeping=false",
    ]
    loop = asyncio.get_running_loop()
    start, answered = loop.time(), 0
    while loop.time() - start < 1.5:
        path = cycle[answered % len(cycle)]
        code, body = await fleet.get_json(path)
        if "paused" in path and code == 412:
            assert body["failing_engines"] == [str(position)], body
        answered += 1
    elapsed = loop.time() - start
    assert answered >= 8, answered
    bound = int(elapsed / 0.25) + 2
    for counts in asked(engines, since):
        assert max(counts.values()) <= bound, (counts, bound)
