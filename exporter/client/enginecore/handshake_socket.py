"""The handshake ROUTER the engines dial, and its supervised receive loop.

Bound for the life of the process (restarted engines handshake again); ``ROUTER_HANDOVER`` lets
a restarted engine's new connection take its identity over. It sees a few frames per engine
lifetime, so it stays on ``zmq.asyncio``; the loop runs under ``supervise`` (a crash is logged,
counted and the loop restarted) and a ``ProtocolError`` from one message is counted, never fatal:
a single hostile frame never stops future handshakes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.base.tasks import cancel_and_wait, supervise
from exporter.client.enginecore import sockets
from exporter.error import ProtocolError

#: Handles one message (identity and payload frames) from the handshake ROUTER.
OnHandshakeFrames = Callable[[zmq.asyncio.Socket, list[bytes]], Awaitable[None]]


class HandshakeSocket:
    def __init__(
        self, ctx: zmq.asyncio.Context, faults: ProtocolErrorTally, on_frames: OnHandshakeFrames
    ) -> None:
        self._ctx = ctx
        self._faults = faults
        self._on_frames = on_frames
        self.sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self, address: str) -> None:
        """Bind ``address`` and start receiving; ZMQError (socket closed) when it cannot bind."""
        sock = sockets.async_socket(self._ctx, zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            sock.bind(address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self.sock = sock
        self._task = supervise("handshake", lambda: self._loop(sock), self._faults)

    async def close(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None

    async def _loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                await self._on_frames(sock, frames)
            except ProtocolError as exc:
                self._faults.record(exc.kind, f"handshake socket: {exc}")
