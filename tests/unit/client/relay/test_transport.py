"""``RelayTransport``'s handshake relay over stub sockets (nothing is bound or connected): HELLO
and READY go up byte for byte, INIT comes down with the exporter's slot appended when it can be
rewritten exactly, and every attempt ends in one counted result."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import pytest
import zmq

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.links import Phase
from exporter.client.relay.transport import RelayConfig, RelayLink, RelayTransport
from exporter.error import ProtocolError
from exporter.protocol import (
    HELLO,
    READY,
    decode_init,
    encode_handshake_message,
    encode_init,
    encode_registration,
    engine_identity,
    registration_map,
)

HELLO_MSG = encode_handshake_message(HELLO, local=False, headless=True)
READY_MSG = encode_handshake_message(READY)
FRONT_END_INIT = encode_init(["tcp://fe:1"], ["tcp://fe:2"])


class StubSocket:
    """An upstream DEALER (or the coordinator's SUB): records what is sent, hands out what is
    queued, and says when it was closed and with which linger."""

    def __init__(self) -> None:
        self.options: dict[int, Any] = {}
        self.connected: list[str] = []
        self.sent: list[bytes] = []
        self.inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.linger: int | None = None

    def setsockopt(self, option: int, value: Any) -> None:
        self.options[option] = value

    def connect(self, address: str) -> None:
        self.connected.append(address)

    async def send(self, payload: bytes) -> None:
        self.sent.append(payload)

    async def poll(self, timeout: float) -> int:
        try:
            frames = await asyncio.wait_for(self.inbox.get(), timeout / 1000)
        except asyncio.TimeoutError:
            return 0
        self.inbox.put_nowait(frames)
        return 1

    async def recv_multipart(self) -> list[bytes]:
        return await self.inbox.get()

    def close(self, linger: int | None = None) -> None:
        self.linger = linger


class StubContext:
    def __init__(self) -> None:
        self.made: list[tuple[int, StubSocket]] = []

    def socket(self, kind: int) -> StubSocket:
        self.made.append((kind, StubSocket()))
        return self.made[-1][1]

    def dealers(self) -> list[StubSocket]:
        return [sock for kind, sock in self.made if kind == zmq.DEALER]


class Router:
    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)

    def close(self, linger: int | None = None) -> None:
        return None


class Listener:
    def on_output(self, engine_index: int, output: object) -> bool:
        return False

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        return None

    def on_engine_hello(self, engine_index: int) -> None:
        return None

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        return None

    def on_death_claimed(self, engine_index: int) -> None:
        return None


def relay(timeout_s: float = 5.0) -> tuple[RelayTransport, StubContext, Router]:
    config = RelayConfig(
        engine_count=2,
        handshake_address="tcp://127.0.0.1:1",
        upstream_handshake_address="tcp://fe:0",
        upstream_timeout_s=timeout_s,
    )
    ctx, router = StubContext(), Router()
    transport = RelayTransport(config, Listener(), ProtocolErrorTally(), context=cast(Any, ctx))
    transport.input_address = "tcp://10.0.0.1:7000"
    transport._links[0].output_address = "tcp://10.0.0.1:7001"
    transport._handshake_side.sock = cast(Any, router)
    return transport, ctx, router


async def say(transport: RelayTransport, index: int, payload: bytes) -> None:
    await transport._on_handshake_frames(cast(Any, None), [engine_identity(index), payload])


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_relayed_handshake_appends_the_exporters_slot() -> None:
    transport, ctx, router = relay()
    await say(transport, 0, HELLO_MSG)
    (upstream,) = ctx.dealers()
    assert upstream.options[zmq.IDENTITY] == engine_identity(0)  # the front end sees the engine
    assert upstream.connected == ["tcp://fe:0"] and upstream.sent == [HELLO_MSG]
    assert transport.phase(0) is Phase.HELLO_SENT
    upstream.inbox.put_nowait([FRONT_END_INIT])
    await settle()
    ((identity, init),) = router.sent
    addresses = decode_init(init).addresses
    assert identity == engine_identity(0)
    assert addresses.inputs == ["tcp://fe:1", "tcp://10.0.0.1:7000"]
    assert addresses.outputs == ["tcp://fe:2", "tcp://10.0.0.1:7001"]
    assert transport.init_frames(0) == (FRONT_END_INIT, init)
    await say(transport, 0, READY_MSG)
    assert upstream.sent == [HELLO_MSG, READY_MSG]
    assert upstream.linger == 5000  # READY must not be dropped on close
    transport._on_input_frames([engine_identity(0), encode_registration(registration_map(0))])
    assert transport.phase(0) is Phase.UP and transport.client_index(0) == 1
    assert transport.handshake_results == {"completed": 1}
    await transport._close_control()


async def test_an_init_that_cannot_be_rewritten_goes_down_unchanged() -> None:
    """The engine then works for the front end alone; the exporter has no slot on it."""
    transport, ctx, router = relay()
    await say(transport, 0, HELLO_MSG)
    mismatched = encode_init(["tcp://fe:1"], ["tcp://fe:2", "tcp://fe:3"])
    ctx.dealers()[0].inbox.put_nowait([mismatched])
    await settle()
    assert router.sent == [[engine_identity(0), mismatched]]
    assert transport._faults.counts == {"init_slot_mismatch": 1}
    await say(transport, 0, READY_MSG)
    assert transport.phase(0) is Phase.UP
    assert transport._links[0].slot is None and not transport.is_callable(0)
    assert transport.handshake_results == {"init_rewrite_refused": 1}
    await transport._close_control()


async def test_a_new_hello_mid_handshake_supersedes_the_old_one() -> None:
    transport, ctx, _ = relay()
    await say(transport, 0, HELLO_MSG)
    await say(transport, 0, HELLO_MSG)
    first, second = ctx.dealers()
    assert first.linger == 0  # a HELLO still queued for the front end is dropped
    assert second.sent == [HELLO_MSG]
    assert transport.handshake_results == {"superseded": 1}
    link = transport._links[0]
    assert isinstance(link, RelayLink) and (link.attempt, link.handshakes) == (2, 2)
    await transport._close_control()


async def test_no_init_from_the_front_end_in_time_ends_the_attempt() -> None:
    transport, ctx, router = relay(timeout_s=0.01)
    await say(transport, 1, HELLO_MSG)
    link = transport._links[1]
    assert isinstance(link, RelayLink) and link.upstream_task is not None
    await asyncio.wait_for(link.upstream_task, 1.0)
    assert transport.phase(1) is Phase.IDLE
    assert ctx.dealers()[0].linger == 0 and router.sent == []
    assert transport.handshake_results == {"upstream_timeout": 1}
    await transport._close_control()


async def test_an_init_naming_the_coordinators_publication_is_followed() -> None:
    transport, ctx, _ = relay()
    await say(transport, 0, HELLO_MSG)
    init = msgspec.msgpack.encode(
        {
            "addresses": {
                "inputs": ["tcp://fe:1"],
                "outputs": ["tcp://fe:2"],
                "frontend_stats_publish_address": "tcp://fe:9",
            },
            "parallel_config": {},
        }
    )
    ctx.dealers()[0].inbox.put_nowait([init])
    await settle()
    assert transport.coordinator.address == "tcp://fe:9"
    assert transport._state_extra()["coordinator_stats_address"] == "tcp://fe:9"
    assert [kind for kind, _ in ctx.made] == [zmq.DEALER, zmq.SUB]
    await transport._close_control()


async def test_ready_out_of_order_is_rejected_and_nothing_goes_up() -> None:
    transport, ctx, _ = relay()
    with pytest.raises(ProtocolError) as raised:
        await say(transport, 0, READY_MSG)
    assert raised.value.kind == "unexpected_ready"
    assert ctx.made == []
    with pytest.raises(ProtocolError, match="identity 0500"):
        await say(transport, 5, HELLO_MSG)
    assert "0500" in transport.unexpected.seen


def test_the_relay_counts_its_handshakes_and_its_upstream_sockets() -> None:
    transport, _, _ = relay()
    assert set(transport.counters()) == {
        "vllm_dp_relay_handshakes_total",
        "vllm_dp_state_file_writes_total",
    }
    assert transport.SOCKETS_PER_ENGINE == 1 and transport.FDS_PER_ENGINE == 5
    assert transport.request_counts() == {}
    with pytest.raises(ValueError, match="linger"):
        RelayConfig(
            engine_count=1,
            handshake_address="a",
            upstream_handshake_address="b",
            upstream_linger_ms=0,
        )
