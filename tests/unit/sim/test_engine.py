"""``SimEngine``'s wire side over stub sockets (nothing bound or connected): replies to the
right client slot, a test's scripted answer in the state machine's place, vLLM's deaths (the
output thread on a bad client index, the input thread on a bad request, the engine on a fatal
error), pushes, and the IPv6 rule for connecting."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from exporter.protocol import (
    ENGINE_CORE_DEAD,
    UTILITY_REQUEST_TYPE,
    EngineOutput,
    decode_engine_outputs,
    encode_utility_request,
)
from exporter.protocol.pushes import EEP_NOTIFICATION_CALL_ID, FT_STATUS_CALL_ID
from exporter.sim.engine import EXECUTOR_FAILED_TYPE, SimEngine, _is_ipv6_tcp
from exporter.sim.options import SimOptions, SimReply


class StubSocket:
    """An output PUSH (records frames) or an input DEALER (hands out queued messages)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()

    async def send(self, frame: bytes) -> None:
        self.sent.append(frame)

    async def recv_multipart(self) -> list[bytes]:
        return await self.inbox.get()


def engine(index: int = 0, slots: int = 2, **options: Any) -> tuple[SimEngine, list[StubSocket]]:
    sim = SimEngine("tcp://127.0.0.1:1", index, SimOptions(**options), clock=lambda: 5.0)
    outputs = [StubSocket() for _ in range(slots)]
    sim._outputs = cast(Any, outputs)
    return sim, outputs


def replies(sock: StubSocket) -> list[EngineOutput]:
    return [decode_engine_outputs(frame) for frame in sock.sent]


def test_the_state_is_seeded_at_the_engines_dp_rank() -> None:
    sim, _ = engine(3, sleeping=True, weight_version="w")
    assert sim.state.dp_rank == 3 and sim.state.is_sleeping() and sim.state.weight_version == "w"
    assert (sim.calls, sim.input_alive, sim.output_alive) == (0, True, True)


@pytest.mark.parametrize(
    ("options", "rank"),
    [({}, 0), ({"coordinated_dp": True}, 5), ({"data_parallel_rank": 2}, 2)],
)
def test_the_dp_rank_a_notification_carries(options: dict[str, Any], rank: int) -> None:
    """A dense engine says 0 (vLLM renumbers it), a MoE one its index, unless told."""
    sim, _ = engine(5, **options)
    assert sim.data_parallel_rank == rank


async def test_a_reply_goes_to_the_callers_slot() -> None:
    sim, (slot0, slot1) = engine(1)
    seen: list[tuple[int, bytes]] = []
    sim.on_output = lambda client, frame: seen.append((client, frame))
    await sim._dispatch(1, 42, "is_sleeping", [])
    await sim._dispatch(0, 43, "no_such_method", [])
    assert slot0.sent and slot1.sent
    ok, failed = replies(slot1)[0], replies(slot0)[0]
    assert ok.engine_index == 1 and ok.utility is not None
    assert (ok.utility.call_id, ok.utility.value, ok.utility.failure_message) == (42, False, None)
    assert failed.utility is not None and failed.utility.failure_message == (
        "Call to no_such_method method failed: "
        "'EngineCoreProc' object has no attribute 'no_such_method'"
    )
    assert [client for client, _ in seen] == [1, 0]


async def test_a_scripted_answer_replaces_the_state_machine() -> None:
    sim, (slot0, _) = engine()
    asked: list[tuple[int, int, str, list[Any]]] = []

    def hook(client: int, call_id: int, method: str, args: list[Any]) -> SimReply | None:
        asked.append((client, call_id, method, args))
        return SimReply(failure="scripted") if method == "sleep" else None

    sim.on_request = hook
    await sim._dispatch(0, 1, "sleep", [1, "abort"])
    await sim._dispatch(0, 2, "is_sleeping", [])
    assert asked == [(0, 1, "sleep", [1, "abort"]), (0, 2, "is_sleeping", [])]
    first, second = (r.utility for r in replies(slot0))
    assert first is not None and first.failure_message == "scripted"
    assert second is not None and second.value is False, "the state was left as it was"


async def test_a_client_index_past_the_outputs_kills_the_output_thread() -> None:
    """vLLM indexes ``outputs[client_index]`` unchecked: the engine goes mute."""
    sim, outputs = engine(slots=1)
    await sim._dispatch(3, 1, "is_sleeping", [])
    assert not sim.output_alive
    await sim._dispatch(0, 2, "is_sleeping", [])
    await sim.push_fault_status("unhealthy")
    assert outputs[0].sent == []


