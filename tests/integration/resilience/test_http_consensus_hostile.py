"""A hostile HTTP target answers every read route with a 500 that looks like vLLM's consensus
error but is 1 or 4 MiB long (markers repeated without an end, a bracket nested to the end,
a million values): the message is refused before any parse, the target's calls fail and
nothing else changes. The exporter's event loop stays free: ``/metrics`` answers every scrape
of a poll within seconds and the other targets keep their values. Real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from exporter.sim.options import SimOptions
from tests.harness.apiservers import HOST, ApiServers, http_config
from tests.harness.service import Service, start_service

MIB = 1024 * 1024
PYTHON = "Engines returned different {m} results: "
RUST = "failed to call {m}: utility call `{m}` returned inconsistent results across engines: "
ROUTES = {"/is_sleeping": "is_sleeping", "/is_paused": "is_scheduler_paused", "/weight_info": ""}

#: Message builders: method → a hostile text of about ``size`` characters.
MESSAGES: dict[str, Callable[[str, int], str]] = {
    # many markers, the list never closed: each one a start for a backtracking regex
    "repeated_markers": lambda m, size: (": " + PYTHON.format(m=m) + "[") * (size // 50),
    # one marker, then a bracket nested to the end
    "nested_to_the_end": lambda m, size: PYTHON.format(m=m) + "[" * size,
    # the Rust front end's form with a million JSON values
    "a_million_values": lambda m, size: RUST.format(m=m) + json.dumps([True, False] * (size // 13)),
}


def hostile_app(build: Callable[[str, int], str], size: int) -> web.Application:
    def route(method: str) -> Callable[[web.Request], object]:
        async def answer(_: web.Request) -> web.Response:
            body = json.dumps({"error": {"message": build(method or "get_weight_version", size)}})
            return web.Response(body=body, status=500, content_type="application/json")

        return answer

    app = web.Application()
    for path, method in ROUTES.items():
        app.router.add_get(path, route(method))  # type: ignore[arg-type]
    return app


@contextlib.asynccontextmanager
async def fleet(position: int, app: web.Application) -> AsyncIterator[Service]:
    """Three targets; the one at ``position`` is ``app``."""
    servers = ApiServers()
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0).start()
    service: Service | None = None
    try:
        targets = []
        for i in range(3):
            if i == position:
                targets.append(f"{i}=http://{HOST}:{runner.addresses[0][1]}")
            else:
                sim = await servers.start(engines=1, engine_options=[SimOptions()])
                targets.append(f"{i}={sim.url}")
        config = http_config(targets, call_timeout=5.0, gate_min_interval=0)
        service = await start_service(config)
        yield service
    finally:
        if service is not None:
            await service.stop()
        await servers.close()
        await runner.cleanup()


async def slowest_scrape_during_a_poll(run: Service) -> float:
    """Scrape ``/metrics`` back to back while a poll runs; the longest answer (seconds)."""
    loop = asyncio.get_running_loop()
    poll = asyncio.ensure_future(run.fresh_poll(30))
    slowest = 0.0
    while not poll.done():
        started = loop.time()
        async with run.session.get(run.url + "/metrics") as resp:
            assert resp.status == 200
            await resp.read()
        slowest = max(slowest, loop.time() - started)
    await poll
    return slowest


@pytest.mark.parametrize("size", [MIB, 4 * MIB], ids=["1MiB", "4MiB"])
@pytest.mark.parametrize("kind", list(MESSAGES))
@pytest.mark.parametrize("position", [0, 2], ids=["first", "last"])
async def test_a_hostile_consensus_error_is_a_failure_and_costs_no_loop_time(
    position: int, kind: str, size: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        async with fleet(position, hostile_app(MESSAGES[kind], size)) as run:
            await run.fresh_poll(30)
            # A linear read of a 4 MiB body takes milliseconds; a parse over it took seconds.
            assert await slowest_scrape_during_a_poll(run) < 2.0
            doc = await run.status()
            by_engine = {e["engine"]: e for e in doc["engines"]}
            mine = dict(by_engine[str(position)]["invariants"])
            assert mine.pop("checkpoint_state")["outcome"] == "unsupported"  # 404: before 0.34
            assert {i["outcome"] for i in mine.values()} == {"failed"}, mine
            others = [e for name, e in by_engine.items() if name != str(position)]
            assert all(e["invariants"]["is_sleeping"]["value"] is False for e in others)
            code, body = await run.get_json("/gate?sleeping=false")
            assert code == 412 and body["failing_engines"] == [str(position)], body
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
