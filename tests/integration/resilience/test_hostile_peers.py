"""Case 5: hostile or broken peers are counted by kind, logged once per kind per interval and
change nothing else; a live fuzz of the output socket leaves the exporter answering correctly."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.fleetstate.aggregate import FleetState
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    encode_registration,
    encode_utility_reply,
    engine_identity,
    registration_map,
)
from exporter.sim.options import SimOptions
from tests.harness.rawengine import RawEngine
from tests.harness.scrape import metric_value as metric
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually

BAD_FRAMES_PER_KIND = 100
#: What the output monitor logs when a peer that is not the engine hangs up.
PEER_HUNG_UP = "engine 0: a peer of its output socket hung up"


def fleet_view(svc: Service) -> dict[str, Any]:
    """Everything a bad peer must not change: per-engine values, up/connected, the aggregate."""
    snap = svc.exporter.poller.snapshot
    return {
        "engines": [
            (e.engine, e.up, e.sleeping, e.paused, e.detail.connected) for e in snap.engines
        ],
        "aggregate": (snap.sleeping.state, snap.sleeping.value),
        "connected": snap.connected,
    }


def protocol_error_logs(caplog: pytest.LogCaptureFixture) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for record in caplog.records:
        if record.name == "exporter.protocol_errors":
            kinds[str(record.args[0]) if isinstance(record.args, tuple) else "?"] += 1
    return kinds


async def answer_forever(engine: RawEngine, rank: int, value: Any) -> None:
    while True:
        _, request = await engine.recv_request(timeout_s=3600)
        await engine.send_output(encode_utility_reply(rank, request.call_id, value=value))


def malformed_output_frames(engine_index: int) -> dict[str, list[list[bytes]]]:
    """kind → frames (each a multipart message) pushed into engine ``engine_index``'s output."""
    good = encode_utility_reply(engine_index, 1, value=True)
    return {
        "not_msgpack": [[b"\xc1garbage"], [good[:-3]]],
        # wrong arity (a 2-element utility_output, a map) and wrong types (str engine_index)
        "wrong_shape": [
            [msgspec.msgpack.encode([engine_index, [], None, 1.0, []])],
            [msgspec.msgpack.encode([engine_index, [], None, 1.0, [1, None, [True]]])],
            [msgspec.msgpack.encode({"engine_index": engine_index})],
            [msgspec.msgpack.encode(["zero", [], None, 1.0, [1, None, [None, True]]])],
        ],
        "wrong_engine_index": [[encode_utility_reply(engine_index + 7, 1, value=True)]],
        "extra_frames": [[good, b"aux"]],
        "oversized_frame": [[b"\x00" * (1024 * 1024 + 1)]],
        "unknown_call_id": [[good]],
    }


