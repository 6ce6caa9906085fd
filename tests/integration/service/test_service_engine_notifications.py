"""Engines whose ``EngineCoreOutputs`` carry a 10th position, vLLM PR #51433's trailing
``engine_notifications`` (not in vLLM 0.33; docs/protocol.md C.3), over real HTTP and real ZMQ
in both ZMQ modes. The exporter skips the field on purpose: in owner mode polls, the admin reset
and pushes (fault-tolerance status, elastic EP) work with the sender first, middle or last of
three; in relay mode the front end receives what engines send its slot byte for byte, field
included, and the exporter's own polls still read values. No protocol error is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from exporter.client.fleet import Outcome
from exporter.protocol.pushes import (
    EEP_NOTIFICATION_CALL_ID,
    FT_STATUS_CALL_ID,
    encode_ft_status_value,
)
from exporter.protocol.utility import KNOWN_OUTPUT_POSITIONS, custom_notification
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS
from tests.harness.scrape import Families, metric_value, samples
from tests.harness.service import RecordingSimEngine, Service, ServiceFactory, relay_service
from tests.harness.statusschema import validate_status
from tests.harness.waiting import eventually

#: What an engine with the PR sends: its ``CustomNotification`` (map-encoded, tagged).
NOTIFICATIONS = [custom_notification("my_loader", {"rank": 0, "gbps": 12.5})]
POSITIONS = {"first": 0, "middle": 1, "last": 2}


def protocol_errors(svc: Service) -> dict[str, int]:
    """Protocol errors but late poll replies (``unknown_call_id``: a reply that came after its
    call timed out on a loaded machine, whatever the frame's length)."""
    return {k: n for k, n in svc.exporter.faults.counts.items() if k != "unknown_call_id"}


def scraped_errors(m: Families) -> dict[str, float]:
    found = samples(m, "vllm_dp_protocol_errors_total")
    return {
        s.labels["kind"]: s.value
        for s in found
        if s.value and s.labels["kind"] != "unknown_call_id"
    }


def positions_sent(engine: RecordingSimEngine, client_index: int | None = None) -> set[int]:
    """How many positions the engine's output frames had (to one slot, or to all)."""
    frames = [f for slot, f in engine.sent if client_index is None or slot == client_index]
    assert frames, f"engine {engine.engine_index} sent nothing"
    return {len(msgspec.msgpack.decode(f)) for f in frames}


def trailing_values(engine: RecordingSimEngine) -> list[Any]:
    return [msgspec.msgpack.decode(f)[KNOWN_OUTPUT_POSITIONS] for _, f in engine.sent]


async def push(svc: Service, index: int, call_id: int, value: Any) -> None:
    """One push from engine ``index``; returns once it was read and a fresh poll published."""
    before = sum(svc.client.pushes.counts.values())
    await svc.engines[index].push(call_id, value)
    await eventually(lambda: sum(svc.client.pushes.counts.values()) > before, what="the push")
    await svc.fresh_poll()


def arrived_unchanged(frontend: SimFrontend, engine: RecordingSimEngine) -> Callable[[], bool]:
    """Has the front end received exactly what the engine sent its slot (0), in order?"""
    return lambda: frontend.outputs(engine.engine_index) == engine.sent_to(0)


async def sleeping_gauges(svc: Service) -> list[float | None]:
    m = await svc.scrape()
    return [metric_value(m, "vllm_dp_engine_sleeping", engine=str(i)) for i in range(3)]


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_owner_mode_polls_resets_and_pushes_with_the_trailing_field(
    fleet_factory: ServiceFactory, position: int
) -> None:
    fleet = await fleet_factory(
        3, gate_min_interval=0.0, per_engine={"engine_notifications": {position: NOTIFICATIONS}}
    )
    sender = fleet.engines[position]
    # Polls read the sender's values.
    sender.state.sleeping_tags = set(ALL_TAGS)
    await fleet.next_polls()
    assert await sleeping_gauges(fleet) == [1.0 if i == position else 0.0 for i in range(3)]
    sender.state.sleeping_tags = set()
    await fleet.next_polls()
    assert await sleeping_gauges(fleet) == [0.0, 0.0, 0.0]

    # The admin reset reaches it and its answer counts.
    code, body, _ = await fleet.reset()
    assert code == 200 and body["outcome"] == "success", body
    assert [e["ok"] for e in body["engines"]] == [True] * 3
    assert sender.calls_by_method.get("reset_prefix_cache") == 1

    # Pushes with the field are read as pushes (the exporter is client 0 in owner mode).
    status = encode_ft_status_value(position, "unhealthy", "NCCL timeout")
    await push(fleet, position, FT_STATUS_CALL_ID, status)
    doc = await fleet.status()
    validate_status(doc)
    mine = doc["engines"][position]["fault_tolerance"]
    assert (mine["status"], mine["fault_info"]) == ("unhealthy", "NCCL timeout")
    assert doc["fault_tolerance"]["faulty_engines"] == [str(position)]
    await push(fleet, position, FT_STATUS_CALL_ID, encode_ft_status_value(position, "healthy"))
    await push(fleet, position, EEP_NOTIFICATION_CALL_ID, ["RECONFIGURE_FINISHED", position])
    doc = await fleet.status()
    assert doc["engines"][position]["fault_tolerance"]["status"] == "healthy"
    assert doc["engines"][position]["membership_event"]["event"] == "RECONFIGURE_FINISHED"
    assert doc["engines"][position]["pushes"] == {"fault_tolerance_status": 2, "elastic_ep": 1}
    assert [e["up"] for e in doc["engines"]] == [True] * 3

    # An output carrying nothing but notifications (how the PR broadcasts them) is no error.
    await sender.notify(NOTIFICATIONS)
    await fleet.fresh_poll()  # the sender's later replies come after it on the same connection

    # What went on the wire: 10 positions from the sender, 9 from the others.
    assert positions_sent(sender) == {KNOWN_OUTPUT_POSITIONS + 1}
    assert all(v == NOTIFICATIONS for v in trailing_values(sender))
    others = [e for e in fleet.engines if e is not sender]
    assert all(positions_sent(e) == {KNOWN_OUTPUT_POSITIONS} for e in others)
    assert protocol_errors(fleet) == {}
    assert scraped_errors(await fleet.scrape()) == {}


async def test_owner_mode_a_fleet_that_always_sends_a_nil_trailing_field(
    fleet_factory: ServiceFactory,
) -> None:
    """Every engine with the PR and nothing to say: nil at position 9 on every output."""
    fleet = await fleet_factory(3, options=SimOptions(engine_notifications=None))
    code, body, _ = await fleet.reset()
    assert code == 200 and body["outcome"] == "success", body
    await push(fleet, 2, FT_STATUS_CALL_ID, encode_ft_status_value(2, "dead"))
    doc = await fleet.status()
    assert doc["engines"][2]["fault_tolerance"]["status"] == "dead"
    await fleet.fresh_poll()
    m = await fleet.scrape()
    assert [metric_value(m, "vllm_dp_engine_up", engine=str(i)) for i in range(3)] == [1.0] * 3
    for engine in fleet.engines:
        assert positions_sent(engine) == {KNOWN_OUTPUT_POSITIONS + 1}
        assert set(map(repr, trailing_values(engine))) == {"None"}
    assert protocol_errors(fleet) == {}
    assert scraped_errors(m) == {}


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_relay_mode_front_end_receives_the_trailing_field_byte_for_byte(
    position: int,
) -> None:
    by_index = {position: SimOptions(engine_notifications=NOTIFICATIONS)}
    async with relay_service(engine_count=3, by_index=by_index) as (svc, frontend):
        sender = svc.engines[position]
        # The front end's own calls (its slot 0) and a push (engines push to client 0).
        for _ in range(3):
            outcomes = await frontend.client.call_utility("is_sleeping", timeout_s=2.0)
            assert [o.outcome for o in outcomes] == [Outcome.OK] * 3
        await sender.push(FT_STATUS_CALL_ID, encode_ft_status_value(position, "unhealthy", "x"))
        await sender.notify(NOTIFICATIONS)  # to every slot, the front end's and the exporter's
        for engine in svc.engines:
            await eventually(
                arrived_unchanged(frontend, engine),
                what=f"engine {engine.engine_index}'s frames at the front end",
            )
            assert len(engine.sent_to(0)) >= 3
        # Byte for byte, the 10th position included; the push reached the front end's book.
        assert positions_sent(sender, 0) == {KNOWN_OUTPUT_POSITIONS + 1}
        pushed, notice = (msgspec.msgpack.decode(f) for f in frontend.outputs(position)[-2:])
        assert pushed[4][0] == FT_STATUS_CALL_ID and pushed[KNOWN_OUTPUT_POSITIONS] == NOTIFICATIONS
        assert notice[4] is None and notice[KNOWN_OUTPUT_POSITIONS] == NOTIFICATIONS
        assert frontend.client.pushes.fault_status[str(position)].status == "unhealthy"
        assert frontend.faults.counts == {}

        # The exporter's own slot (1) gets the field too, and its polls still read values.
        assert positions_sent(sender, 1) == {KNOWN_OUTPUT_POSITIONS + 1}
        assert frontend.outputs(position)[-1] in sender.sent_to(1)  # the same broadcast
        sender.state.sleeping_tags = set(ALL_TAGS)
        await svc.next_polls()
        assert await sleeping_gauges(svc) == [1.0 if i == position else 0.0 for i in range(3)]
        sender.state.sleeping_tags = set()
        await svc.next_polls()
        assert await sleeping_gauges(svc) == [0.0, 0.0, 0.0]
        assert protocol_errors(svc) == {}
        assert scraped_errors(await svc.scrape()) == {}
