"""The transport side of the first adversarial pass (docs/reliability.md, rows A2, A3, A6, A13,
A25, A26, A31, A32): hostile frames, spoofed deaths, lost connections, IPv6 and coordinated DP.
Real ZMQ sockets on loopback, simulated engines, every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import msgspec
import pytest
import zmq
import zmq.asyncio

from exporter.client.fleet import connected_count
from exporter.client.owner.transport import OwnerTransport
from exporter.protocol import (
    ENGINE_CORE_DEAD,
    encode_handshake_message,
    encode_registration,
    engine_identity,
    registration_map,
)
from exporter.protocol.handshake import MAX_REGISTRATION_STRING
from exporter.sim.options import SimOptions
from tests.harness.processes import SimProcess, sim_processes
from tests.harness.rawengine import RawEngine
from tests.harness.scrape import metric_value as metric
from tests.harness.service import RecordingSimEngine, ServiceFactory
from tests.harness.waiting import eventually

DEEP = b"\x91" * 5000 + b"\xc0"


@contextlib.contextmanager
def peer(
    ctx: zmq.asyncio.Context, kind: int, address: str, identity: bytes | None = None
) -> Iterator[zmq.asyncio.Socket]:
    """A hostile peer's socket, closed whatever the test does (an open socket would block the
    context's termination)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(linger=0)


