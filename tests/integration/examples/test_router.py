"""The example router (``examples/router``) between a client and a simulated vLLM API server,
steered by the real exporter's ``GET /watch`` (owner mode over simulated engines on real ZMQ).
The API server's engines are the exporter's engines (the same state machines and faults), so a
rank the exporter reads paused, asleep or frozen is the rank that runs nothing there.

It proves: every completion through the router lands on the routable ranks (the API server's
per-engine counts) and finishes, spread over them, while one rank is paused, asleep or frozen
(SIGSTOP's stand-in), and the rank takes traffic again once routable; no routable rank is a 503
from the router, with nothing sent to vLLM; a stream is passed through as it comes; after the
exporter drops the feed's connection the router resumes it with ``Last-Event-ID`` (the hub
replays instead of a fresh snapshot) and follows the changes made meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from examples.router.router import Router, RouterConfig, serve
from exporter.sim.api_server import SimApiServer
from exporter.sim.options import SimOptions
from exporter.sim.state import ALL_TAGS, EngineState
from tests.harness.apiservers import StartApi
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import eventually

RANKS = 3
HUNG_AFTER_S = 0.8
TIMEOUT = aiohttp.ClientTimeout(total=20)
BURST = 12


@dataclass
class Routed:
    fleet: Service
    sim: SimApiServer
    router: Router
    url: str
    session: aiohttp.ClientSession

    def view(self) -> dict[str, bool]:
        """The router's table: engine → routable."""
        return {e: bool(self.router.rows[e].get("routable")) for e in self.router.rows}

    async def sees(self, expected: dict[str, bool], what: str) -> None:
        await eventually(lambda: self.view() == expected, what=what)

    async def complete(self, stream: bool = False, headers: dict[str, str] | None = None) -> str:
        body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": stream}
        async with self.session.post(
            self.url + "/v1/completions", json=body, headers=headers
        ) as resp:
            text = await resp.text()
            assert resp.status == 200, text
            return text

    async def burst(self, count: int = BURST) -> None:
        """``count`` completions at once (two of them streamed), each finished."""
        texts = await asyncio.wait_for(
            asyncio.gather(*(self.complete(stream=i < 2) for i in range(count))), 15
        )
        assert all(t.endswith("data: [DONE]\n\n") for t in texts[:2])
        assert all('"text_completion"' in t for t in texts[2:])


@pytest.fixture
async def routed(fleet_factory: ServiceFactory, start_api: StartApi) -> AsyncIterator[Routed]:
    fleet = await fleet_factory(RANKS, hung_after=HUNG_AFTER_S, gate_min_interval=0.0)
    api = await start_api(engines=RANKS)
    # One set of engines: vLLM's (the API server's) are the exporter's.
    api.sim.engines[:] = [e.state for e in fleet.engines]
    api.sim.engine_options[:] = [e.options for e in fleet.engines]
    config = RouterConfig(api.url, fleet.url + "/watch", reconnect_s=0.2, max_reconnect_s=1.0)
    router = Router(config)
    runner, url = await serve(router, "127.0.0.1", 0)
    session = aiohttp.ClientSession(timeout=TIMEOUT)
    try:
        routed = Routed(fleet, api.sim, router, url, session)
        await routed.sees({str(r): True for r in range(RANKS)}, "every rank routable")
        yield routed
    finally:
        await session.close()
        await asyncio.wait_for(runner.cleanup(), 5)
        await asyncio.wait_for(router.close(), 5)


def pause(state: EngineState, options: SimOptions) -> None:
    state.paused = True


def put_to_sleep(state: EngineState, options: SimOptions) -> None:
    state.sleeping_tags, state.paused = set(ALL_TAGS), True  # level 1: the scheduler paused


def freeze(state: EngineState, options: SimOptions) -> None:
    options.frozen = True  # as SIGSTOP leaves an engine: it answers nothing, runs nothing


def thaw(state: EngineState, options: SimOptions) -> None:
    state.sleeping_tags, state.paused, options.frozen = set(), False, False


FAULTS: dict[str, Callable[[EngineState, SimOptions], None]] = {
    "paused": pause,
    "asleep": put_to_sleep,
    "frozen": freeze,
}


@pytest.mark.parametrize("fault", FAULTS)
async def test_completions_land_on_the_routable_ranks_only(routed: Routed, fault: str) -> None:
    fleet, sim = routed.fleet, routed.sim
    FAULTS[fault](fleet.engines[1].state, fleet.engines[1].options)
    await routed.sees({"0": True, "1": False, "2": True}, f"rank 1 {fault}: not routable")
    before = sim.completions.copy()
    await routed.burst()
    # A client's own header is replaced by the router's choice.
    await routed.complete(headers={"X-data-parallel-rank": "1"})
    landed = sim.completions - before
    assert set(landed) == {0, 2}, landed  # never rank 1; both others (the burst spreads)
    assert sum(landed.values()) == BURST + 1
    assert routed.router.requests == {"0": landed[0], "2": landed[2]}
    assert abs(landed[0] - landed[2]) <= 2, landed
    thaw(fleet.engines[1].state, fleet.engines[1].options)
    await routed.sees({"0": True, "1": True, "2": True}, "rank 1 routable again")
    before = sim.completions.copy()
    await routed.burst()
    assert (sim.completions - before)[1] > 0, "rank 1 takes traffic again"


