"""Elastic-EP notifications in relay mode, over real ZMQ with simulated engines beside a simulated
stock front end. vLLM sends them to client 0, the front end: the relay gets nothing, counts
nothing, and the front end receives them unchanged. One that reaches the relay's own slot
anyway (a robustness case) is the sender's, as in owner mode: recorded on the engine whose
connection carried it, the rank it names kept as reported, no other record changed, no bad push
(docs/protocol.md C.6)."""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.pushes import PushBook
from exporter.sim.options import SimOptions
from tests.harness.service import Service, relay_service
from tests.harness.waiting import eventually

POSITIONS = {"first": 0, "middle": 1, "last": 2}


def relay_slot(svc: Service, index: int) -> int:
    """The relay's client index on engine ``index``: where its output address is in the INIT
    the engine received."""
    engine = svc.engines[index]
    assert engine.init_addresses is not None
    return engine.init_addresses[1].index(svc.client.engine_details()[index].address)


def records(doc: dict[str, Any]) -> list[Any]:
    return [e["membership_event"] for e in doc["engines"]]


def pushes_read(book: PushBook) -> int:
    return sum(book.counts.values())


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_notification_naming_rank_0_is_recorded_on_its_sender(position: int) -> None:
    async with relay_service(engine_count=3) as (svc, frontend):
        sender = svc.engines[position]
        assert sender.data_parallel_rank == 0
        me = str(position)
        # vLLM's way: to client 0. The front end gets it; the relay has nothing to read.
        await sender.notify_elastic_ep("RECONFIGURE_FINISHED")
        fe_book = frontend.client.pushes
        await eventually(lambda: pushes_read(fe_book) == 1, 5, "the front end read it")
        assert set(fe_book.membership) == {me}
        assert pushes_read(svc.client.pushes) == 0

        # The relay's own slot: recorded on the sender, the rank shown as named.
        await sender.notify_elastic_ep("SHUTDOWN_COMPLETE", client_index=relay_slot(svc, position))
        await eventually(lambda: pushes_read(svc.client.pushes) == 1, 5, "the relay read it")
        await svc.fresh_poll()
        doc = await svc.status()
        mine = doc["engines"][position]["membership_event"]
        assert (mine["event"], mine["dp_rank"], mine["reported_rank"]) == (
            "SHUTDOWN_COMPLETE",
            position,
            0,
        )
        assert [r is not None for r in records(doc)] == [i == position for i in range(3)]
        assert svc.exporter.faults.counts.get("bad_push", 0) == 0
        assert frontend.faults.counts.get("bad_push", 0) == 0
        assert [e["up"] for e in doc["engines"]] == [True] * 3


async def test_a_renumbered_moe_style_engine_keeps_to_its_own_record() -> None:
    """The last engine names DP rank 1 (renumbered), the middle one its own rank 1."""
    options = {1: SimOptions(data_parallel_rank=1), 2: SimOptions(data_parallel_rank=1)}
    async with relay_service(engine_count=3, by_index=options) as (svc, _):
        for index in (1, 2):
            slot = relay_slot(svc, index)
            await svc.engines[index].notify_elastic_ep("RECONFIGURE_FINISHED", client_index=slot)
        await eventually(lambda: pushes_read(svc.client.pushes) == 2, 5, "both read")
        await svc.fresh_poll()
        doc = await svc.status()
        got = [(r["dp_rank"], r["reported_rank"]) if r else None for r in records(doc)]
        assert got == [None, (1, 1), (2, 1)]
        assert svc.exporter.faults.counts.get("bad_push", 0) == 0
