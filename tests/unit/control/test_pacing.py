"""Paced polls (``exporter.control.pacing``): bursts, offsets and confirmed disagreements,
over a ``FakeFleet`` (the engines over ZMQ: tests/integration/service/test_service_paced_poll.py);
one reader per deployment and pacing: the leader publishes a paced poll once, a follower that
follows is not paced."""

from __future__ import annotations

import time
from typing import Any

import pytest

from exporter.client.fake import FakeFleet
from exporter.control.fleetread import FleetRead
from exporter.control.pacing import PaceCounts, bursts, offsets, paced_read
from exporter.control.poller import Poller
from exporter.control.sources import FollowerRead, PublishingRead, decode_reading
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.metrics.stats import Stats


@pytest.mark.parametrize(
    ("count", "per_burst", "sizes"),
    [
        (3, 0, [3]),
        (3, 16, [3]),
        (16, 16, [16]),
        (17, 16, [8, 9]),
        (10, 4, [3, 3, 4]),
        (256, 16, [16] * 16),
        (5, 1, [1] * 5),
    ],
)
def test_bursts_are_nearly_equal_in_order(count: int, per_burst: int, sizes: list[int]) -> None:
    engines = [str(i) for i in range(count)]
    groups = bursts(engines, per_burst)
    assert [len(g) for g in groups] == sizes
    assert [e for g in groups for e in g] == engines  # each engine once, in the client's order
    assert max(len(g) for g in groups) <= (per_burst or count)
    assert groups == bursts(engines, per_burst)  # the same offsets every poll


def test_offsets_are_even_over_the_interval() -> None:
    assert offsets(4, 2.0) == [0.0, 0.5, 1.0, 1.5]
    assert offsets(1, 2.0) == [0.0]


AWAKE = {"is_scheduler_paused": False, "get_weight_version": "v1", "has_work": False}


async def test_each_burst_waits_for_its_offset() -> None:
    asked: list[tuple[str, float]] = []

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method == "is_sleeping":
            asked.append((engine, time.monotonic()))
            return False
        return AWAKE.get(method)

    client = FakeFleet(handler, engines=("0", "1", "2"))
    counts = PaceCounts()
    start = time.monotonic()
    reading = await paced_read(FleetRead(client), bursts(["0", "1", "2"], 1), 0.6, 1.0, counts)
    assert [engine for engine, _ in asked] == ["0", "1", "2"]
    # A sleep never ends early: burst k starts at least k / 3 of the interval after the start.
    for k, (_, when) in enumerate(asked):
        assert when - start >= k * 0.2 - 0.001
    assert counts.bursts == 3 and counts.confirmations == 0 and counts.last_wait_s > 0.3
    assert [o.engine for o in reading.outcomes["is_sleeping"]] == ["0", "1", "2"]


def switching_fleet(differs: str | None = None) -> tuple[FakeFleet, dict[str, bool]]:
    """Engines that all go to sleep right after engine 0's first ``is_sleeping`` answer (the
    fleet changes between a paced poll's bursts); ``differs`` never does."""
    state = {"asleep": False}

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if method != "is_sleeping":
            return AWAKE.get(method)
        value = state["asleep"] and engine != differs
        if engine == "0":
            state["asleep"] = True
        return value

    return FakeFleet(handler, engines=("0", "1", "2")), state


async def test_a_fleet_changing_between_bursts_is_read_again_at_once() -> None:
    client, _ = switching_fleet()
    counts = PaceCounts()
    reading = await paced_read(FleetRead(client), bursts(["0", "1", "2"], 1), 0.05, 1.0, counts)
    assert counts.confirmations == 1
    verdict = aggregate_consensus("is_sleeping", reading.outcomes["is_sleeping"])
    assert (verdict.state, verdict.value) == (FleetState.CONSISTENT, True)
    assert [o.engine for o in reading.outcomes["is_sleeping"]] == ["0", "1", "2"]


async def test_a_real_disagreement_survives_the_read_at_once() -> None:
    client, _ = switching_fleet(differs="2")
    counts = PaceCounts()
    reading = await paced_read(FleetRead(client), bursts(["0", "1", "2"], 1), 0.05, 1.0, counts)
    assert counts.confirmations == 1
    verdict = aggregate_consensus("is_sleeping", reading.outcomes["is_sleeping"])
    assert verdict.state is FleetState.INCONSISTENT
    assert [o.value for o in reading.outcomes["is_sleeping"]] == [True, True, False]


def awake_fleet(asked: list[str] | None = None) -> FakeFleet:
    """Three awake engines; ``asked`` collects every method asked of them."""

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        if asked is not None:
            asked.append(method)
        return False if method == "is_sleeping" else AWAKE.get(method)

    return FakeFleet(handler, engines=("0", "1", "2"))


async def leader_of_paced_poll() -> list[bytes]:
    """What a leader publishes over one paced poll of three engines, one per burst."""
    written: list[bytes] = []

    async def publish(data: bytes) -> None:
        written.append(data)

    leader = PublishingRead(FleetRead(awake_fleet()), publish, wall_clock=lambda: 1000.0)
    await paced_read(leader, bursts(["0", "1", "2"], 1), 0.03, 1.0, PaceCounts())
    return written


async def test_the_leader_publishes_a_paced_poll_once_with_every_engine() -> None:
    written = await leader_of_paced_poll()
    assert len(written) == 1  # with the last burst, not once a burst
    published = decode_reading(written[0], now_unix=1000.0, max_age_s=5.0)
    assert [o.engine for o in published.outcomes["is_sleeping"]] == ["0", "1", "2"]


async def test_a_follower_that_follows_reads_the_leaders_file_once_a_poll_unpaced() -> None:
    (data,) = await leader_of_paced_poll()
    loads: list[int] = []

    async def load() -> bytes:
        loads.append(1)
        return data

    asked: list[str] = []
    own = awake_fleet(asked)
    poller = Poller(own, Stats(), interval_s=0.3, call_timeout_s=1.0, engines_per_burst=1)
    poller.source = FollowerRead(
        FleetRead(own), own, load, max_age_s=5.0, wall_clock=lambda: 1000.5
    )
    await poller.poll_once()  # before its first reading a follower counts as reading itself
    bursts_before = poller.pace.bursts
    loads.clear()
    await poller.poll_once()
    assert loads == [1] and poller.pace.bursts == bursts_before
    assert asked == []  # it followed: no engine asked
    assert poller.snapshot.verdicts["is_sleeping"].state is FleetState.CONSISTENT
