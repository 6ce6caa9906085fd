"""``OwnerTransport``'s handshake over a stub socket (nothing is bound): HELLO answered with an
INIT naming the exporter's addresses on slot 0, READY in order, coordinated DP refused, a
restart noticed."""

from __future__ import annotations

from typing import Any, cast

import pytest

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.links import Phase
from exporter.client.owner.transport import OwnerConfig, OwnerTransport
from exporter.error import ProtocolError
from exporter.protocol import (
    HELLO,
    READY,
    decode_init,
    encode_handshake_message,
    encode_registration,
    engine_identity,
    registration_map,
)


class Listener:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, object]] = []

    def on_output(self, engine_index: int, output: object) -> bool:
        return False

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        self.calls.append(("down", engine_index, reason))

    def on_engine_hello(self, engine_index: int) -> None:
        return None

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        self.calls.append(("up", engine_index, handshaken))

    def on_death_claimed(self, engine_index: int) -> None:
        return None


class StubRouter:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)


def owner() -> tuple[OwnerTransport, Listener, StubRouter]:
    listener = Listener()
    config = OwnerConfig(engine_count=2, handshake_address="tcp://127.0.0.1:1")
    transport = OwnerTransport(config, listener, ProtocolErrorTally(), context=cast(Any, object()))
    transport.input_address = "tcp://127.0.0.1:7000"
    for index, link in transport._links.items():
        link.output_address = f"tcp://127.0.0.1:{7001 + index}"
    return transport, listener, StubRouter()


async def say(transport: OwnerTransport, sock: StubRouter, index: int, payload: bytes) -> None:
    await transport._on_handshake_frames(cast(Any, sock), [engine_identity(index), payload])


HELLO_MSG = encode_handshake_message(HELLO, local=False, headless=True)


async def test_hello_is_answered_with_an_init_naming_the_engines_own_addresses() -> None:
    transport, _, sock = owner()
    await say(transport, sock, 1, HELLO_MSG)
    ((identity, init),) = sock.sent
    assert identity == engine_identity(1)
    addresses = decode_init(init).addresses
    assert addresses.inputs == ["tcp://127.0.0.1:7000"]
    assert addresses.outputs == ["tcp://127.0.0.1:7002"]
    assert addresses.coordinator_input is None  # owner mode coordinates nothing
    link = transport._links[1]
    assert (link.phase, link.slot, link.handshakes) == (Phase.INIT_SENT, 0, 1)


async def test_ready_then_registration_brings_the_engine_up() -> None:
    transport, listener, sock = owner()
    await say(transport, sock, 0, HELLO_MSG)
    await say(transport, sock, 0, encode_handshake_message(READY))
    transport._on_input_frames([engine_identity(0), encode_registration(registration_map(0))])
    assert transport._links[0].phase is Phase.UP
    assert listener.calls == [("up", 0, True)]
    assert transport.client_index(0) == 0


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (encode_handshake_message(HELLO, local=True, headless=True), "unexpected_hello_flags"),
        (encode_handshake_message(HELLO, local=False, headless=False), "unexpected_hello_flags"),
        (encode_handshake_message(READY), "unexpected_ready"),  # before any HELLO
        (encode_handshake_message("WHATEVER"), "unexpected_status"),
    ],
)
async def test_messages_out_of_protocol_are_rejected_and_nothing_is_sent(
    payload: bytes, kind: str
) -> None:
    transport, _, sock = owner()
    with pytest.raises(ProtocolError) as raised:
        await say(transport, sock, 0, payload)
    assert raised.value.kind == kind
    assert sock.sent == []


async def test_an_unknown_identity_is_listed_as_unexpected() -> None:
    transport, _, sock = owner()
    with pytest.raises(ProtocolError, match="handshake from identity 0900"):
        await say(transport, sock, 9, HELLO_MSG)
    assert transport.unexpected.seen["0900"].dp_rank == 9


async def test_a_second_hello_mid_handshake_is_a_protocol_error() -> None:
    transport, _, sock = owner()
    await say(transport, sock, 0, HELLO_MSG)
    with pytest.raises(ProtocolError) as raised:
        await say(transport, sock, 0, HELLO_MSG)
    assert raised.value.kind == "duplicate_hello"
    assert len(sock.sent) == 1


async def test_a_hello_from_an_up_engine_is_a_restart_that_fails_its_calls() -> None:
    transport, listener, sock = owner()
    link = transport._links[0]
    link.phase, link.slot, link.handshakes, link.ready = Phase.UP, 0, 1, True
    await say(transport, sock, 0, HELLO_MSG)
    assert listener.calls == [("down", 0, "restarted")]
    assert (link.phase, link.handshakes, link.ready, link.registration) == (
        Phase.INIT_SENT,
        2,
        False,
        None,
    )


async def test_coordinated_dp_engines_are_refused_with_a_pointer_to_relay_mode() -> None:
    transport, listener, sock = owner()
    await say(transport, sock, 0, HELLO_MSG)
    await say(transport, sock, 0, encode_handshake_message(READY, parallel_config_hash="h"))
    transport._on_input_frames([engine_identity(0), encode_registration(registration_map(0))])
    await say(transport, sock, 1, HELLO_MSG)
    await say(transport, sock, 1, encode_handshake_message(READY))
    moe = registration_map(1, data_parallel_size=2)
    transport._on_input_frames([engine_identity(1), encode_registration(moe)])
    for index in (0, 1):
        assert transport._links[index].phase is Phase.REFUSED
        assert "--attach relay" in (transport._links[index].refused or "")
    assert listener.calls == []
    assert transport._state_extra() == {}
