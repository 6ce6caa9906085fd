"""``LinkTable``: which engines the exporter may call, on which slot, and why not (pure state,
no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from exporter.client.enginecore.links import FleetShape, Phase
from exporter.client.enginecore.linkstate import LinkTable
from exporter.error import EngineUnavailable, HandshakeError
from exporter.protocol import engine_identity
from exporter.protocol.utility import MAX_CLIENT_INDEX


def table(count: int = 2, start_rank: int = 0) -> LinkTable:
    return LinkTable(FleetShape(engine_count=count, start_rank=start_rank))


def test_links_are_keyed_by_rank_and_by_the_ranks_zmq_identity() -> None:
    """Replies arrive by identity, calls go out by index: both must name the same link."""
    links = table(3, start_rank=5)
    assert links.engine_indices == [5, 6, 7]
    for index in (5, 6, 7):
        assert links._by_identity[engine_identity(index)] is links._links[index]
    assert [s.engine_index for s in links.link_snapshots()] == [5, 6, 7]


@pytest.mark.parametrize("phase", [Phase.UP, Phase.RESTORED])
def test_an_engine_with_a_slot_in_a_callable_phase_is_called_on_that_slot(phase: Phase) -> None:
    links = table()
    link = links._links[1]
    link.slot, link.phase = 3, phase
    assert links.is_callable(1)
    assert links.client_index(1) == 3
    assert not links.is_callable(0)


@pytest.mark.parametrize(
    ("phase", "slot", "why"),
    [
        (Phase.IDLE, None, "not connected"),
        (Phase.INIT_SENT, 0, "not connected"),
        (Phase.LOST, 0, "disconnected (its connection closed)"),
        (Phase.DEAD, 0, "dead (ENGINE_CORE_DEAD)"),
        (Phase.UP, None, "not connected"),
    ],
)
def test_an_uncallable_engine_says_why(phase: Phase, slot: int | None, why: str) -> None:
    links = table()
    link = links._links[0]
    link.phase, link.slot = phase, slot
    assert not links.is_callable(0)
    with pytest.raises(EngineUnavailable) as raised:
        links.client_index(0)
    assert str(raised.value) == f"engine 0 is {why}"


def test_a_refused_engine_names_the_refusal() -> None:
    links = table()
    link = links._links[0]
    link.phase, link.slot, link.refused = Phase.REFUSED, 0, "coordinated DP"
    with pytest.raises(EngineUnavailable, match="refused: coordinated DP"):
        links.client_index(0)
    assert links.link_snapshots()[0].refused == "coordinated DP"


@pytest.mark.parametrize("slot", [MAX_CLIENT_INDEX + 1, -1, True])
def test_a_slot_no_engine_can_have_is_never_used(slot: int) -> None:
    """An engine indexes its clients unchecked: such a slot would crash its output thread."""
    links = table()
    link = links._links[0]
    link.phase, link.slot = Phase.UP, slot
    with pytest.raises(EngineUnavailable, match="not a slot an engine can have"):
        links.client_index(0)


def test_snapshots_copy_death_and_connection_state() -> None:
    links = table(3)
    states = [(Phase.UP, 0), (Phase.DEAD, 0), (Phase.IDLE, None)]
    for index, (phase, slot) in enumerate(states):
        links._links[index].phase, links._links[index].slot = phase, slot
    snaps = links.link_snapshots()
    assert [(s.connected, s.dead) for s in snaps] == [(True, False), (False, True), (False, False)]
    assert links.connected_count() == 1


async def test_wait_connected_returns_once_the_wanted_engines_are_up() -> None:
    """A phase change wakes the waiter; engines not asked for do not hold it up."""
    links = table(2)

    async def bring_up() -> None:
        await asyncio.sleep(0)
        links._set_phase(links._links[1], Phase.UP)

    task = asyncio.create_task(bring_up())
    await links.wait_connected(1.0, indices=[1])
    await task
    assert links._links[0].phase is Phase.IDLE


async def test_wait_connected_names_the_missing_engines_on_timeout() -> None:
    links = table(3)
    links._set_phase(links._links[1], Phase.UP)
    with pytest.raises(HandshakeError, match=r"engines \[0, 2\] did not complete"):
        await links.wait_connected(0.01)