async def test_malformed_output_frames_are_counted_by_kind_and_change_nothing(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exporter.protocol_errors")
    caplog.set_level(logging.INFO, logger="exporter.transport")
    svc = await service_factory(2, poll_interval=0.1, call_timeout=0.4)
    await svc.start_engines(by_index={1: SimOptions(sleeping=True)})
    await svc.ready()
    await svc.next_polls(2)
    before = fleet_view(svc)
    address = svc.client.engine_details()[0].address
    status = await svc.status()
    assert status["engines"][0]["address"] == address
    frames = malformed_output_frames(0)
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    try:
        for _ in range(BAD_FRAMES_PER_KIND):
            for kind, messages in frames.items():
                if kind == "oversized_frame" and _ >= 5:
                    continue  # a few 1 MiB frames suffice
                for message in messages:
                    await push.send_multipart(message)
        expected = {
            kind: BAD_FRAMES_PER_KIND * len(messages)
            for kind, messages in frames.items()
            if kind != "oversized_frame"
        }
        expected["oversized_frame"] = 5
        # extra_frames are still decoded: the good reply inside counts as unknown_call_id too
        expected["unknown_call_id"] += BAD_FRAMES_PER_KIND

        def counted() -> bool:
            return all(svc.exporter.faults.counts.get(k, 0) >= n for k, n in expected.items())

        try:
            await eventually(counted, 5, "every bad frame counted")
        except AssertionError:
            raise AssertionError((svc.exporter.faults.counts, expected)) from None
        # The hostile peer hangs up while a call to engine 0 is in flight: that call must
        # still get its answer (a peer leaving is not the engine's connection closing).
        svc.engines[0].options.reply_delay_s = 0.3
        in_flight = asyncio.create_task(svc.client.call_utility("is_sleeping", timeout_s=2.0))
        await asyncio.sleep(0.05)
    finally:
        hung_up = caplog.text.count(PEER_HUNG_UP)
        push.close(linger=0)
        ctx.term()
    outcomes = await in_flight
    assert [o.outcome.value for o in outcomes] == ["ok", "ok"], outcomes
    svc.engines[0].options.reply_delay_s = 0.0
    # The output monitor saw the hostile peer hang up and did not take it for engine 0's death.
    await eventually(
        lambda: caplog.text.count(PEER_HUNG_UP) > hung_up, 5, "the peer's hang-up handled"
    )
    await svc.next_polls(2)
    assert fleet_view(svc) == before
    families = await svc.scrape()
    for kind, n in expected.items():
        seen = metric(families, "vllm_dp_protocol_errors_total", kind=kind)
        # late replies from the slowed-down engine 0 may add a few unknown_call_id
        assert seen is not None and (seen >= n if kind == "unknown_call_id" else seen == n)
    assert metric(families, "vllm_dp_engine_up", engine="0") == 1.0
    assert metric(families, "vllm_dp_engines_connected") == 2.0
    logged = protocol_error_logs(caplog)
    for kind in expected:
        assert logged[kind] == 1, (kind, logged)


async def test_hostile_handshake_and_registration_peers_are_counted_and_get_no_init(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """Unknown identities (HELLO and registration from a rank outside the fleet) and a second
    HELLO during a handshake: counted, logged once per kind, nothing else changes."""
    caplog.set_level(logging.WARNING, logger="exporter.protocol_errors")
    svc = await service_factory(3, poll_interval=0.1, call_timeout=0.4)
    ctx = svc.context
    # Engine 2 is hand-driven: it sends HELLO twice before completing its handshake.
    raw = RawEngine(ctx, svc.config.handshake_address, 2)
    try:
        await raw.hello()
        await raw.recv_init()
        for _ in range(BAD_FRAMES_PER_KIND):
            await raw.hello()
        await eventually(
            lambda: svc.exporter.faults.counts.get("duplicate_hello", 0) == BAD_FRAMES_PER_KIND,
            3,
            "duplicate HELLOs counted",
        )
        assert not await raw.hs.poll(100), "no second INIT"
        await raw.register(rank=2)
        await raw.ready()
        answering = asyncio.create_task(answer_forever(raw, 2, False))
        await svc.start_engines(indices=[0, 1])
        await svc.ready()
        await svc.next_polls(2)
        before = fleet_view(svc)
        assert before["aggregate"] == (FleetState.CONSISTENT, False)
        # HELLO from a rank outside the fleet, many times.
        stranger = RawEngine(ctx, svc.config.handshake_address, 7)
        # Registration from a rank outside the fleet on the input socket.
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.IDENTITY, engine_identity(7))
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.connect(svc.client.transport.input_address)  # type: ignore[attr-defined]
        try:
            for _ in range(BAD_FRAMES_PER_KIND):
                await stranger.hello()
                await intruder.send(encode_registration(registration_map(7)))
            await eventually(
                lambda: (
                    svc.exporter.faults.counts.get("unknown_identity", 0) == 2 * BAD_FRAMES_PER_KIND
                ),
                3,
                "unknown identities counted",
            )
            assert not await stranger.hs.poll(100), "a stranger gets no INIT"
        finally:
            stranger.close()
            intruder.close(linger=0)
        await svc.next_polls(2)  # both started after the strangers left
        assert fleet_view(svc) == before
        status = await svc.status()
        assert [e["handshakes"] for e in status["engines"]] == [1, 1, 1]
        families = await svc.scrape()
        assert metric(families, "vllm_dp_protocol_errors_total", kind="unknown_identity") == 200
        assert (
            metric(families, "vllm_dp_protocol_errors_total", kind="duplicate_hello")
            == BAD_FRAMES_PER_KIND
        )
        assert metric(families, "vllm_dp_engines_connected") == 3.0
        logged = protocol_error_logs(caplog)
        assert logged["unknown_identity"] == 1 and logged["duplicate_hello"] == 1, logged
        answering.cancel()
    finally:
        raw.close()


def fuzz_frames() -> list[list[bytes]]:
    """Hypothesis-generated output messages: raw bytes, arbitrary msgpack values, and
    EngineCoreOutputs-shaped arrays with arbitrary members (deep decoder paths)."""
    leaf = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    value = st.recursive(
        leaf,
        lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=12,
    )
    shaped = st.lists(value, min_size=0, max_size=11).map(
        lambda items: msgspec.msgpack.encode([0, *items[1:]] if items else items)
    )
    frame = st.one_of(st.binary(max_size=300), value.map(msgspec.msgpack.encode), shaped)
    collected: list[list[bytes]] = []

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    # The one-frame ENGINE_CORE_DEAD sentinel is the protocol's death notice, not garbage:
    # hypothesis can find it (it mines literals from the code under test), so leave it out.
    @given(st.lists(frame, min_size=1, max_size=3).filter(lambda m: m != [ENGINE_CORE_DEAD]))
    def collect(message: list[bytes]) -> None:
        collected.append(message)

    collect()
    return collected


async def test_arbitrary_bytes_on_an_output_socket_leave_the_polls_right(
    service_factory: ServiceFactory,
) -> None:
    svc = await service_factory(2, poll_interval=0.1, call_timeout=0.4)
    await svc.start_engines(by_index={1: SimOptions(sleeping=True)})
    await svc.ready()
    await svc.next_polls(2)
    before = fleet_view(svc)
    messages = fuzz_frames()
    assert len(messages) >= 50
    ctx = zmq.asyncio.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(svc.client.engine_details()[0].address)
    try:
        for message in messages:
            await push.send_multipart(message)
        await eventually(
            lambda: sum(svc.exporter.faults.counts.values()) >= len(messages) // 2,
            5,
            "fuzz frames processed",
        )
    finally:
        push.close(linger=0)
        ctx.term()
    polls = svc.exporter.poller.snapshot.poll_number
    await svc.next_polls(3)
    assert svc.exporter.poller.snapshot.poll_number >= polls + 3
    assert fleet_view(svc) == before
    assert svc.client.pending_count <= 4
    families = await svc.scrape()
    assert metric(families, "vllm_dp_engine_up", engine="0") == 1.0
    assert metric(families, "vllm_dp_engine_sleeping", engine="1") == 1.0
