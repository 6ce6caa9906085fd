"""Whatever slot a link ends up holding, only a client_index an engine can have reaches the wire:
any other is that engine's own DISCONNECTED outcome (with the reason), never an exception that
fails the whole poll, and the engine never sees a frame. The encoder refuses one too.

Owner mode over in-process simulated engines on 127.0.0.1; every wait bounded.
"""

from __future__ import annotations

from typing import Any

import pytest

from exporter.client.enginecore.dataplane import EngineDataPlane
from exporter.client.fleet import Outcome
from exporter.protocol import encode_utility_request
from exporter.protocol.utility import MAX_CLIENT_INDEX
from tests.harness.service import ServiceFactory

IMPOSSIBLE = [10**30, 2**64, MAX_CLIENT_INDEX + 1, -1, True, 1.0, "0"]


@pytest.mark.parametrize("slot", IMPOSSIBLE, ids=repr)
def test_the_encoder_refuses_a_client_index_no_engine_can_have(slot: Any) -> None:
    with pytest.raises(ValueError, match="client_index"):
        encode_utility_request(slot, 7, "is_sleeping")


@pytest.mark.parametrize("slot", IMPOSSIBLE, ids=repr)
async def test_an_impossible_slot_is_one_engines_outcome_and_never_sent(
    service_factory: ServiceFactory, slot: Any
) -> None:
    service = await service_factory(3, start=True)
    transport = service.client.transport
    assert isinstance(transport, EngineDataPlane)
    transport._links[1].slot = slot  # however it got there
    sent_before = len(service.engines[1].received)

    outcomes = await service.client.call_utility("is_sleeping", timeout_s=1.0)
    assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.DISCONNECTED, Outcome.OK]
    assert "client_index" in (outcomes[1].error or ""), outcomes[1].error

    polls = service.exporter.stats.polls
    await service.next_polls(2)  # polls go on and are counted
    assert service.exporter.stats.polls >= polls + 2
    assert service.exporter.faults.task_failures.get("poller", 0) == 0
    assert [e.up for e in service.exporter.poller.snapshot.engines] == [True, False, True]
    assert len(service.engines[1].received) == sent_before, "a frame reached the engine"
    assert service.engines[1].output_alive and service.engines[1].input_alive
