"""``--load-publisher`` wired into the service, over real ZMQ and real HTTP: HTTP mode over two
simulated API servers (ranks ``0`` and ``1``, whose ``/metrics`` publish their requests) sends
each rank's load on BASE + r, a rank given work at once; ``/status`` shows the base and each
endpoint and the series count the messages; owner mode (no request counts) sends the rank
state and no load; a port already taken is a clear error in ``/status`` while the other rank
publishes and ``/metrics`` serves on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq
import zmq.asyncio

from exporter.base.ports import free_port_range
from exporter.feed.loadstat import LoadStat, RankState, decode_frames
from tests.harness.apiservers import ApiServers, http_config
from tests.harness.scrape import metric_value
from tests.harness.service import ServiceFactory, Services

ARRIVAL_S = 5.0


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def subscriber(ctx: zmq.asyncio.Context, port: int, topic: bytes) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


async def next_message(sub: zmq.asyncio.Socket, timeout_s: float = ARRIVAL_S) -> object:
    frames = await asyncio.wait_for(sub.recv_multipart(), timeout_s)
    return decode_frames(frames).message


async def first_load(sub: zmq.asyncio.Socket, running: int) -> LoadStat:
    """The first load message with ``running`` requests (the heartbeat re-sends each second)."""
    for _ in range(30):
        message = await next_message(sub)
        assert isinstance(message, LoadStat)
        if message.num_running_reqs == running:
            return message
    raise AssertionError(f"no load with {running} running in 30 messages")


@pytest.fixture
async def http_services() -> AsyncIterator[tuple[ApiServers, Services]]:
    apis, services = ApiServers(), Services(start=False)
    yield apis, services
    await services.close()
    await apis.close()


async def test_http_mode_publishes_each_ranks_load_on_its_own_port(
    http_services: tuple[ApiServers, Services], ctx: zmq.asyncio.Context
) -> None:
    apis, services = http_services
    servers = [await apis.start(engines=1), await apis.start(engines=1)]
    base = free_port_range(2)
    config = http_config(
        [s.url for s in servers], poll_interval=0.2, load_publisher=f"tcp://127.0.0.1:{base}"
    )
    svc = await services.serve(config)
    subs = [subscriber(ctx, base + r, b"load") for r in range(2)]
    for rank, sub in enumerate(subs):
        idle = await first_load(sub, 0)
        assert idle.attn_dp_rank == rank
    servers[1].sim.engines[0].submit(600.0, time.monotonic(), 3)  # rank 1 gets 3 requests
    busy = await first_load(subs[1], 3)
    assert busy.attn_dp_rank == 1
    doc = (await svc.get_json("/status"))[1]["feeds"]["load_publisher"]
    assert doc["base"] == f"tcp://127.0.0.1:{base}"
    assert [(e["engine"], e["endpoint"], e["bound"]) for e in doc["endpoints"]] == [
        ("0", f"tcp://127.0.0.1:{base}", True),
        ("1", f"tcp://127.0.0.1:{base + 1}", True),
    ]
    sent = metric_value(await svc.scrape(), "vllm_dp_load_messages_total", topic="load")
    assert sent is not None and sent >= 3


async def test_owner_mode_sends_rank_state_and_no_load(
    fleet_factory: ServiceFactory, ctx: zmq.asyncio.Context
) -> None:
    base = free_port_range(2)
    fleet = await fleet_factory(2, load_publisher=f"tcp://127.0.0.1:{base}", hung_after=0.8)
    states = subscriber(ctx, base + 1, b"rank_state")
    loads = subscriber(ctx, base + 1, b"load")
    state = await next_message(states)
    assert isinstance(state, RankState) and state.engine == "1"
    fleet.engines[1].options.frozen = True  # as SIGSTOP leaves it
    for _ in range(30):
        state = await next_message(states)
        assert isinstance(state, RankState)
        if state.state == "hung":
            break
    assert state.state == "hung" and not state.routable
    with pytest.raises(asyncio.TimeoutError):  # owner mode counts no requests: no load
        await next_message(loads, timeout_s=1.5)


async def test_a_port_already_taken_is_a_clear_error_and_the_rest_serves_on(
    fleet_factory: ServiceFactory, ctx: zmq.asyncio.Context
) -> None:
    base = free_port_range(3)
    squatter = ctx.socket(zmq.PUB)
    squatter.setsockopt(zmq.LINGER, 0)
    squatter.bind(f"tcp://127.0.0.1:{base + 1}")
    try:
        fleet = await fleet_factory(3, load_publisher=f"tcp://127.0.0.1:{base}")
        states = subscriber(ctx, base + 2, b"rank_state")
        state = await next_message(states)
        assert isinstance(state, RankState) and state.engine == "2"
        doc = (await fleet.get_json("/status"))[1]["feeds"]["load_publisher"]
        by_engine = {e["engine"]: e for e in doc["endpoints"]}
        assert not by_engine["1"]["bound"] and "in use" in by_engine["1"]["error"].lower()
        assert by_engine["0"]["bound"] and by_engine["2"]["bound"]
        m = await fleet.scrape()
        assert metric_value(m, "vllm_dp_load_bind_failures_total") == 1.0
        assert metric_value(m, "vllm_dp_engine_up", engine="1") == 1.0
    finally:
        with contextlib.suppress(zmq.ZMQError):
            squatter.close()
