"""``EngineCoreClient``'s fan-out bookkeeping over a fake transport: replies matched by call id,
disconnected engines answered without a send, one shared deadline, in-flight calls failed when
an engine goes, pushes kept apart from replies (no sockets)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping
from typing import Any

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.enginecore.events import LinkSnapshot, TransportListener, UnexpectedEngines
from exporter.client.enginecore.late import LATE_REPLIES, LateReplies
from exporter.client.fleet import SHUTTING_DOWN, STOPPING, Outcome
from exporter.client.observe import counters_of
from exporter.error import EngineUnavailable
from exporter.protocol import EngineOutput, decode_utility_request
from exporter.protocol.activity import RequestCounts
from exporter.protocol.pushes import FT_STATUS_CALL_ID, FaultStatus
from exporter.protocol.utility import UtilityReply


class FakeTransport:
    """Engines 0..n-1 on slot 2; ``down`` are not callable; ``answer`` maps an engine to what
    it replies (engines absent from it hang)."""

    def __init__(self, listener: TransportListener, count: int = 3) -> None:
        self.listener = listener
        self.indices = list(range(count))
        self.down: set[int] = set()
        self.answer: dict[int, UtilityReply] = {}
        self.sent: list[tuple[int, Any]] = []
        self.confirmed: list[int] = []
        self.kept: list[tuple[int, FaultStatus | None]] = []
        self.closed = False
        self.unexpected = UnexpectedEngines()

    @property
    def engine_indices(self) -> list[int]:
        return self.indices

    def link_snapshots(self) -> list[LinkSnapshot]:
        return [LinkSnapshot(i, i not in self.down, False, 1, None, "") for i in self.indices]

    def connected_count(self) -> int:
        return len(self.indices) - len(self.down)

    def client_index(self, engine_index: int) -> int:
        if engine_index in self.down:
            raise EngineUnavailable(f"engine {engine_index} is not connected")
        return 2

    def send_utility(self, engine_index: int, payload: bytes) -> None:
        request = decode_utility_request(payload)
        self.sent.append((engine_index, request))
        reply = self.answer.get(engine_index)
        if reply is not None:
            out = EngineOutput(
                engine_index, UtilityReply(request.call_id, reply.failure_message, reply.value)
            )
            asyncio.get_running_loop().call_soon(self.listener.on_output, engine_index, out)

    def confirm_dead(self, engine_index: int) -> None:
        self.confirmed.append(engine_index)

    def keep_fault_status(self, engine_index: int, status: FaultStatus | None) -> None:
        self.kept.append((engine_index, status))

    def counters(self) -> dict[str, Counter[str]]:
        return {}

    def request_counts(self) -> Mapping[int, RequestCounts]:
        return {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self.closed = True


def client(**kwargs: Any) -> tuple[EngineCoreClient, FakeTransport, ProtocolErrorTally]:
    faults = ProtocolErrorTally()
    made: list[FakeTransport] = []

    def make(listener: TransportListener) -> FakeTransport:
        made.append(FakeTransport(listener))
        return made[0]

    return EngineCoreClient(make, faults, **kwargs), made[0], faults


def ok(value: Any) -> UtilityReply:
    return UtilityReply(0, None, value)


async def test_replies_are_matched_by_call_id_and_returned_in_engine_order() -> None:
    c, transport, _ = client()
    transport.answer = {0: ok("a"), 2: ok("c")}
    transport.down = {1}
    outcomes = await c.call_utility("is_sleeping", timeout_s=1.0)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        ("0", Outcome.OK, "a"),
        ("1", Outcome.DISCONNECTED, None),
        ("2", Outcome.OK, "c"),
    ]
    assert [i for i, _ in transport.sent] == [0, 2]  # nothing sent to the disconnected one
    assert {r.client_index for _, r in transport.sent} == {2}
    assert len({r.call_id for _, r in transport.sent}) == 2
    assert c.pending_count == 0


async def test_a_hung_engine_times_out_at_the_shared_deadline_alone() -> None:
    c, transport, _ = client()
    transport.answer = {0: ok(True), 1: ok(True)}
    outcomes = await c.call_utility("is_sleeping", timeout_s=0.05, engines=["1", "2"])
    assert [(o.engine, o.outcome) for o in outcomes] == [("1", Outcome.OK), ("2", Outcome.TIMEOUT)]
    assert outcomes[1].error == "no reply within 0.05s"
    assert c.pending_count == 0  # the late reply will find nothing


async def test_a_reply_to_a_call_given_up_on_is_late_not_unknown_and_the_memory_is_bounded() -> (
    None
):
    c, transport, faults = client()
    c.late = LateReplies(limit=2)
    for _ in range(3):  # engine 2 hangs: three calls given up on
        await c.call_utility("is_sleeping", timeout_s=0.01, engines=["2"])
    first, second, third = (r.call_id for _, r in transport.sent)
    assert c.on_output(2, EngineOutput(2, UtilityReply(third, None, True)))  # late
    assert c.on_output(2, EngineOutput(2, UtilityReply(second, None, True)))
    assert not c.on_output(2, EngineOutput(2, UtilityReply(first, None, True)))  # forgotten
    assert not c.on_output(1, EngineOutput(1, UtilityReply(third, None, True)))  # answered
    assert c.late.counts == {"2": 2} and faults.counts == {"unknown_call_id": 2}
    counted = counters_of(c.observations)
    assert counted[LATE_REPLIES] == {"0": 0, "1": 0, "2": 2}  # every engine from 0


async def test_a_failure_reply_is_failed_and_a_shutdown_is_flagged() -> None:
    c, transport, _ = client()
    transport.answer = {0: UtilityReply(0, "boom", None), 1: UtilityReply(0, SHUTTING_DOWN, None)}
    first, second = await c.call_utility("is_sleeping", timeout_s=1.0, engines=["0", "1"])
    assert (first.outcome, first.error, first.shutting_down) == (Outcome.FAILED, "boom", False)
    assert (second.outcome, second.shutting_down) == (Outcome.FAILED, True)


async def test_replies_to_unknown_calls_or_from_the_wrong_engine_are_rejected() -> None:
    c, transport, faults = client()
    call = asyncio.create_task(c.call_utility("is_sleeping", timeout_s=1.0, engines=["0"]))
    await asyncio.sleep(0)
    call_id = transport.sent[0][1].call_id
    assert not c.on_output(0, EngineOutput(0, UtilityReply(call_id + 1, None, 1)))
    assert not c.on_output(1, EngineOutput(1, UtilityReply(call_id, None, 1)))
    assert faults.counts == {"unknown_call_id": 1, "wrong_engine": 1}
    assert c.on_output(0, EngineOutput(0, UtilityReply(call_id, None, 7)))
    (outcome,) = await call
    assert outcome.value == 7


async def test_an_engine_going_down_fails_its_calls_in_flight_at_once() -> None:
    changes: list[int] = []
    c, transport, _ = client(on_change=lambda: changes.append(1))
    transport.answer = {1: ok(1)}
    call = asyncio.create_task(c.call_utility("is_sleeping", timeout_s=30.0, engines=["0", "1"]))
    await asyncio.sleep(0)
    c.on_engine_down(0, "dead")
    first, second = await asyncio.wait_for(call, 1.0)
    assert (first.outcome, first.error) == (Outcome.DISCONNECTED, "engine dead")
    assert second.outcome is Outcome.OK
    assert changes == [1]


async def test_a_status_push_is_kept_published_and_never_taken_for_a_reply() -> None:
    statuses: list[int] = []
    c, transport, faults = client(on_status=lambda: statuses.append(1))
    push = UtilityReply(FT_STATUS_CALL_ID, None, {"id": 1, "status": "unhealthy"})
    assert c.on_output(1, EngineOutput(1, push))
    assert statuses == [1]
    ((index, kept),) = transport.kept
    assert index == 1 and kept is not None and kept.status == "unhealthy"
    assert c.engine_details()[1].fault_status == kept
    assert faults.counts == {}
    c.on_engine_up(1, handshaken=True)  # its own status, pushed before its READY was read
    assert c.engine_details()[1].fault_status == kept
    c.on_engine_hello(1)  # a new engine process starts healthy
    assert c.engine_details()[1].fault_status is None


async def test_close_ends_calls_in_flight_and_refuses_new_ones_without_sending() -> None:
    c, transport, _ = client()
    call = asyncio.create_task(c.call_utility("is_sleeping", timeout_s=30.0, engines=["0"]))
    await asyncio.sleep(0)
    await c.close()
    (outcome,) = await asyncio.wait_for(call, 1.0)
    assert (outcome.outcome, outcome.error) == (Outcome.DISCONNECTED, STOPPING)
    assert transport.closed
    sent = len(transport.sent)
    assert [o.error for o in await c.call_utility("is_sleeping", timeout_s=1.0)] == [STOPPING] * 3
    assert len(transport.sent) == sent


async def test_a_death_claim_is_confirmed_only_when_the_engine_stays_silent() -> None:
    c, transport, faults = client(death_confirm_timeout_s=0.05)
    transport.answer = {0: ok(False)}
    c.on_death_claimed(0)
    c.on_death_claimed(0)  # one confirmation at a time
    c.on_death_claimed(1)
    assert sorted(c._confirming) == [0, 1]
    await asyncio.wait_for(asyncio.gather(*c._confirming.values()), 2.0)
    assert transport.confirmed == [1]
    assert faults.counts == {"unconfirmed_engine_dead": 1}
    assert [r.method for _, r in transport.sent] == ["is_sleeping", "is_sleeping"]
