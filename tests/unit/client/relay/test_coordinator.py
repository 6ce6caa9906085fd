"""``CoordinatorCounts``: the DP coordinator's publication decoded into per-rank counts, only
the fleet's ranks kept, forgotten once stale (an injected clock), and its subscription over a
stub SUB socket (nothing connects)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import msgspec
import zmq

from exporter.base.faults import ProtocolErrorTally
from exporter.client.relay.coordinator import STALE_AFTER_S, CoordinatorCounts
from exporter.protocol.activity import MAX_COORDINATOR_MESSAGE, RequestCounts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class StubSub:
    """A SUB socket that hands out queued publications and then waits."""

    def __init__(self, connect_error: bool = False) -> None:
        self.options: dict[int, Any] = {}
        self.connected: list[str] = []
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.closed = False
        self.connect_error = connect_error

    def setsockopt(self, option: int, value: Any) -> None:
        self.options[option] = value

    def connect(self, address: str) -> None:
        if self.connect_error:
            raise zmq.ZMQError(22)
        self.connected.append(address)

    async def poll(self, timeout: int) -> int:
        await self.inbox.put(await self.inbox.get())  # wait for one, leave it queued
        return 1

    async def recv(self, flags: int = 0) -> bytes:
        return self.inbox.get_nowait()

    def close(self, linger: int | None = None) -> None:
        self.closed = True


class StubContext:
    def __init__(self, *socks: StubSub) -> None:
        self.socks = list(socks)

    def socket(self, kind: int) -> StubSub:
        assert kind == zmq.SUB
        return self.socks.pop(0)


def publication(*ranks: Any) -> bytes:
    """vLLM's ``(counts, wave, running)``: each rank ``[waiting, running]``."""
    return msgspec.msgpack.encode([list(ranks), 0, False])


def counts(ranks: range = range(3), context: Any = None) -> tuple[CoordinatorCounts, Clock]:
    out = CoordinatorCounts(cast(Any, context or object()), ProtocolErrorTally(), ranks)
    clock = Clock()
    out._clock = clock
    return out, clock


def test_only_the_fleets_ranks_are_kept_by_their_position() -> None:
    out, _ = counts(range(1, 3))
    out._take(publication([0, 0], [4, 1], [0, 7], [9, 9]))
    assert out.counts() == {
        1: RequestCounts(running=1, waiting=4),
        2: RequestCounts(running=7, waiting=0),
    }
    assert out.publications == 1


def test_counts_go_unknown_once_no_publication_came_for_the_stale_time() -> None:
    """A coordinator gone quiet is unknown, never idle."""
    out, clock = counts()
    assert out.counts() == {}  # nothing published yet
    out._take(publication([0, 0], [0, 0], [1, 2]))
    clock.now += STALE_AFTER_S
    assert out.counts() == {0: RequestCounts(0, 0), 1: RequestCounts(0, 0), 2: RequestCounts(2, 1)}
    clock.now += 0.001
    assert out.counts() == {}
    out._take(publication([0, 0], [0, 0], [0, 0]))
    assert len(out.counts()) == 3


def test_a_malformed_publication_is_counted_and_keeps_the_last_counts() -> None:
    out, _ = counts()
    out._take(publication([1, 1], [2, 2], [3, 3]))
    out._take(b"\xc1")
    out._take(msgspec.msgpack.encode({"not": "a triple"}))
    out._take(b"\x90" * (MAX_COORDINATOR_MESSAGE + 1))
    assert out._faults.counts == {"bad_coordinator_stats": 3}
    assert out.publications == 1
    assert out.counts()[2] == RequestCounts(3, 3)


def test_a_rank_whose_entry_is_not_two_counts_is_unknown_not_zero() -> None:
    out, _ = counts()
    out._take(publication([1, 1], ["x", 1], [-1, 0]))
    assert out.counts() == {0: RequestCounts(1, 1)}


async def test_follow_subscribes_to_everything_bounded_and_reads_publications() -> None:
    sub = StubSub()
    out, _ = counts(context=StubContext(sub))
    out.follow(None)
    out.follow("")
    assert out.address is None
    out.follow("tcp://10.0.0.1:9000")
    out.follow("tcp://10.0.0.1:9000")  # the same address: no second subscription
    sub.inbox.put_nowait(publication([0, 0], [3, 2], [0, 0]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert sub.connected == ["tcp://10.0.0.1:9000"]
    assert sub.options[zmq.SUBSCRIBE] == b""
    assert sub.options[zmq.MAXMSGSIZE] == MAX_COORDINATOR_MESSAGE
    assert out.counts()[1] == RequestCounts(running=2, waiting=3)
    await out.close()
    assert sub.closed and out.counts() == {}


async def test_a_new_address_forgets_the_old_counts_and_a_bad_one_is_counted() -> None:
    first, second = StubSub(), StubSub(connect_error=True)
    out, _ = counts(context=StubContext(first, second))
    out.follow("tcp://10.0.0.1:9000")
    first.inbox.put_nowait(publication([0, 0], [0, 0], [0, 0]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert len(out.counts()) == 3
    out.follow("not an address")
    assert out.counts() == {} and out.address == "not an address"
    for _ in range(10):
        await asyncio.sleep(0)
    assert first.closed and second.closed
    assert out._faults.counts == {"bad_coordinator_address": 1}
    await out.close()
