"""A minimal stock-like front end (plain pyzmq) to check the simulated engine's side of the wire."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from exporter.base.ports import free_listen_port
from exporter.protocol import (
    decode_engine_outputs,
    decode_handshake_message,
    encode_init,
    encode_utility_request,
    engine_identity,
)


class StockClient:
    """Binds the handshake ROUTER, ``slots`` input ROUTERs and output PULLs; records every frame.

    ``host`` is where the input and output sockets bind (``"[::1]"`` needs a context with
    ``zmq.IPV6`` set).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        handshake_address: str,
        slots: int = 1,
        host: str = "127.0.0.1",
    ) -> None:
        self.ctx = ctx
        self.hs = ctx.socket(zmq.ROUTER)
        self.hs.setsockopt(zmq.LINGER, 0)
        self.hs.bind(handshake_address)
        self.inputs: list[zmq.asyncio.Socket] = []
        self.outputs: list[zmq.asyncio.Socket] = []
        self.input_addresses: list[str] = []
        self.output_addresses: list[str] = []
        for _ in range(slots):
            inp = ctx.socket(zmq.ROUTER)
            inp.setsockopt(zmq.LINGER, 0)
            inp.setsockopt(zmq.ROUTER_MANDATORY, 1)
            addr = f"tcp://{host}:{free_listen_port()}"
            inp.bind(addr)
            self.inputs.append(inp)
            self.input_addresses.append(addr)
            out = ctx.socket(zmq.PULL)
            out.setsockopt(zmq.LINGER, 0)
            addr = f"tcp://{host}:{free_listen_port()}"
            out.bind(addr)
            self.outputs.append(out)
            self.output_addresses.append(addr)
        self.ids = itertools.count(100)
        self.events: list[str] = []

    async def recv_hs(self, timeout_s: float = 3.0) -> tuple[bytes, Any]:
        assert await self.hs.poll(int(timeout_s * 1000)), "nothing on the handshake socket"
        identity, payload = await self.hs.recv_multipart()
        return identity, decode_handshake_message(payload)

    async def send_init(self, identity: bytes, init: bytes | None = None) -> None:
        await self.hs.send_multipart(
            [identity, init or encode_init(self.input_addresses, self.output_addresses)]
        )

    async def recv_registration(
        self, slot: int, timeout_s: float = 3.0
    ) -> tuple[bytes, dict[str, Any]]:
        assert await self.inputs[slot].poll(int(timeout_s * 1000)), (
            f"no registration on slot {slot}"
        )
        identity, payload = await self.inputs[slot].recv_multipart()
        return identity, msgspec.msgpack.decode(payload)

    async def handshake(self, rank: int) -> None:
        identity, hello = await self.recv_hs()
        assert identity == engine_identity(rank) and hello.status == "HELLO"
        await self.send_init(identity)
        for slot in range(len(self.inputs)):
            await self.recv_registration(slot)
        _, ready = await self.recv_hs()
        assert ready.status == "READY"

    async def call(
        self,
        rank: int,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        slot: int = 0,
        client_index: int | None = None,
        request_type: bytes = b"\x03",
        payload: bytes | None = None,
    ) -> int:
        call_id = next(self.ids)
        frame = payload or encode_utility_request(
            slot if client_index is None else client_index, call_id, method, args
        )
        await self.inputs[slot].send_multipart([engine_identity(rank), request_type, frame])
        return call_id

    async def recv_raw(self, slot: int = 0, timeout_s: float = 3.0) -> list[bytes] | None:
        if not await self.outputs[slot].poll(int(timeout_s * 1000)):
            return None
        return list(await self.outputs[slot].recv_multipart())

    async def reply(self, slot: int = 0, timeout_s: float = 3.0) -> Any:
        frames = await self.recv_raw(slot, timeout_s)
        assert frames is not None, "no reply"
        return decode_engine_outputs(frames[0])

    def close(self) -> None:
        for sock in [self.hs, *self.inputs, *self.outputs]:
            sock.close(linger=0)
