"""Paced polls over real ZMQ (``--engines-per-burst``): simulated engines in owner mode read a
burst at a time, each at its own offset every poll, the snapshot published whole; a fleet that
changes between bursts is read again at once and never counted inconsistent, a real
disagreement still is, at the first, middle and last engine. The pure parts:
tests/unit/control/test_pacing.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from exporter.fleetstate.aggregate import FleetState
from exporter.sim.options import SimReply
from tests.harness.service import ServiceFactory

ENGINES = 4


def record_calls(fleet: Any, method: str) -> list[tuple[int, float]]:
    """(engine index, when) of every ``method`` request from now on."""
    seen: list[tuple[int, float]] = []
    for index, engine in enumerate(fleet.engines):

        def hook(_c: int, _i: int, m: str, _a: list[Any], index: int = index) -> None:
            if m == method:
                seen.append((index, time.monotonic()))

        engine._then = hook
    return seen


async def test_each_engine_is_read_at_its_own_offset_every_poll(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(ENGINES, engines_per_burst=1, poll_interval=1.2)
    poller = fleet.exporter.poller
    seen = record_calls(fleet, "is_sleeping")
    first = poller.snapshot.poll_number
    await poller.wait_for_poll(first + 3, 20)
    order = [index for index, _ in seen]
    # Whole polls only: from the first burst of a poll, one engine per burst, in order.
    start = order.index(0)
    whole = order[start : start + 2 * ENGINES]
    assert whole == list(range(ENGINES)) * 2, order
    times = [when for _, when in seen[start : start + ENGINES]]
    # Burst 3 of 4 starts 0.9 s after the poll began; a sleep never ends early.
    assert times[-1] - times[0] >= 0.45, times
    snap = poller.snapshot
    assert snap.ready and snap.verdicts["is_sleeping"].state is FleetState.CONSISTENT
    assert snap.poll_duration_s < 0.9  # the bursts' time, not the waits between them
    assert poller.pace.bursts >= 3 * ENGINES and poller.pace.confirmations == 0
    status = await fleet.status()  # over HTTP: a whole poll, every engine answered
    assert [e["invariants"]["is_sleeping"]["outcome"] for e in status["engines"]] == ["ok"] * 4


@pytest.mark.parametrize(
    "position", [0, ENGINES // 2, ENGINES - 1], ids=["first", "middle", "last"]
)
async def test_a_fleet_put_to_sleep_between_bursts_is_not_inconsistent(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(ENGINES, engines_per_burst=1, poll_interval=0.4)
    poller, stats = fleet.exporter.poller, fleet.exporter.stats
    state = {"asleep": False, "switched_at": -1}

    def answer(index: int) -> Any:
        def hook(_c: int, _i: int, method: str, _a: list[Any]) -> SimReply | None:
            if method != "is_sleeping":
                return None
            value = state["asleep"]
            if index == position and not state["asleep"]:  # the fleet sleeps right after
                state["asleep"], state["switched_at"] = True, poller.snapshot.poll_number
            return SimReply(value=value)

        return hook

    for index, engine in enumerate(fleet.engines):
        engine._then = answer(index)
    await poller.wait_for_poll(poller.snapshot.poll_number + 3, 20)
    assert state["asleep"] is True
    assert stats.inconsistent_results["is_sleeping"] == 0
    if position != ENGINES - 1:  # the last burst's engine switches after every read of it
        assert poller.pace.confirmations >= 1
    snap = poller.snapshot
    assert (snap.verdicts["is_sleeping"].state, snap.verdicts["is_sleeping"].value) == (
        FleetState.CONSISTENT,
        True,
    )


@pytest.mark.parametrize(
    "position", [0, ENGINES // 2, ENGINES - 1], ids=["first", "middle", "last"]
)
async def test_a_real_disagreement_is_still_counted(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(
        ENGINES, engines_per_burst=1, poll_interval=0.4, per_engine={"sleeping": {position: True}}
    )
    poller, stats = fleet.exporter.poller, fleet.exporter.stats
    await poller.wait_for_poll(poller.snapshot.poll_number + 2, 20)
    assert stats.inconsistent_results["is_sleeping"] >= 1
    assert poller.pace.confirmations >= 1
    counter = 'vllm_dp_inconsistent_utility_results_total{method="is_sleeping"}'
    assert counter in await fleet.metrics()
    assert poller.snapshot.verdicts["is_sleeping"].state is FleetState.INCONSISTENT
