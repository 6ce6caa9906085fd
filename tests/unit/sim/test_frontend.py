"""The simulated stock front end without sockets (its ZMQ context replaced, a stub ROUTER and
publisher): the handshake messages it counts and keeps byte for byte, the outputs it keeps,
the INIT that names its simulated coordinator, and the coordinator's publication."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest
import zmq.asyncio

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.error import ProtocolError
from exporter.protocol import (
    HELLO,
    READY,
    decode_init,
    encode_handshake_message,
    encode_utility_reply,
    engine_identity,
)
from exporter.sim import frontend as frontend_module
from exporter.sim.frontend import SimFrontend

HELLO_MSG = encode_handshake_message(HELLO, local=False, headless=True)


class StubSocket:
    """The handshake ROUTER (``send_multipart``) or the coordinator's XPUB (``send``)."""

    def __init__(self) -> None:
        self.multipart: list[list[bytes]] = []
        self.sent: list[bytes] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.multipart.append(frames)

    async def send(self, frame: bytes) -> None:
        self.sent.append(frame)


@pytest.fixture
def front(monkeypatch: pytest.MonkeyPatch) -> SimFrontend:
    """Two engines from rank 0; no ZMQ context is made (nothing could bind)."""
    monkeypatch.setattr(zmq.asyncio, "Context", lambda: object())
    sim = SimFrontend("tcp://127.0.0.1:1", 2)
    sim.transport.input_address = "tcp://127.0.0.1:7000"
    for index, link in sim.transport._links.items():
        link.output_address = f"tcp://127.0.0.1:{7001 + index}"
    return sim


async def handshake(sim: SimFrontend, sock: StubSocket, index: int, payload: bytes) -> None:
    frames = [engine_identity(index), payload]
    await sim.transport._on_handshake_frames(cast(Any, sock), frames)


async def test_hello_and_ready_are_counted_and_kept_per_engine(front: SimFrontend) -> None:
    sock = StubSocket()
    ready = encode_handshake_message(READY, local=False, headless=True)
    await handshake(front, sock, 1, HELLO_MSG)
    await handshake(front, sock, 1, ready)
    assert (front.hello_count(1), front.ready_count(1), front.hello_count(0)) == (1, 1, 0)
    assert front.payloads(1, "HELLO") == [HELLO_MSG] and front.payloads(1, "READY") == [ready]
    assert front.payloads(0, "HELLO") == []
    assert len(sock.multipart) == 1, "the owner answered the HELLO with an INIT"


async def test_an_undecodable_message_is_not_counted_but_still_refused(
    front: SimFrontend,
) -> None:
    with pytest.raises(ProtocolError):
        await handshake(front, StubSocket(), 0, b"\xc1")
    assert front.transport.received == {}


async def test_the_init_names_the_coordinator_only_when_it_plays_one(front: SimFrontend) -> None:
    sock = StubSocket()
    await handshake(front, sock, 0, HELLO_MSG)
    plain = decode_init(sock.multipart[-1][1]).addresses
    assert (plain.inputs, plain.outputs) == (["tcp://127.0.0.1:7000"], ["tcp://127.0.0.1:7001"])
    assert plain.frontend_stats_publish_address is None
    front.transport.stats_publish_address = "tcp://127.0.0.1:7100"
    await handshake(front, sock, 1, HELLO_MSG)
    named = decode_init(sock.multipart[-1][1]).addresses
    assert named.frontend_stats_publish_address == "tcp://127.0.0.1:7100"
    assert (named.inputs, named.outputs) == (["tcp://127.0.0.1:7000"], ["tcp://127.0.0.1:7002"])


def test_outputs_are_kept_as_received_and_bounded(
    front: SimFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frontend_module, "KEPT_OUTPUTS", 3)
    link = front.transport._links[1]
    frames = [encode_utility_reply(1, call_id, value=True) for call_id in range(5)]
    for frame in frames:
        front.transport._on_output_frames(link, [frame], -1)
    assert front.outputs(1) == frames[2:]
    assert front.outputs(0) == []
    with pytest.raises(ProtocolError):  # kept first, then refused as the owner refuses it
        front.transport._on_output_frames(link, [b"garbage"], -1)
    assert front.outputs(1)[-1] == b"garbage"


def test_ok_count_counts_the_front_ends_own_successes(front: SimFrontend) -> None:
    front.outcomes.extend(
        [
            EngineOutcome("0", Outcome.OK, False),
            EngineOutcome("1", Outcome.OK, False),
            EngineOutcome("1", Outcome.TIMEOUT, None),
            EngineOutcome("1", Outcome.OK, True),
        ]
    )
    assert (front.ok_count(), front.ok_count(0), front.ok_count(1)) == (3, 1, 2)


@pytest.mark.parametrize(
    ("published", "message"),
    [
        ([(1, 2), (0, 5)], msgspec.msgpack.encode(([[2, 1, 0.0], [5, 0, 0.0]], 0, False))),
        ([(1, 2), "odd"], msgspec.msgpack.encode(([[2, 1, 0.0], "odd"], 0, False))),
        (b"\xc1raw", b"\xc1raw"),
    ],
    ids=["pairs", "hostile_entry", "hostile_message"],
)
async def test_the_coordinator_publishes_vllms_counts(
    front: SimFrontend, published: list[Any] | bytes, message: bytes
) -> None:
    """Each engine's (running, waiting) as vLLM's coordinator sends it: ``[waiting, running,
    0.0]``, with the wave and the running flag."""
    front.coordinator = lambda: published
    front.coordinator_interval_s = 60.0
    sock = StubSocket()
    task = asyncio.create_task(front._publish_loop(cast(Any, sock)))
    for _ in range(5):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert sock.sent == [message]
