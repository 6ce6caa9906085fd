"""Hung is not slow, in every attach mode (docs/activity.md): a rank whose
connection is alive but that answers no call for ``--hung-after`` is ``hung`` (not
``unknown``, ``disconnected`` or ``dead``), its neighbours keep their values, no inconsistency
is counted, it is not routable, and it recovers by itself when it answers again. The poller
runs over each kind's real client (real sockets; the fake cannot hang)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from exporter.control.poller import Poller
from exporter.fleetstate.activity import routability
from exporter.fleetstate.snapshot import FleetSnapshot
from exporter.metrics.stats import Stats
from tests.harness.fleet_kinds import FleetKind

HUNG_AFTER_S = 1.0
POSITIONS = {"first": 0, "middle": 1, "last": 2}


async def polled(
    poller: Poller, until: Callable[[FleetSnapshot], bool], what: str
) -> FleetSnapshot:
    """Poll every interval, as the poller's loop does, until ``until(snapshot)`` holds
    (bounded: 60 polls)."""
    snaps: list[FleetSnapshot] = []
    for _ in range(60):
        snaps.append(await poller.poll_once())
        if until(snaps[-1]):
            return snaps[-1]
        await asyncio.sleep(poller.interval_s)  # the loop's pacing: time passes between polls
    raise AssertionError(f"never {what}: last states {[e.state for e in snaps[-1].engines]}")


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_rank_that_stops_answering_is_hung_then_recovers(
    fleet_kind: FleetKind, position: int
) -> None:
    stats = Stats()
    poller = Poller(
        fleet_kind.client, stats, interval_s=0.1, call_timeout_s=0.3, hung_after=HUNG_AFTER_S
    )
    first = await polled(poller, lambda s: all(e.up for e in s.engines), "every rank up")
    assert all(routability(e).routable for e in first.engines)
    await fleet_kind.freeze(position)  # as SIGSTOP does to an engine process
    snap = await polled(poller, lambda s: s.engines[position].hung, "the rank hung")
    mine = snap.engines[position]
    assert mine.state == "hung" and mine.unresponsive_s >= HUNG_AFTER_S
    assert mine.detail.connected, "hung, not disconnected"
    verdict = routability(mine)
    assert not verdict.routable and any(r.startswith("hung:") for r in verdict.reasons)
    others = [e for i, e in enumerate(snap.engines) if i != position]
    if not fleet_kind.death_takes_all:  # a front end answering for all ranks at once
        assert all(e.up and e.state == "awake" and not e.hung for e in others), others
        assert all(routability(e).routable for e in others)
    assert sum(stats.inconsistent_results.values()) == 0
    await fleet_kind.thaw(position)  # SIGCONT: it answers what waited, then polls
    back = await polled(
        poller, lambda s: not s.engines[position].hung and s.engines[position].up, "the rank back"
    )
    assert back.engines[position].state == "awake" and back.engines[position].unresponsive_s == 0
    assert routability(back.engines[position]).routable
