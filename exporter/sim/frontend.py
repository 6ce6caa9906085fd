"""A simulated stock vLLM front end: the upstream of relay mode in tests and the demo.

It is owner mode reused as is (``OwnerTransport`` + ``EngineCoreClient`` on client slot 0): it
binds a handshake ROUTER, answers each HELLO with an INIT naming its own input and output
addresses, waits for READY and the registration, and then makes its own utility calls on slot 0
(``is_sleeping`` in a loop), so tests can prove that the exporter's relayed slot and the front
end's slot never cross-talk. It also counts every HELLO/READY it receives per engine and keeps
their raw bytes, to check that the relay forwards each exactly once and byte for byte, and keeps
the last ``KEPT_OUTPUTS`` output frames of each engine as received (``outputs``), to check that
what an engine sent its slot arrives unchanged.

Given ``coordinator`` (each engine's (running, waiting)), it also plays vLLM's DP coordinator:
an XPUB on loopback named in every INIT as ``frontend_stats_publish_address``, publishing
``(counts, wave, running)`` every 100 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.enginecore.events import TransportListener
from exporter.client.enginecore.links import EngineLink
from exporter.client.fleet import EngineOutcome, Outcome, connected_count
from exporter.client.owner.transport import OwnerConfig, OwnerTransport
from exporter.error import ProtocolError
from exporter.protocol import decode_handshake_message
from exporter.protocol.handshake import EngineHandshakeMetadata, EngineZmqAddresses

log = logging.getLogger("exporter.sim.frontend")
#: Output frames kept per engine (the first frame of each message, as received).
KEPT_OUTPUTS = 1000


class _CountingOwnerTransport(OwnerTransport):
    """``OwnerTransport`` that also records every handshake message it receives, and names
    the simulated coordinator's publication in its INITs."""

    def __init__(
        self, config: OwnerConfig, listener: TransportListener, faults: ProtocolErrorTally
    ) -> None:
        super().__init__(config, listener, faults)
        self.stats_publish_address: str | None = None
        #: (engine identity, status) → number of messages received.
        self.received: Counter[tuple[bytes, str]] = Counter()
        #: (engine identity, status) → raw payloads, in arrival order.
        self.payloads: dict[tuple[bytes, str], list[bytes]] = {}
        #: engine index → its last output frames, in arrival order.
        self.outputs: dict[int, deque[bytes]] = {}

    async def _on_handshake_frames(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        if len(frames) == 2:
            with contextlib.suppress(ProtocolError):
                status = decode_handshake_message(frames[1]).status
                self.received[(frames[0], status)] += 1
                self.payloads.setdefault((frames[0], status), []).append(frames[1])
        await super()._on_handshake_frames(sock, frames)

    def _on_output_frames(self, link: EngineLink, frames: list[bytes], fd: int) -> None:
        kept = self.outputs.setdefault(link.engine_index, deque(maxlen=KEPT_OUTPUTS))
        kept.append(bytes(frames[0]))
        super()._on_output_frames(link, frames, fd)

    def _init_for(self, link: EngineLink) -> bytes:
        if self.stats_publish_address is None:
            return super()._init_for(link)
        addresses = EngineZmqAddresses(
            [self.input_address],
            [link.output_address],
            frontend_stats_publish_address=self.stats_publish_address,
        )
        return msgspec.msgpack.encode(EngineHandshakeMetadata(addresses, {}))


@dataclass
class SimFrontend:
    """Handshake owner + its own slot-0 client, calling ``is_sleeping`` every ``call_period_s``."""

    handshake_address: str
    engine_count: int
    start_rank: int = 0
    call_period_s: float = 0.05
    call_timeout_s: float = 1.0
    faults: ProtocolErrorTally = field(default_factory=ProtocolErrorTally)
    #: Every per-engine outcome of the front end's own calls, in order.
    outcomes: list[EngineOutcome] = field(default_factory=list)
    #: Play vLLM's DP coordinator: every engine's (running, waiting), in engine-index order
    #: (entries that are not such pairs are published as they are, and bytes as a whole
    #: message: a hostile coordinator).
    coordinator: Callable[[], list[Any] | bytes] | None = None
    coordinator_interval_s: float = 0.1

    def __post_init__(self) -> None:
        config = OwnerConfig(
            handshake_address=self.handshake_address,
            engine_count=self.engine_count,
            start_rank=self.start_rank,
        )
        transports: list[_CountingOwnerTransport] = []

        def make(listener: TransportListener) -> _CountingOwnerTransport:
            transports.append(_CountingOwnerTransport(config, listener, self.faults))
            return transports[-1]

        self.client = EngineCoreClient(make, self.faults)
        self.transport = transports[0]
        self._task: asyncio.Task[None] | None = None
        self._publisher: zmq.asyncio.Socket | None = None
        self._publishing: asyncio.Task[None] | None = None

    @property
    def engine_indices(self) -> list[int]:
        return self.transport.engine_indices

    def hello_count(self, engine_index: int) -> int:
        return self.transport.received[(engine_index.to_bytes(2, "little"), "HELLO")]

    def ready_count(self, engine_index: int) -> int:
        return self.transport.received[(engine_index.to_bytes(2, "little"), "READY")]

    def payloads(self, engine_index: int, status: str) -> list[bytes]:
        return self.transport.payloads.get((engine_index.to_bytes(2, "little"), status), [])

    def outputs(self, engine_index: int) -> list[bytes]:
        """The last output frames received from ``engine_index`` (at most ``KEPT_OUTPUTS``)."""
        return list(self.transport.outputs.get(engine_index, ()))

    def ok_count(self, engine_index: int | None = None) -> int:
        return sum(
            1
            for o in self.outcomes
            if o.outcome is Outcome.OK and (engine_index is None or o.engine == str(engine_index))
        )

    def dead(self, engine_index: int) -> bool:
        links = self.transport.link_snapshots()
        return any(s.dead for s in links if s.engine_index == engine_index)

    async def start(self, *, call_loop: bool = True) -> None:
        """Bind and start handshaking; with ``call_loop`` also start the slot-0 calls."""
        if self.coordinator is not None:
            self._publisher = zmq.asyncio.Context.instance().socket(zmq.XPUB)
            self._publisher.setsockopt(zmq.LINGER, 0)
            port = self._publisher.bind_to_random_port("tcp://127.0.0.1")
            self.transport.stats_publish_address = f"tcp://127.0.0.1:{port}"
            self._publishing = asyncio.create_task(self._publish_loop(self._publisher))
        await self.client.start()
        if call_loop:
            self._task = asyncio.create_task(self._call_loop(), name="sim-frontend-calls")

    async def _publish_loop(self, sock: zmq.asyncio.Socket) -> None:
        """vLLM's coordinator: ``(counts, wave, running)`` to every subscriber."""
        assert self.coordinator is not None
        while True:
            published = self.coordinator()
            if isinstance(published, bytes):  # a hostile coordinator's raw message
                await sock.send(published)
            else:
                counts = [
                    [pair[1], pair[0], 0.0] if isinstance(pair, tuple) and len(pair) == 2 else pair
                    for pair in published
                ]
                await sock.send(msgspec.msgpack.encode((counts, 0, False)))
            await asyncio.sleep(self.coordinator_interval_s)

    async def wait_connected(self, timeout_s: float) -> None:
        await self.transport.wait_connected(timeout_s)

    async def _call_loop(self) -> None:
        while True:
            if connected_count(self.client):
                connected = [
                    str(s.engine_index) for s in self.transport.link_snapshots() if s.connected
                ]
                outcomes = await self.client.call_utility(
                    "is_sleeping", timeout_s=self.call_timeout_s, engines=connected
                )
                self.outcomes.extend(outcomes)
            await asyncio.sleep(self.call_period_s)

    async def close(self) -> None:
        if self._publishing is not None:
            self._publishing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publishing
            self._publishing = None
        if self._publisher is not None:
            self._publisher.close(linger=0)
            self._publisher = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.client.close()
