"""The floor: a minimal hand-written pyzmq fan-out against the same simulated engines.

Its own handshake owner (HELLO → INIT → READY + registration), then a hot loop of plain pyzmq:
one input ROUTER, one PULL for every engine's outputs, one request per engine, then drain the PULL
(non-blocking receives, blocking in one persistent ``zmq.Poller`` when empty) until every reply is
in. No asyncio, no futures, no per-engine sockets, no outcome objects. Only the request
encoder and the INIT encoder are borrowed from ``exporter.protocol``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import msgspec
import zmq

from exporter.protocol import (
    HELLO,
    READY,
    UTILITY_REQUEST_TYPE,
    encode_init,
    encode_utility_request,
    engine_identity,
)

_decode = msgspec.msgpack.Decoder().decode
_NOBLOCK = int(zmq.NOBLOCK)


class FloorError(Exception):
    pass


class FloorClient:
    """Owns the handshake of ``count`` engines and fans utility calls out with blocking pyzmq."""

    def __init__(self, handshake_address: str, count: int, host: str = "127.0.0.1") -> None:
        self.count = count
        self.ctx = zmq.Context()
        self.handshake = self.ctx.socket(zmq.ROUTER)
        self.input = self.ctx.socket(zmq.ROUTER)
        self.output = self.ctx.socket(zmq.PULL)
        for sock in (self.handshake, self.input, self.output):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self.input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.handshake.bind(handshake_address)
        self.input.bind(f"tcp://{host}:*")
        self.output.bind(f"tcp://{host}:*")
        self.input_address = self.input.getsockopt_string(zmq.LAST_ENDPOINT)
        self.output_address = self.output.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identities = [engine_identity(i) for i in range(count)]
        self._next_id = 1
        self._poller = zmq.Poller()
        self._poller.register(self.output, zmq.POLLIN)

    def connect(self, timeout_s: float) -> None:
        """Answer every HELLO with INIT; return once all engines sent READY and registered."""
        init = encode_init([self.input_address], [self.output_address])
        ready: set[bytes] = set()
        registered: set[bytes] = set()
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(self.input, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while len(ready) < self.count or len(registered) < self.count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise FloorError(f"floor: {len(ready)}/{self.count} engines ready in {timeout_s}s")
            for sock, _ in poller.poll(math.ceil(remaining * 1000)):
                identity, payload = sock.recv_multipart()
                if sock is self.input:
                    registered.add(identity)
                    continue
                status = _decode(payload).get("status")
                if status == HELLO:
                    self.handshake.send_multipart([identity, init])
                elif status == READY:
                    ready.add(identity)

    def call(self, method: str, timeout_s: float = 5.0) -> list[Any]:
        """One request per engine, then block until every reply arrived; values in engine order."""
        first = self._next_id
        self._next_id += self.count
        send = self.input.send_multipart
        for offset, identity in enumerate(self.identities):
            payload = encode_utility_request(0, first + offset, method)
            send([identity, UTILITY_REQUEST_TYPE, payload])
        values: list[Any] = [None] * self.count
        recv, wait = self.output.recv, self._poller.poll
        deadline = time.monotonic() + timeout_s
        received = 0
        while received < self.count:
            try:
                frame = recv(_NOBLOCK)
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not wait(math.ceil(remaining * 1000)):
                    raise FloorError(f"floor: no reply within {timeout_s}s") from None
                continue
            reply = _decode(frame)
            call_id, failure, result = reply[4]
            if failure is not None:
                raise FloorError(f"floor: engine {reply[0]} failed: {failure}")
            values[call_id - first] = result[1]
            received += 1
        return values

    def close(self) -> None:
        for sock in (self.handshake, self.input, self.output):
            sock.close(linger=0)
        self.ctx.term()


def consensus(values: list[Any]) -> Any:
    """The floor's aggregation: every engine answered the same value."""
    first = values[0]
    for v in values:
        if v != first:
            raise FloorError(f"floor: engines disagree: {values}")
    return first
