"""Owner mode's engine-core client against hand-driven engines, over real ZMQ: the client-side
conformance cases of docs/protocol.md H that only owner mode can show (the handshake, the
bytes on the wire, call ids, reply shapes, pushes and noise, deaths and restarts).

What every attach mode promises (the allow-list, failures and "Server shutting down" (case 8),
one shared deadline, a dead engine, bounded strings, close) is checked on owner mode too, with
every other mode, in ``tests/integration/conformance/``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.parsing import parse_reset
from exporter.control.verdicts import classify
from exporter.error import HandshakeError
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.protocol import ENGINE_CORE_DEAD, encode_utility_reply
from exporter.protocol.pushes import FT_STATUS_CALL_ID, encode_ft_status_value
from tests.harness.owner import OwnerHarnesses, OwnerHarnessFactory
from tests.harness.rawengine import RawEngine
from tests.harness.waiting import eventually


@pytest.fixture
async def harness_factory() -> AsyncIterator[OwnerHarnessFactory]:
    harnesses = OwnerHarnesses()
    yield harnesses.make
    await harnesses.close()


async def answer(engine: RawEngine, value: object, rank: int = 0) -> int:
    _, request = await engine.recv_request()
    await engine.send_output(encode_utility_reply(rank, request.call_id, value=value))
    return int(request.call_id)


async def test_a_headless_engine_gets_no_request_before_its_registration(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.hello()
    await e.recv_init()
    assert e.init_raw is not None
    init = msgspec.msgpack.decode(e.init_raw)
    assert set(init["addresses"]) >= {"inputs", "outputs"} and init["parallel_config"] == {}
    await e.ready()
    # READY but no registration yet: the engine is not callable and nothing reaches its input.
    await eventually(lambda: h.transport._links[0].ready, what="READY handled")
    next_id = h.client._next_id
    outcomes = await h.client.call_utility("is_sleeping", timeout_s=0.2)
    assert outcomes[0].outcome is Outcome.DISCONNECTED
    assert h.client._next_id == next_id, "no call id taken: nothing was sent"
    await e.register()
    await h.transport.wait_connected(2)
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    await answer(e, False)
    assert [o.value for o in await call] == [False]


async def test_engines_handshaking_in_any_order_connect_and_a_stranger_gets_no_init(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2)
    e1, e0 = h.engine(1), h.engine(0)
    await e1.hello()
    await e1.recv_init()
    await e0.hello()
    await e0.recv_init()
    await e1.ready()  # READY before registration
    await e0.register()
    await e0.ready()
    stranger = h.engine(7)
    await stranger.hello()
    await e1.register()
    await h.transport.wait_connected(2)
    assert not await stranger.hs.poll(200), "an unexpected identity must get no INIT"
    assert h.faults.counts.get("unknown_identity", 0) >= 1
    links = {v.engine_index: v for v in h.transport.link_snapshots()}
    assert links[0].connected and links[1].connected


async def test_a_second_hello_during_a_handshake_gets_no_second_init(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.hello()
    await e.recv_init()
    await e.hello()
    await eventually(lambda: h.faults.counts.get("duplicate_hello", 0) == 1)
    assert not await e.hs.poll(200), "no second INIT"
    await e.register()
    await e.ready()
    await h.transport.wait_connected(2)


async def test_engines_are_known_by_their_ranks_from_the_start_rank(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2, start_rank=4)
    e4, e5, e0 = h.engine(4), h.engine(5), h.engine(0)
    await e4.handshake(rank=4)
    await e5.handshake(rank=5)
    await e0.hello()
    await h.transport.wait_connected(2)
    await eventually(lambda: h.faults.counts.get("unknown_identity", 0) >= 1)
    assert h.client.engine_labels == ["4", "5"]


async def test_full_partial_extended_and_empty_registrations_are_accepted(
    harness_factory: OwnerHarnessFactory,
) -> None:
    from exporter.protocol import encode_registration, registration_map

    full = registration_map(0)
    payloads = [
        encode_registration(full),
        encode_registration(dict(list(full.items())[:17])),
        encode_registration({**full, "new_key": {"x": 1}}),
        b"",
    ]
    h = await harness_factory(len(payloads))
    for index, payload in enumerate(payloads):
        e = h.engine(index)
        await e.hello()
        await e.recv_init()
        await e.register(payload)
        await e.ready()
    await h.transport.wait_connected(2)
    versions = [d.vllm_version for d in h.client.engine_details()]
    assert versions == ["0.33.0", "0.33.0", "0.33.0", None]


async def test_requests_are_the_vector_bytes_routed_to_the_ranks_identity(
    harness_factory: OwnerHarnessFactory, vectors: dict[str, bytes]
) -> None:
    h = await harness_factory(1, start_rank=258)
    e = h.engine(258)
    await e.handshake(rank=258)
    await h.transport.wait_connected(2)
    h.client._next_id = 7  # the id the spec's vector uses
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    # The engine DEALER receives [type, payload]; the ROUTER routed it by identity 02 01.
    frames = await e.inputs[0].recv_multipart()
    assert frames == [b"\x03", vectors["utility_is_sleeping"]]
    await e.send_output(encode_utility_reply(258, 7, value=True))
    assert (await call)[0].value is True
    h.client._next_id = 7
    call = asyncio.create_task(
        h.client.call_utility("reset_prefix_cache", (False, False), timeout_s=2)
    )
    frames = await e.inputs[0].recv_multipart()
    assert frames == [b"\x03", vectors["utility_reset_prefix_cache_ff"]]
    await e.send_output(encode_utility_reply(258, 7, value=True))
    await call


async def test_call_ids_wrap_past_uint64_and_replies_match_by_id_not_order(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    h.client._next_id = 2**64 - 1  # wraps to 0 for the second call
    first = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    second = asyncio.create_task(h.client.call_utility("is_scheduler_paused", timeout_s=2))
    _, r1 = await e.recv_request()
    _, r2 = await e.recv_request()
    assert {r1.call_id, r2.call_id} == {2**64 - 1, 0}
    await e.send_output(encode_utility_reply(0, r2.call_id, value="second"))
    await e.send_output(encode_utility_reply(0, r1.call_id, value="first"))
    assert (await first)[0].value == ("first" if r1.method == "is_sleeping" else "second")
    assert (await second)[0].value == ("second" if r2.method == "is_scheduler_paused" else "first")


async def test_replies_of_any_length_and_either_result_wrapper_give_the_value(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    variants: list[Callable[[int], bytes]] = [
        lambda cid: msgspec.msgpack.encode(
            [0, [], None, 1.0, [cid, None, [None, True]], None, None, None]
        ),
        lambda cid: msgspec.msgpack.encode(
            [
                0,
                [],
                None,
                1.0,
                [cid, None, [["builtins", "bool"], True]],
                None,
                None,
                None,
                None,
                1,
                2,
                3,
            ]
        ),
        lambda cid: msgspec.msgpack.encode([0, [], None, 1.0, [cid, None, [None, None]]]),
    ]
    expected = [True, True, None]
    for build, value in zip(variants, expected, strict=True):
        call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
        _, request = await e.recv_request()
        await e.send_output(build(request.call_id))
        outcome = (await call)[0]
        assert outcome.outcome is Outcome.OK and outcome.value == value


async def test_unknown_ids_pushes_and_other_outputs_leave_a_pending_call_alone(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    _, request = await e.recv_request()
    noise = [
        encode_utility_reply(0, request.call_id + 1, value=True),  # unknown id
        msgspec.msgpack.encode(
            [0, [], None, 1.0, [-1, None, [None, {"x": 1}]]]
        ),  # EEP notification
        msgspec.msgpack.encode([0, [], None, 1.0, [-2, None, [None, "ft"]]]),  # FT status
        msgspec.msgpack.encode([0, [["req-1", [1, 2]]], None, 1.0, None]),  # request output
        msgspec.msgpack.encode([0, [], {"stats": 1}, 1.0, None, None, 3, None]),  # wave_complete
    ]
    for frame in noise:
        await e.send_output(frame)
    # vLLM's reserved negative ids are pushes, never replies: payloads of the wrong shape are
    # bad pushes, not calls nobody made.
    await eventually(lambda: h.faults.counts.get("non_utility_output", 0) == 2)
    assert h.faults.counts.get("unknown_call_id") == 1
    assert h.faults.counts.get("bad_push") == 2
    assert not call.done()
    await e.send_output(encode_utility_reply(0, request.call_id, value=False))
    assert (await call)[0].value is False


async def test_a_reply_deferred_behind_a_later_one_still_resolves_its_call(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    slow = asyncio.create_task(h.client.call_utility("reset_prefix_cache", timeout_s=2))
    fast = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    _, r_slow = await e.recv_request()
    _, r_fast = await e.recv_request()
    await e.send_output(encode_utility_reply(0, r_fast.call_id, value=True))
    assert (await fast)[0].value is True
    assert not slow.done()
    await e.send_output(encode_utility_reply(0, r_slow.call_id, value=True))
    assert (await slow)[0].value is True


async def test_engines_that_disagree_are_inconsistent_and_a_reset_needs_every_true(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2)
    engines = [h.engine(0), h.engine(1)]
    for rank, e in enumerate(engines):
        await e.handshake(rank)
    await h.transport.wait_connected(2)

    async def fan(method: str, values: list[object]) -> list[EngineOutcome]:
        call = asyncio.create_task(h.client.call_utility(method, timeout_s=2))
        for rank, (e, value) in enumerate(zip(engines, values, strict=True)):
            _, request = await e.recv_request()
            await e.send_output(encode_utility_reply(rank, request.call_id, value=value))
        return await call

    verdict = aggregate_consensus("is_sleeping", await fan("is_sleeping", [True, False]))
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.error is not None and verdict.error.method == "is_sleeping"
    assert verdict.error.values == [True, False]
    reset = parse_reset({}, b"")
    assert not classify(reset, await fan("reset_prefix_cache", [True, False])).success
    assert classify(reset, await fan("reset_prefix_cache", [True, True])).success


async def test_a_reply_after_its_fan_out_ended_is_dropped_and_counted(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2)
    e0, e1 = h.engine(0), h.engine(1)
    await e0.handshake(0)
    await e1.handshake(1)
    await h.transport.wait_connected(2)
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=0.5))
    _, r0 = await e0.recv_request()
    _, r1 = await e1.recv_request()
    await e0.send_output(
        encode_utility_reply(0, r0.call_id, failure_message="Call to is_sleeping method failed: x")
    )
    outcomes = await call  # e1 never answered in time
    assert [o.outcome for o in outcomes] == [Outcome.FAILED, Outcome.TIMEOUT]
    assert h.client.pending_count == 0
    # Late (a busy or recovering engine answering its queue): dropped, counted as late, never
    # a protocol error; the same id again, or from another engine, is unknown.
    await e1.send_output(encode_utility_reply(1, r1.call_id, value=True))
    await eventually(lambda: h.client.late.counts == {"1": 1})
    assert "unknown_call_id" not in h.faults.counts
    await e1.send_output(encode_utility_reply(1, r1.call_id, value=True))
    await e0.send_output(encode_utility_reply(0, r0.call_id + 7, value=True))
    await eventually(lambda: h.faults.counts.get("unknown_call_id", 0) == 2)
    assert h.client.late.counts == {"1": 1}


async def test_engine_core_dead_fails_pending_calls_at_once_and_refuses_new_ones(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2)
    e0, e1 = h.engine(0), h.engine(1)
    await e0.handshake(0)
    await e1.handshake(1)
    await h.transport.wait_connected(2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=5))
    _, r1 = await e1.recv_request()
    await e0.recv_request()
    await e1.send_output(encode_utility_reply(1, r1.call_id, value=False))
    await e0.send_output(ENGINE_CORE_DEAD)
    outcomes = await call
    assert loop.time() - started < 2, "pending calls must fail promptly, not at the timeout"
    assert [o.outcome for o in outcomes] == [Outcome.DISCONNECTED, Outcome.OK]
    assert "dead" in (outcomes[0].error or "")
    again = await h.client.call_utility("is_sleeping", timeout_s=0.3)
    assert again[0].outcome is Outcome.DISCONNECTED
    assert not await e0.has_request(0.1)
    assert [v.dead for v in h.transport.link_snapshots()] == [True, False]


async def test_a_killed_engine_times_out_without_hanging_the_call(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    e.close()  # killed: no sentinel, nothing
    loop = asyncio.get_running_loop()
    started = loop.time()
    outcomes = await h.client.call_utility("is_sleeping", timeout_s=0.3)
    assert outcomes[0].outcome in (Outcome.TIMEOUT, Outcome.DISCONNECTED)
    assert loop.time() - started < 1.5
    assert h.client.pending_count == 0


async def test_an_engine_that_says_hello_before_the_client_binds_is_answered(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1, start=False)
    e = h.engine(0)
    await e.hello()  # queued by ZMQ until the ROUTER binds
    await asyncio.sleep(0.2)
    await h.client.start()
    await e.recv_init(timeout_s=3)
    await e.register()
    await e.ready()
    await h.transport.wait_connected(3)


async def test_handshake_timeout_names_missing_engines(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(2)
    e = h.engine(0)
    await e.handshake()
    with pytest.raises(HandshakeError, match=r"\[1\]"):
        await h.transport.wait_connected(0.3)


async def test_restart_hello_rehandshakes_and_fails_pending(
    harness_factory: OwnerHarnessFactory,
) -> None:
    h = await harness_factory(1)
    e = h.engine(0)
    await e.handshake()
    await h.transport.wait_connected(2)
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=5))
    await e.recv_request()
    e.close()
    again = h.engine(0)  # the restarted process, same identity
    await again.hello()
    outcomes = await call
    # The closed output connection (or the new HELLO) fails the call at once, not at its timeout.
    assert outcomes[0].outcome is Outcome.DISCONNECTED
    assert any(word in (outcomes[0].error or "") for word in ("restarted", "disconnected"))
    await again.recv_init()
    await again.register()
    await again.ready()
    await h.transport.wait_connected(2)
    call = asyncio.create_task(h.client.call_utility("is_sleeping", timeout_s=2))
    await answer(again, True)
    assert (await call)[0].value is True
    assert h.transport.link_snapshots()[0].handshakes == 2


async def test_a_status_pushed_before_ready_is_read_is_kept_and_a_new_hello_forgets_it(
    harness_factory: OwnerHarnessFactory,
) -> None:
    """An engine may push its fault-tolerance status as soon as its output socket connects,
    before the client reads its READY (two sockets: either may be read first). That status is
    the new process's own and stays; the next process's HELLO forgets it (it starts healthy)."""
    h = await harness_factory(1)
    e = h.engine(0)
    await e.hello()
    await e.recv_init()
    await e.register()
    unhealthy = encode_ft_status_value(0, "unhealthy", "RuntimeError")
    await e.send_output(encode_utility_reply(0, FT_STATUS_CALL_ID, value=unhealthy))
    await eventually(lambda: "0" in h.client.pushes.fault_status, what="the push read")
    await e.ready()  # read after the push: the up that follows must not forget it
    await h.transport.wait_connected(2)
    await asyncio.sleep(0.05)
    status = h.client.pushes.fault_status.get("0")
    assert status is not None and status.status == "unhealthy", status
    assert h.client.engine_details()[0].fault_status == status
    # The state file's copy too: a restarted exporter must not read this rank healthy.
    assert h.transport.link_snapshots()[0].fault_status == status

    e.close()
    again = h.engine(0)  # the restarted process, same identity
    await again.hello()
    await again.recv_init()  # INIT is sent after the HELLO was handled
    assert "0" not in h.client.pushes.fault_status  # the old process's status is gone
    assert h.transport.link_snapshots()[0].fault_status is None
    await again.register()
    await again.ready()
    await h.transport.wait_connected(2)
    assert h.client.engine_details()[0].fault_status is None