async def test_deeply_nested_hello_is_counted_and_handshakes_go_on(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A HELLO nested 5,000 arrays deep (from a fleet identity and from a stranger) is a
    ``too_deep`` protocol error logged once; the engines that handshake afterwards come up."""
    svc = await service_factory(2)
    address = svc.config.handshake_address
    with (
        peer(svc.context, zmq.DEALER, address, engine_identity(0)) as fleet_identity,
        peer(svc.context, zmq.DEALER, address, b"stranger") as stranger,
    ):
        for _ in range(3):
            for sock in (fleet_identity, stranger):
                await sock.send(DEEP)
        await eventually(
            lambda: svc.exporter.faults.counts.get("too_deep", 0) >= 3, what="too_deep counted"
        )
        await eventually(
            lambda: svc.exporter.faults.counts.get("unknown_identity", 0) >= 3, what="strangers"
        )
    await svc.start_engines()
    await svc.ready()
    families = await svc.scrape()
    assert (metric(families, "vllm_dp_protocol_errors_total", kind="too_deep") or 0) >= 3
    assert metric(families, "vllm_dp_engines_connected") == 2.0
    too_deep_logs = [r for r in caplog.records if "too_deep" in r.getMessage()]
    assert len(too_deep_logs) == 1, "logged once per interval, not per frame"


async def test_a_crashing_handshake_loop_is_counted_and_restarted(
    service_factory: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Any exception (not only protocol errors) in the handshake loop is logged, counted in
    ``vllm_dp_task_failures_total{task="handshake"}`` and the loop restarted: engines that
    dial afterwards still complete their handshake."""
    original = OwnerTransport._on_handshake_frames
    crashes = {"left": 1}

    async def crash_once(
        self: OwnerTransport, sock: zmq.asyncio.Socket, frames: list[bytes]
    ) -> None:
        if crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("unexpected bug in the handshake")
        await original(self, sock, frames)

    monkeypatch.setattr(OwnerTransport, "_on_handshake_frames", crash_once)
    svc = await service_factory(2)
    with peer(svc.context, zmq.DEALER, svc.config.handshake_address, b"poke") as poke:
        await poke.send(encode_handshake_message("HELLO"))
        await eventually(
            lambda: svc.exporter.faults.task_failures.get("handshake", 0) == 1, what="counted"
        )
    await svc.start_engines()
    await svc.ready()
    families = await svc.scrape()
    assert metric(families, "vllm_dp_task_failures_total", task="handshake") == 1.0


async def test_deeply_nested_output_frames_are_counted_not_logged_per_frame(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """50 deeply nested 4 KB frames on an output socket: 50 ``too_deep`` counts, no traceback,
    one log line; the engine stays up."""
    svc = await service_factory(2)
    await svc.start_engines()
    await svc.ready()
    # A reply-shaped frame whose ``outputs`` (any msgpack) nests 4,096 arrays deep.
    deep = msgspec.Raw(b"\x91" * 4096 + b"\xc0")
    frame = msgspec.msgpack.encode([1, deep, None, 1.0, None, None, None, None, None])
    with peer(svc.context, zmq.PUSH, svc.exporter.client.engine_details()[1].address) as pusher:
        for _ in range(50):
            await pusher.send(frame)
        await eventually(
            lambda: svc.exporter.faults.counts.get("too_deep", 0) == 50, what="50 counts"
        )
    await svc.next_polls(1)
    assert svc.exporter.poller.snapshot.engines[1].up
    assert not [r for r in caplog.records if r.exc_info], "no traceback for a hostile frame"
    assert len([r for r in caplog.records if "too_deep" in r.getMessage()]) == 1


async def test_spoofed_engine_core_dead_leaves_the_engine_up(
    service_factory: ServiceFactory,
) -> None:
    """A stranger's ENGINE_CORE_DEAD on engine 1's output address: the engine still answers,
    so it stays up and connected; the false alarm is counted as ``unconfirmed_engine_dead``."""
    svc = await service_factory(2, poll_interval=0.2)
    await svc.start_engines()
    await svc.ready()
    await svc.next_polls(1)  # the engine's own connection is known once it answered
    with peer(svc.context, zmq.PUSH, svc.exporter.client.engine_details()[1].address) as stranger:
        for _ in range(5):
            await stranger.send(ENGINE_CORE_DEAD)
        await eventually(
            lambda: svc.exporter.faults.counts.get("unconfirmed_engine_dead", 0) >= 1,
            what="the spoof counted",
        )
        await svc.next_polls(2)
        snap = svc.exporter.poller.snapshot
        assert snap.engines[1].up and snap.engines[1].detail.connected
        assert snap.connected == 2
    families = await svc.scrape()
    assert metric(families, "vllm_dp_engine_up", engine="1") == 1.0
    assert metric(families, "vllm_dp_protocol_errors_total", kind="unconfirmed_engine_dead")


async def test_real_engine_core_dead_is_still_believed(
    service_factory: ServiceFactory,
) -> None:
    """The engine's own ENGINE_CORE_DEAD still marks it dead at once."""
    svc = await service_factory(2, poll_interval=5.0, poll_jitter=0.0)
    await svc.start_engines()
    await svc.ready()
    victim = svc.engines[1]
    victim.options.dead_after_calls = victim.calls + 1
    await svc.client.call_utility("is_sleeping", timeout_s=2.0)
    await eventually(lambda: not svc.exporter.poller.snapshot.engines[1].up, 3, what="dead")
    assert svc.exporter.faults.counts.get("unconfirmed_engine_dead", 0) == 0


@pytest.mark.slow
async def test_sigkilled_engine_is_not_connected(service_factory: ServiceFactory) -> None:
    """After a SIGKILL, /status says connected false and engines_connected drops; a restarted
    engine is connected again."""
    svc = await service_factory(2, poll_interval=0.2, call_timeout=0.4)
    address = svc.config.handshake_address
    victim = SimProcess(address, 1)
    with sim_processes(SimProcess(address, 0), victim):
        await eventually(lambda: connected_count(svc.client) == 2, 10, "handshakes")
        await svc.ready()
        await svc.next_polls(1)
        victim.kill()
        await eventually(lambda: connected_count(svc.client) == 1, 5, "engine 1 disconnected")
        await svc.next_polls(1)
        status = await svc.status()
        assert status["engines"][1]["connected"] is False
        assert status["engines"][0]["connected"] is True
        assert status["engines_connected"] == 1
        families = await svc.scrape()
        assert metric(families, "vllm_dp_engines_connected") == 1.0
        with sim_processes(SimProcess(address, 1)):
            await eventually(lambda: connected_count(svc.client) == 2, 10, "reconnected")


async def test_registration_strings_are_capped(service_factory: ServiceFactory) -> None:
    """A 100 KB vllm_version from a registration is cut before it reaches every scrape."""
    svc = await service_factory(1)
    raw = RawEngine(svc.context, svc.config.handshake_address, 0)
    try:
        await raw.hello()
        await raw.recv_init()
        fields = registration_map(0, vllm_version="9" * 100_000)
        for sock in raw.inputs:
            await sock.send(encode_registration(fields))
        await raw.hs.send(encode_handshake_message("READY"))
        await eventually(lambda: connected_count(svc.client) == 1, what="handshake")
        version = svc.exporter.client.engine_details()[0].vllm_version
        assert version is not None and len(version) == MAX_REGISTRATION_STRING
    finally:
        raw.close()


async def test_coordinated_dp_engines_are_refused_in_owner_mode(
    service_factory: ServiceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """A coordinated (MoE) DP engine in owner mode is refused with a clear error naming relay
    mode: not connected, not called, counted; a dense engine beside it is served."""
    svc = await service_factory(2)
    dense = RecordingSimEngine(svc.config.handshake_address, 0, SimOptions(), context=svc.context)
    moe = RecordingSimEngine(
        svc.config.handshake_address, 1, SimOptions(coordinated_dp=True), context=svc.context
    )
    svc.engines += [dense, moe]
    svc.engine_tasks += [asyncio.create_task(dense.run()), asyncio.create_task(moe.run())]
    await eventually(
        lambda: svc.exporter.faults.counts.get("engine_refused", 0) == 1, what="refusal"
    )
    await eventually(lambda: connected_count(svc.client) == 1, what="dense engine up")
    outcomes = await svc.client.call_utility("is_sleeping", timeout_s=1.0)
    assert outcomes[0].ok
    assert outcomes[1].error is not None and "--attach relay" in outcomes[1].error
    assert moe.calls == 0, "a refused engine is never sent anything"
    assert any(
        "--attach relay" in r.getMessage() and r.levelno >= logging.ERROR for r in caplog.records
    )


async def test_ipv6_end_to_end(service_factory: ServiceFactory) -> None:
    """Handshake, input, outputs and advertised addresses on ::1."""
    from exporter.base.ports import free_listen_port

    port = free_listen_port("::1")
    svc = await service_factory(2, handshake_address=f"tcp://[::1]:{port}", advertise_host="::1")
    await svc.start_engines()
    await svc.ready()
    details = svc.exporter.client.engine_details()
    assert all(d.address.startswith("tcp://[::1]:") for d in details), details
    families = await svc.scrape()
    assert metric(families, "vllm_dp_engines_connected") == 2.0
    assert metric(families, "vllm_dp_sleeping") == 0.0


def test_deep_frame_helper_is_really_too_deep() -> None:
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(DEEP)
