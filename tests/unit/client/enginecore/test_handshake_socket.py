"""``HandshakeSocket`` over a stub context and socket: one hostile message never stops future
handshakes, a failed bind leaves nothing open, and close ends the loop (no real socket)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
import zmq

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.handshake_socket import HandshakeSocket
from exporter.error import ProtocolError


class StubSocket:
    """Hands out queued messages; records its options, binds and close."""

    def __init__(self, bind_error: int | None = None) -> None:
        self.inbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.options: dict[int, int] = {}
        self.bound: list[str] = []
        self.closed_with: int | None = None
        self.bind_error = bind_error

    def setsockopt(self, option: int, value: int) -> None:
        self.options[option] = value

    def bind(self, address: str) -> None:
        if self.bind_error is not None:
            raise zmq.ZMQError(self.bind_error)
        self.bound.append(address)

    def close(self, linger: int | None = None) -> None:
        self.closed_with = linger

    async def recv_multipart(self) -> list[bytes]:
        return await self.inbox.get()


class StubContext:
    def __init__(self, sock: StubSocket) -> None:
        self.sock = sock
        self.kinds: list[int] = []

    def socket(self, kind: int) -> StubSocket:
        self.kinds.append(kind)
        return self.sock


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_messages_reach_the_handler_and_a_bad_one_is_only_counted() -> None:
    seen: list[list[bytes]] = []

    async def on_frames(sock: Any, frames: list[bytes]) -> None:
        if frames[0] == b"bad":
            raise ProtocolError("wrong_shape", "hostile")
        seen.append(frames)

    sock, faults = StubSocket(), ProtocolErrorTally()
    side = HandshakeSocket(cast(Any, StubContext(sock)), faults, on_frames)
    side.open("tcp://127.0.0.1:5555")
    for frames in ([b"\x00\x00", b"hello"], [b"bad"], [b"\x01\x00", b"hello"]):
        sock.inbox.put_nowait(frames)
    await settle()
    assert seen == [[b"\x00\x00", b"hello"], [b"\x01\x00", b"hello"]]
    assert faults.counts == {"wrong_shape": 1}
    assert faults.task_failures == {}
    await side.close()


async def test_open_binds_a_router_that_lets_a_restarted_engine_take_its_identity() -> None:
    async def on_frames(sock: Any, frames: list[bytes]) -> None:
        return None

    sock = StubSocket()
    ctx = StubContext(sock)
    side = HandshakeSocket(cast(Any, ctx), ProtocolErrorTally(), on_frames)
    side.open("tcp://0.0.0.0:5555")
    assert ctx.kinds == [zmq.ROUTER]
    assert sock.options[zmq.ROUTER_HANDOVER] == 1
    assert sock.bound == ["tcp://0.0.0.0:5555"]
    assert side.sock is cast(Any, sock)
    await side.close()
    assert side.sock is None and sock.closed_with == 0


async def test_a_failed_bind_closes_the_socket_and_raises() -> None:
    async def on_frames(sock: Any, frames: list[bytes]) -> None:
        return None

    sock = StubSocket(bind_error=98)
    side = HandshakeSocket(cast(Any, StubContext(sock)), ProtocolErrorTally(), on_frames)
    with pytest.raises(zmq.ZMQError):
        side.open("tcp://127.0.0.1:5555")
    assert sock.closed_with == 0
    assert side.sock is None and side._task is None


async def test_close_ends_the_receive_loop_and_is_safe_twice() -> None:
    async def on_frames(sock: Any, frames: list[bytes]) -> None:
        return None

    sock = StubSocket()
    side = HandshakeSocket(cast(Any, StubContext(sock)), ProtocolErrorTally(), on_frames)
    await side.close()  # never opened: nothing to do
    side.open("tcp://127.0.0.1:5555")
    task = side._task
    assert task is not None
    await side.close()
    assert task.done()
    await side.close()
