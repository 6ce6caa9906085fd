"""The ZMQ load publisher over real sockets on 127.0.0.1, read as an SGLang-speaking router
reads it: one SUB per rank on BASE + r, three frames per message, seq counting up per socket;
a change sent at once, an idle value re-sent with the next seq; a taken port recorded while the
other ranks publish; a subscriber that never reads never blocks a publish; the rank_state topic;
close() frees the ports."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from exporter.base.ports import free_port_range
from exporter.client.fleet import EngineDetail
from exporter.feed.loadstat import Frames, LoadStat, RankState, decode_frames
from exporter.feed.publisher import LoadPublisher
from exporter.fleetstate.snapshot import FleetSnapshot
from exporter.protocol.activity import RequestCounts
from tests.harness.snapshots import engine_snapshot, polled

AWAKE: dict[str, Any] = {"is_sleeping": False, "is_scheduler_paused": False, "has_work": True}
FACTS = (("kv_cache_size_tokens", 4096), ("max_num_seqs", 32))
#: How long a message that must come is waited for (generous: a loaded 2-core machine).
ARRIVAL_S = 5.0


def fleet(ranks: range | list[int], running: int = 0, paused: bool = False) -> FleetSnapshot:
    answers = {**AWAKE, "is_scheduler_paused": paused}
    return polled(
        *(
            engine_snapshot(
                str(r),
                EngineDetail(str(r), True, f"fake://{r}", requests=RequestCounts(running, r)),
                **answers,
            )
            for r in ranks
        )
    )


def with_facts(snap: FleetSnapshot) -> FleetSnapshot:
    engines = tuple(
        engine_snapshot(
            e.engine,
            EngineDetail(e.engine, True, "x", registration=FACTS, requests=RequestCounts(0, 0)),
            **AWAKE,
        )
        for e in snap.engines
    )
    return polled(*engines)


class Reader:
    """A router's SUB socket on one rank's port."""

    def __init__(self, ctx: zmq.asyncio.Context, port: int, topic: bytes = b"load") -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")

    async def raw(self, timeout: float = ARRIVAL_S) -> list[bytes]:
        return list(await asyncio.wait_for(self.sub.recv_multipart(), timeout))

    async def next(self, timeout: float = ARRIVAL_S) -> Frames:
        frames = await self.raw(timeout)
        assert len(frames) == 3 and len(frames[1]) == 8, frames
        return decode_frames(frames)


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@contextlib.contextmanager
def publisher(base: int, resend_s: float = 1.0) -> Iterator[LoadPublisher]:
    pub = LoadPublisher("127.0.0.1", base, resend_s=resend_s)
    try:
        yield pub
    finally:
        pub.close()


@contextlib.asynccontextmanager
async def heartbeats(pub: LoadPublisher) -> AsyncIterator[None]:
    task = asyncio.create_task(pub.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def prime(pub: LoadPublisher, readers: dict[int, Reader], mark: int) -> dict[int, Frames]:
    """Publish changing values until every reader's subscription is through (a PUB drops what
    comes before it), then a last one, ``running == mark``; each reader's message with it."""
    waiting = set(readers)
    for i in range(400):
        if not waiting:
            break
        pub.publish(fleet(sorted(readers), running=10_000 + i))
        for rank in list(waiting):
            with contextlib.suppress(asyncio.TimeoutError):
                await readers[rank].next(timeout=0.02)
                waiting.discard(rank)
    assert not waiting, f"no subscription of ranks {waiting} got through"
    pub.publish(fleet(sorted(readers), running=mark))
    found = {}
    for rank, reader in readers.items():
        while True:
            got = await reader.next()
            assert isinstance(got.message, LoadStat)
            if got.message.num_running_reqs == mark:
                found[rank] = got
                break
    return found


