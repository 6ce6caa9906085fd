"""A hand-driven engine for conformance tests: every frame is sent explicitly by the test."""

from __future__ import annotations

from typing import Any

import zmq
import zmq.asyncio

from exporter.protocol import (
    decode_init,
    decode_utility_request,
    encode_handshake_message,
    encode_registration,
    engine_identity,
    registration_map,
)


class RawEngine:
    def __init__(
        self, ctx: zmq.asyncio.Context, handshake_address: str, index: int | bytes
    ) -> None:
        self.ctx = ctx
        self.identity = index if isinstance(index, bytes) else engine_identity(index)
        self.hs = ctx.socket(zmq.DEALER)
        self.hs.setsockopt(zmq.IDENTITY, self.identity)
        self.hs.setsockopt(zmq.LINGER, 0)
        self.hs.connect(handshake_address)
        self.inputs: list[zmq.asyncio.Socket] = []
        self.outputs: list[zmq.asyncio.Socket] = []
        self.init_raw: bytes | None = None

    async def hello(self, **flags: Any) -> None:
        await self.hs.send(
            encode_handshake_message("HELLO", **{"local": False, "headless": True, **flags})
        )

    async def recv_init(self, timeout_s: float = 3.0) -> None:
        assert await self.hs.poll(int(timeout_s * 1000)), "no INIT"
        self.init_raw = await self.hs.recv()
        init = decode_init(self.init_raw)
        for address in init.addresses.inputs:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, self.identity)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.inputs.append(sock)
        for address in init.addresses.outputs:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.outputs.append(sock)

    async def register(self, payload: bytes | None = None, rank: int = 0) -> None:
        frame = encode_registration(registration_map(rank)) if payload is None else payload
        for sock in self.inputs:
            await sock.send(frame)

    async def ready(self) -> None:
        await self.hs.send(encode_handshake_message("READY", local=False, headless=True))

    async def handshake(self, rank: int = 0) -> None:
        await self.hello()
        await self.recv_init()
        await self.register(rank=rank)
        await self.ready()

    async def recv_request(self, timeout_s: float = 3.0, slot: int = 0) -> tuple[bytes, Any]:
        sock = self.inputs[slot]
        assert await sock.poll(int(timeout_s * 1000)), "no request"
        frames = await sock.recv_multipart()
        return frames[0], decode_utility_request(frames[1])

    async def has_request(self, timeout_s: float, slot: int = 0) -> bool:
        return bool(await self.inputs[slot].poll(int(timeout_s * 1000)))

    async def send_output(self, frame: bytes | list[bytes], slot: int = 0) -> None:
        frames = frame if isinstance(frame, list) else [frame]
        await self.outputs[slot].send_multipart(frames)

    def close(self) -> None:
        for sock in [self.hs, *self.inputs, *self.outputs]:
            sock.close(linger=0)