async def test_pushes_use_the_reserved_call_ids() -> None:
    sim, (slot0, slot1) = engine(2, coordinated_dp=True)
    await sim.push_fault_status("unhealthy", "RuntimeError")
    await sim.notify_elastic_ep("RECONFIGURE_FINISHED", client_index=1)
    await sim.push(FT_STATUS_CALL_ID, {"id": 2, "status": "healthy"}, client_index=9)  # dropped
    (fault,) = [r.utility for r in replies(slot0)]
    (eep,) = [r.utility for r in replies(slot1)]
    assert fault is not None and fault.call_id == FT_STATUS_CALL_ID
    assert fault.value == {"id": 2, "status": "unhealthy", "fault_info": "RuntimeError"}
    assert eep is not None and (eep.call_id, eep.value) == (
        EEP_NOTIFICATION_CALL_ID,
        ["RECONFIGURE_FINISHED", 2],
    )


async def busy(sim: SimEngine, *requests: tuple[int, int, str, list[Any]]) -> None:
    """Run the busy loop over ``requests`` until it stops or goes idle."""
    for request in requests:
        sim._queue.put_nowait(request)
    task = asyncio.create_task(sim._busy_loop())
    for _ in range(20):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_scripted_death_sends_engine_core_dead_to_every_client() -> None:
    sim, outputs = engine(dead_after_calls=2)
    await busy(sim, (0, 1, "is_sleeping", []), (1, 2, "is_sleeping", []), (0, 3, "is_sleeping", []))
    assert sim.calls == 2, "the third request is never run"
    assert all(sock.sent[-1] == ENGINE_CORE_DEAD for sock in outputs)
    assert sim._exit_reason == "dead"


async def test_a_hung_engine_counts_what_it_never_answers_and_shutdown_refuses() -> None:
    sim, (slot0, _) = engine(hang=True)
    await busy(sim, (0, 1, "is_sleeping", []), (0, 2, "sleep", []))
    assert (sim.calls, sim.calls_by_method, slot0.sent) == (2, {"is_sleeping": 1, "sleep": 1}, [])
    closing, (out, _) = engine()
    closing.shutting_down = True
    await busy(closing, (0, 7, "sleep", []))
    (reply,) = replies(out)
    assert reply.utility is not None and reply.utility.failure_message == "Server shutting down"
    assert not closing.state.is_sleeping()


@pytest.mark.parametrize(
    ("frames", "dead"),
    [
        ([EXECUTOR_FAILED_TYPE], True),
        ([b"\x09", b"x"], False),
        ([UTILITY_REQUEST_TYPE, b"\xc1"], False),
    ],
)
async def test_a_bad_request_kills_the_input_thread_or_the_engine(
    frames: list[bytes], dead: bool
) -> None:
    sim, outputs = engine()
    inbox = StubSocket()
    inbox.inbox.put_nowait(frames)
    await asyncio.wait_for(sim._input_loop(cast(Any, inbox), 0), 1)
    assert sim.input_alive is dead, "the engine dies whole, or only its input thread"
    assert (sim._exit_reason == "dead") is dead
    assert bool(outputs[0].sent) is dead


async def test_a_utility_request_is_queued_for_the_busy_loop() -> None:
    sim, _ = engine()
    inbox = StubSocket()
    inbox.inbox.put_nowait([UTILITY_REQUEST_TYPE, encode_utility_request(1, 9, "sleep", (2,))])
    task = asyncio.create_task(sim._input_loop(cast(Any, inbox), 0))
    queued = await asyncio.wait_for(sim._queue.get(), 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert queued == (1, 9, "sleep", [2])


@pytest.mark.parametrize(
    ("address", "ipv6"),
    [
        ("tcp://[::1]:5555", True),
        ("tcp://[fe80::1]:1", True),
        ("tcp://127.0.0.1:5555", False),
        ("tcp://localhost:5555", False),
        ("ipc:///tmp/engine", False),
        ("tcp://[::1:5555", False),  # unparseable
    ],
)
def test_ipv6_is_switched_on_for_ipv6_tcp_hosts_only(address: str, ipv6: bool) -> None:
    assert _is_ipv6_tcp(address) is ipv6