async def test_each_rank_publishes_sglangs_frames_on_its_own_port(
    ctx: zmq.asyncio.Context,
) -> None:
    base = free_port_range(3)
    with publisher(base) as pub:
        readers = {r: Reader(ctx, base + r) for r in range(3)}
        last = await prime(pub, readers, mark=1)
        for running in (2, 3, 4):
            pub.publish(fleet(range(3), running=running))
        for rank, reader in readers.items():
            seq = last[rank].seq
            for running in (2, 3, 4):
                frames = await reader.raw()
                assert len(frames) == 3 and frames[0] == b"load"
                seq += 1
                assert frames[1] == seq.to_bytes(8, "big", signed=True)
                body = msgspec.msgpack.decode(frames[2])
                assert body == ["LoadStat", running, rank, 0, 0, rank, 0, 0, 0, 0, 0]
        doc = pub.status_json()
        assert doc["base"] == f"tcp://127.0.0.1:{base}"
        assert [(e["engine"], e["bound"], e["error"]) for e in doc["endpoints"]] == [
            ("0", True, None),
            ("1", True, None),
            ("2", True, None),
        ]
        assert [e["endpoint"] for e in doc["endpoints"]] == [
            f"tcp://127.0.0.1:{base + r}" for r in range(3)
        ]
        # a priming load, the mark and three changes read on each; one rank state at least
        assert all(e["sent"] >= 6 for e in doc["endpoints"])
        figures = pub.figures()
        handed = sum(figures["vllm_dp_load_messages_total"].values())
        assert handed == sum(e["sent"] for e in doc["endpoints"])
        assert figures["vllm_dp_load_messages_total"][("rank_state",)] >= 3


async def test_registration_facts_reach_the_wire(ctx: zmq.asyncio.Context) -> None:
    base = free_port_range(1)
    with publisher(base) as pub:
        reader = Reader(ctx, base)
        await prime(pub, {0: reader}, mark=1)
        pub.publish(with_facts(fleet([0])))
        got = await reader.next()
        assert got.message == LoadStat(0, 0, 0, 4096, 0, max_running_requests=32)


def unknown_counts(snap: FleetSnapshot) -> FleetSnapshot:
    """``snap`` with no rank's request counts known (owner mode, or before the first count)."""
    engines = tuple(
        engine_snapshot(e.engine, EngineDetail(e.engine, True, "x"), **AWAKE) for e in snap.engines
    )
    return polled(*engines)


async def test_unknown_counts_send_no_load_but_the_rank_state(ctx: zmq.asyncio.Context) -> None:
    """A 0 would read as an idle rank: a router hears nothing and falls back to its own count."""
    base = free_port_range(1)
    with publisher(base, resend_s=0.2) as pub:
        reader = Reader(ctx, base)
        states = Reader(ctx, base, topic=b"rank_state")
        primed = (await prime(pub, {0: reader}, mark=1))[0]
        async with heartbeats(pub):
            for _ in range(5):  # a second of polls without counts, heartbeats running
                pub.publish(unknown_counts(fleet([0])))
                await asyncio.sleep(0.2)
            state = await states.next()
            assert isinstance(state.message, RankState) and state.message.routable
            pub.publish(fleet([0], running=7))
            got = await reader.next()
        assert isinstance(got.message, LoadStat) and got.message.num_running_reqs == 7
        assert got.seq == primed.seq + 1, "a load message was sent while the counts were unknown"


async def test_a_change_goes_at_once_and_an_idle_value_is_resent_with_the_next_seq(
    ctx: zmq.asyncio.Context,
) -> None:
    base = free_port_range(2)
    with publisher(base, resend_s=1.0) as pub:
        readers = {r: Reader(ctx, base + r) for r in range(2)}
        async with heartbeats(pub):
            await prime(pub, readers, mark=1)
            pub.publish(fleet(range(2), running=42))
            changed = {}
            for rank, reader in readers.items():
                changed[rank] = got = await reader.next(timeout=2.0)
                assert isinstance(got.message, LoadStat) and got.message.num_running_reqs == 42
            since = time.monotonic()
            for rank, reader in readers.items():
                again = await reader.next(timeout=3.0)
                assert again.seq == changed[rank].seq + 1
                assert again.message == changed[rank].message
            assert time.monotonic() - since > 0.5  # a heartbeat, not an echo of the change