async def test_no_routable_rank_is_a_503_from_the_router(routed: Routed) -> None:
    for engine in routed.fleet.engines:
        engine.state.paused = True
    await routed.sees({"0": False, "1": False, "2": False}, "no rank routable")
    sent = len(routed.sim.requests)
    async with routed.session.post(
        routed.url + "/v1/chat/completions", json={"model": "m", "messages": []}
    ) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    assert "1: paused" in error["message"], error
    assert len(routed.sim.requests) == sent and not routed.sim.completions, "nothing sent"
    assert routed.router.refused == 1
    routed.fleet.engines[2].state.paused = False
    await routed.sees({"0": False, "1": False, "2": True}, "rank 2 routable")
    await routed.complete()
    assert routed.sim.completions == {2: 1}


async def test_a_stream_is_passed_through_as_it_comes(routed: Routed) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}  # 1 s of work
    answered = routed.sim.answered["/v1/completions"]
    async with routed.session.post(routed.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
        assert first.startswith(b"data: {")
        assert routed.sim.answered["/v1/completions"] == answered, "vLLM is still answering"
        rest = await asyncio.wait_for(resp.content.read(), 10)
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_the_router_resumes_the_feed_after_a_drop(routed: Routed) -> None:
    hub = routed.fleet.exporter.feed
    assert routed.router.feed_connects == 1 and len(hub.watchers) == 1
    for watcher in list(hub.watchers):
        hub.drop(watcher)
    # A change while the router is away: it comes in the replay (or live, if already back).
    routed.fleet.engines[2].state.paused = True
    await eventually(lambda: routed.router.feed_connects == 2, what="the router reconnected")
    await eventually(lambda: len(hub.watchers) == 1, what="its new watcher")
    (watcher,) = hub.watchers
    assert watcher.start == "resume", "Last-Event-ID sent, the missed changes replayed"
    assert hub.counts.dropped == 1
    await routed.sees({"0": True, "1": True, "2": False}, "rank 2 paused, seen after the drop")
    before = routed.sim.completions.copy()
    await routed.burst(6)
    assert set(routed.sim.completions - before) == {0, 1}
    async with routed.session.get(routed.url + "/stats") as resp:
        stats: dict[str, Any] = await resp.json()
    assert stats["feed"]["connects"] == 2 and stats["feed"]["fresh"] is True
    assert stats["feed"]["last_event_id"].startswith(hub.epoch + "-")
    assert [r["routable"] for r in stats["ranks"]] == [True, True, False]


async def test_a_quiet_feed_is_not_trusted(routed: Routed) -> None:
    """No event for ``stale_after_s``: requests go unpinned, balanced by vLLM itself."""
    hub, router = routed.fleet.exporter.feed, routed.router
    hub.heartbeat_s = 3600.0  # from the next connection on, the feed stays quiet
    for watcher in list(hub.watchers):
        hub.drop(watcher)
    await eventually(lambda: router.feed_connects == 2 and len(hub.watchers) == 1, what="back")
    await asyncio.sleep(0.2)  # what the resume replays, if anything, is in
    router.last_event_at = time.monotonic() - router.config.stale_after_s - 1
    assert not router.fresh()
    await routed.complete()
    assert router.unpinned == 1 and not router.requests
    assert sum(routed.sim.completions.values()) == 1


async def test_vllm_unreachable_is_a_502_never_retried(
    fleet_factory: ServiceFactory,
) -> None:
    fleet = await fleet_factory(1)
    dead = "http://127.0.0.1:9"  # discard port: nothing listens on loopback here
    router = Router(RouterConfig(dead, fleet.url + "/watch", reconnect_s=0.2))
    runner, url = await serve(router, "127.0.0.1", 0)
    try:
        await eventually(lambda: router.routable() == ["0"], what="rank 0 routable")
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as session,
            session.post(url + "/v1/completions", json={"prompt": "x"}) as resp,
        ):
            assert resp.status == 502
            assert (await resp.json())["error"]["type"] == "BadGatewayError"
        assert router.failed == 1 and router.requests == {"0": 1}
    finally:
        await asyncio.wait_for(runner.cleanup(), 5)
        await asyncio.wait_for(router.close(), 5)
