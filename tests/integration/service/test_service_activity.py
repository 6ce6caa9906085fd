"""Hung and routable ranks where users look (docs/activity.md), over
real ZMQ and real HTTP in owner mode: a frozen engine (as SIGSTOP leaves it) at the first,
middle or last position becomes ``hung`` in ``/status``, the state set, the unresponsive and
routable series, ``GET /routable``, ``GET /readyz?engine=N`` and the gate's reasons, while its
neighbours stay awake and routable; thawed, it is routable again by itself. Asleep and paused
ranks are not routable either; bad ``engine`` parameters are refused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}
HUNG_AFTER_S = 0.8


async def routable(svc: Service) -> dict[str, Any]:
    code, body = await svc.get_json("/routable")
    assert code == 200
    result: dict[str, Any] = body
    return result


def engine_state(svc: Service, index: int) -> str:
    return svc.exporter.poller.snapshot.engines[index].state


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_frozen_engine_is_hung_everywhere_then_routable_again(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(3, hung_after=HUNG_AFTER_S, gate_min_interval=0.0)
    me = str(position)
    doc = await routable(fleet)
    assert doc["routable_engines"] == ["0", "1", "2"] and doc["poll"] >= 1
    assert (await fleet.get_json(f"/readyz?engine={me}"))[0] == 200

    fleet.engines[position].options.frozen = True  # as SIGSTOP leaves an engine process
    await eventually(lambda: engine_state(fleet, position) == "hung", 10, "the engine hung")
    status = await fleet.status()
    validate_status(status)
    mine = status["engines"][position]
    assert mine["state"] == "hung" and mine["connected"] and mine["unresponsive_seconds"] >= 0.8
    assert not mine["routable"]["routable"]
    assert any(r.startswith("hung: no answer for") for r in mine["routable"]["reasons"])
    others = [e for e in status["engines"] if e["engine"] != me]
    assert all(e["state"] == "awake" and e["routable"]["routable"] for e in others)
    assert status["aggregate"]["is_sleeping"]["state"] != "inconsistent"
    m = await fleet.scrape()
    assert metric_value(m, "vllm_dp_engine_state", engine=me, state="hung") == 1.0
    assert metric_value(m, "vllm_dp_engine_routable", engine=me) == 0.0
    unresponsive = metric_value(m, "vllm_dp_engine_unresponsive_seconds", engine=me)
    assert unresponsive is not None and unresponsive >= HUNG_AFTER_S
    for other in others:
        assert metric_value(m, "vllm_dp_engine_routable", engine=other["engine"]) == 1.0
        assert metric_value(m, "vllm_dp_engine_unresponsive_seconds", engine=other["engine"]) == 0
    assert metric_value(m, "vllm_dp_inconsistent_utility_results_total", method="is_sleeping") == 0
    doc = await routable(fleet)
    assert doc["routable_engines"] == [e["engine"] for e in others]
    code, body = await fleet.get_json(f"/readyz?engine={me}")
    assert code == 503 and not body["routable"] and body["engine"] == me
    assert (await fleet.get_json(f"/readyz?engine={others[0]['engine']}"))[0] == 200
    code, body = await fleet.get_json("/gate")
    assert code == 412 and body["failing_engines"] == [me]
    failures = next(e for e in body["engines"] if e["engine"] == me)["failures"]
    assert any(f.startswith("hung: no answer for") for f in failures), failures

    fleet.engines[position].options.frozen = False  # SIGCONT: it answers what waited
    await eventually(lambda: engine_state(fleet, position) == "awake", 10, "the engine back")
    assert (await routable(fleet))["routable_engines"] == ["0", "1", "2"]
    assert (await fleet.get_json(f"/readyz?engine={me}"))[0] == 200
    assert fleet.client.engine_details()[position].handshakes == 1  # no re-handshake


async def test_asleep_and_paused_engines_are_not_routable(fleet_factory: ServiceFactory) -> None:
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    fleet.engines[0].state.sleeping_tags = {"weights", "kv_cache"}
    fleet.engines[2].state.paused = True
    await fleet.fresh_poll()
    doc = await routable(fleet)
    assert doc["routable_engines"] == ["1"]
    reasons = {e["engine"]: e["reasons"] for e in doc["engines"]}
    assert reasons == {"0": ["asleep"], "1": [], "2": ["paused"]}
    code, body = await fleet.get_json("/readyz?engine=2")
    assert code == 503 and body["reasons"] == ["paused"]


@pytest.mark.parametrize(
    ("query", "status"),
    [("engine=7", 404), ("engine=" + "x" * 5000, 404), ("engine=0&engine=1", 400)],
    ids=["unknown", "huge", "twice"],
)
async def test_bad_engine_parameters_are_refused(
    fleet_factory: ServiceFactory, query: str, status: int
) -> None:
    fleet = await fleet_factory(2)
    code, body = await fleet.get_json(f"/readyz?{query}")
    assert code == status and "error" in body and len(str(body)) < 1000
    assert (await fleet.get_json("/readyz"))[0] == 200  # without engine: the fleet's readiness


class HeldSource:
    """The poller's own source, each read held until ``release`` (a poll held up: what a
    stuck thread or a wedged await would leave)."""

    def __init__(self, source: Any) -> None:
        self._source = source
        self.release = asyncio.Event()
        self.held = 0

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        self.held += 1
        await self.release.wait()
        return await self._source.read(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


async def test_a_poll_held_up_past_the_stale_bound_fails_every_route_closed_until_one_completes(
    fleet_factory: ServiceFactory,
) -> None:
    """No poll completes (its read held): past ``stale_after_s`` every rank reads ``stale`` and
    not routable in ``/routable``, ``/readyz?engine=N``, ``/status`` and the routable series
    (``/readyz`` 503),
    while ``/metrics`` keeps answering and the state stays as last read; the poll let go,
    every rank is routable again."""
    fleet = await fleet_factory(3, gate_min_interval=0.0)
    poller = fleet.exporter.poller
    assert (await routable(fleet))["routable_engines"] == ["0", "1", "2"]
    held = HeldSource(poller.source)
    poller.source = held
    poller.stale_after_s = 1.0  # the bound's formula is tested in test_activity.py
    await eventually(lambda: held.held >= 1, 10, "a poll held")
    await eventually(
        lambda: all(e.stale_s > 0 for e in poller.snapshot.engines), 10, "the snapshot stale"
    )
    doc = await routable(fleet)
    assert doc["routable_engines"] == [], doc
    for entry in doc["engines"]:
        assert entry["reasons"][0].startswith("stale: no poll for "), entry
    code, body = await fleet.get_json("/readyz?engine=2")
    assert code == 503 and body["reasons"][0].startswith("stale: "), body
    code, body = await fleet.get_json("/readyz")
    assert code == 503 and not body["ready"], body
    status = await fleet.status()
    validate_status(status)
    assert [e["state"] for e in status["engines"]] == ["awake"] * 3
    assert not any(e["routable"]["routable"] for e in status["engines"])
    m = await fleet.scrape()
    assert [metric_value(m, "vllm_dp_engine_routable", engine=e) for e in "012"] == [0.0] * 3

    held.release.set()
    poller.source = held._source
    await fleet.fresh_poll()
    doc = await routable(fleet)
    assert doc["routable_engines"] == ["0", "1", "2"], doc
    assert (await fleet.get_json("/readyz?engine=2"))[0] == 200
    assert (await fleet.get_json("/readyz"))[0] == 200
    m = await fleet.scrape()
    assert [metric_value(m, "vllm_dp_engine_routable", engine=e) for e in "012"] == [1.0] * 3