async def test_a_taken_port_is_recorded_and_the_other_ranks_publish(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    base = free_port_range(3)
    squatter = ctx.socket(zmq.PUB)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{base + 1}")
    try:
        with publisher(base) as pub, caplog.at_level(logging.WARNING, logger="exporter.feed"):
            readers = {r: Reader(ctx, base + r) for r in (0, 2)}
            pub.publish(fleet(range(3)))
            await prime(pub, readers, mark=5)
            taken = pub.status_json()["endpoints"][1]
            assert taken["engine"] == "1" and taken["bound"] is False and taken["sent"] == 0
            assert "in use" in taken["error"]
            assert pub.figures()["vllm_dp_load_bind_failures_total"] == {(): 1.0}
            warnings = [r.getMessage() for r in caplog.records if r.name == "exporter.feed"]
            assert len(warnings) == 1 and f"tcp://127.0.0.1:{base + 1}" in warnings[0]
    finally:
        squatter.close(linger=0)


async def test_a_subscriber_that_never_reads_never_blocks_publish(
    ctx: zmq.asyncio.Context,
) -> None:
    base = free_port_range(1)
    with publisher(base) as pub:
        slow = Reader(ctx, base)
        slow.sub.setsockopt(zmq.RCVHWM, 1)
        await prime(pub, {0: slow}, mark=1)  # connected and subscribed; never read again
        before = pub.figures()
        started = time.monotonic()
        for i in range(10_000):
            pub.publish(fleet([0], running=i + 2))
        assert time.monotonic() - started < 20.0
        after = pub.figures()

        def handed(figures: dict[str, dict[tuple[str, ...], float]]) -> float:
            return sum(
                figures[name][("load",)]
                for name in ("vllm_dp_load_messages_total", "vllm_dp_load_send_failures_total")
            )

        assert handed(after) - handed(before) == 10_000


async def read_state(reader: Reader, after: Frames, state: str) -> Frames:
    """The first rank state ``state`` after ``after``, every one before it the next seq (the
    heartbeat re-sends the previous state until the change)."""
    got = after
    for _ in range(100):
        previous, got = got, await reader.next()
        assert got.topic == b"rank_state" and got.seq == previous.seq + 1
        assert isinstance(got.message, RankState)
        if got.message.state == state:
            return got
    raise AssertionError(f"no {state} rank state in 100 messages")


async def test_rank_state_subscribers_read_the_routable_verdict(
    ctx: zmq.asyncio.Context,
) -> None:
    base = free_port_range(2)
    with publisher(base, resend_s=0.1) as pub:
        states = Reader(ctx, base + 1, topic=b"rank_state")
        async with heartbeats(pub):
            pub.publish(fleet(range(2)))
            first = await states.next()  # a heartbeat once the subscription is through
            assert first.message == RankState("1", True, "awake", ())
            pub.publish(fleet(range(2), paused=True))
            paused = await read_state(states, first, "paused")
            assert paused.message == RankState("1", False, "paused", ("paused",))
            pub.publish(fleet([0]))  # rank 1 left the fleet
            gone = await read_state(states, paused, "gone")
            assert gone.message == RankState("1", False, "gone", ("no longer part of the fleet",))


async def test_close_releases_the_ports(ctx: zmq.asyncio.Context) -> None:
    base = free_port_range(2)
    pub = LoadPublisher("127.0.0.1", base)
    pub.publish(fleet(range(2)))
    assert [e["bound"] for e in pub.status_json()["endpoints"]] == [True, True]
    pub.close()
    assert [e["bound"] for e in pub.status_json()["endpoints"]] == [False, False]
    pub.publish(fleet(range(2), running=3))  # after close: nothing, no error
    for port in (base, base + 1):
        again = ctx.socket(zmq.PUB)
        again.setsockopt(zmq.LINGER, 0)
        again.bind(f"tcp://127.0.0.1:{port}")
        again.close(linger=0)
