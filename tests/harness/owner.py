"""An owner-mode ``EngineCoreClient`` over hand-driven engines (``RawEngine``): the test sends
every engine frame itself. Real ZMQ on 127.0.0.1; every wait is bounded."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.owner import OwnerConfig, OwnerTransport, owner_client
from tests.harness.rawengine import RawEngine
from tests.harness.wire import loopback_address


class OwnerHarness:
    def __init__(self, count: int, start_rank: int = 0) -> None:
        self.address = loopback_address()
        self.ctx = zmq.asyncio.Context()
        self.faults = ProtocolErrorTally()
        config = OwnerConfig(
            handshake_address=self.address, engine_count=count, start_rank=start_rank
        )
        self.client = owner_client(config, self.faults, context=self.ctx)
        transport = self.client.transport
        assert isinstance(transport, OwnerTransport)
        self.transport = transport
        self.engines: list[RawEngine] = []

    def engine(self, index: int | bytes) -> RawEngine:
        e = RawEngine(self.ctx, self.address, index)
        self.engines.append(e)
        return e

    async def close(self) -> None:
        for e in self.engines:
            e.close()
        await self.client.close()
        self.ctx.term()


OwnerHarnessFactory = Callable[..., Awaitable[OwnerHarness]]


class OwnerHarnesses:
    """Builds harnesses for one test (``make``) and closes them all at its end (``close``)."""

    def __init__(self) -> None:
        self.made: list[OwnerHarness] = []

    async def make(self, count: int, start_rank: int = 0, start: bool = True) -> OwnerHarness:
        h = OwnerHarness(count, start_rank)
        self.made.append(h)
        if start:
            await h.client.start()
        return h

    async def close(self) -> None:
        for h in self.made:
            await h.close()
