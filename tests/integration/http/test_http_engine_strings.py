"""API servers answering megabyte strings (a weight version, a failure text, a vLLM version, the
values of a disagreement) in HTTP mode: the same cut and marker as owner and relay mode, so
scrapes, /status, the page and the gate stay small and the inconsistency warning rate-limited."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from exporter.client.http.consensus import MAX_CONSENSUS_MESSAGE, MAX_VALUE_CHARS
from exporter.protocol.handshake import MAX_REGISTRATION_STRING
from exporter.protocol.strings import MAX_ENGINE_STRING, is_cut
from exporter.sim.options import SimOptions
from tests.harness.apiservers import HOST, ApiServers, http_config
from tests.harness.scrape import parse_metrics, samples
from tests.harness.service import Service, start_service
from tests.harness.waiting import eventually

TARGETS = 3
POSITIONS = {"first": 0, "middle": 1, "last": 2}
HUGE = 1_000_000
SMALL = 64 * 1024


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj), status=status, content_type="application/json")


def hostile_app(weight_info_body: str | None = None) -> web.Application:
    """An API server that is awake, answers a 1 MB weight version (or ``weight_info_body``), a
    1 MB ``/version`` and fails ``/is_paused`` with a 1 MB text (as vLLM's RL route words it)."""

    async def is_sleeping(_: web.Request) -> web.Response:
        return _json({"is_sleeping": False})

    async def is_paused(_: web.Request) -> web.Response:
        text = "Call to is_scheduler_paused method failed: " + "E" * HUGE
        return _json({"error": f"Failed to fetch pause status: {text}"}, status=500)

    async def weight_info(_: web.Request) -> web.Response:
        if weight_info_body is not None:
            return web.Response(body=weight_info_body, content_type="application/json")
        return _json({"weight_version": "v" * HUGE})

    async def version(_: web.Request) -> web.Response:
        return _json({"version": "9" * HUGE})

    app = web.Application()
    app.router.add_get("/is_sleeping", is_sleeping)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_get("/weight_info", weight_info)
    app.router.add_get("/version", version)
    return app


@contextlib.asynccontextmanager
async def fleet(hostile: int, app: web.Application | None = None) -> AsyncIterator[Service]:
    """An exporter over three API servers at weight version "v1"; the one at ``hostile`` is
    ``app`` (default: :func:`hostile_app`)."""
    servers = ApiServers()
    runner = web.AppRunner(app or hostile_app(), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, HOST, 0).start()
    hostile_url = f"http://{HOST}:{runner.addresses[0][1]}"
    service: Service | None = None
    try:
        targets = []
        for i in range(TARGETS):
            if i == hostile:
                targets.append(f"{i}={hostile_url}")
            else:
                sim = await servers.start(
                    engines=1, engine_options=[SimOptions(weight_version="v1")]
                )
                targets.append(f"{i}={sim.url}")
        config = http_config(targets, poll_interval=0.05, call_timeout=2.0, gate_min_interval=0)
        service = await start_service(config)
        yield service
    finally:
        if service is not None:
            await service.stop()
        await servers.close()
        await runner.cleanup()


async def get(run: Service, path: str) -> tuple[int, str]:
    async with run.session.get(run.url + path) as resp:
        return resp.status, await resp.text()


async def sizes(run: Service) -> dict[str, int]:
    found = {}
    for path in ("/metrics", "/status", "/", "/gate?weight_version=v1"):
        status, body = await get(run, path)
        assert status in (200, 412), (path, status)
        found[path] = len(body.encode())
    return found


@pytest.mark.parametrize("position", list(POSITIONS))
async def test_megabyte_api_server_strings_are_cut_like_engine_strings(
    position: str, caplog: pytest.LogCaptureFixture
) -> None:
    hostile = str(POSITIONS[position])
    async with fleet(POSITIONS[position]) as run:
        await run.fresh_poll(10)
        await eventually(
            lambda: all(d.vllm_version for d in run.exporter.client.engine_details()),
            10,
            "every /version",
        )
        found = await sizes(run)
        assert all(size < SMALL for size in found.values()), found
        families = parse_metrics((await get(run, "/metrics"))[1])
        (row,) = samples(families, "vllm_dp_engine_weight_version_info", engine=hostile)
        label = row.labels["weight_version"]
        assert is_cut(label) and len(label.encode()) <= MAX_ENGINE_STRING, label[:80]
        (info,) = samples(families, "vllm_dp_engine_info", engine=hostile)
        assert info.labels["vllm_version"] == "9" * MAX_REGISTRATION_STRING
        entry = next(e for e in (await run.status())["engines"] if e["engine"] == hostile)
        error = entry["invariants"]["is_scheduler_paused"]["error"]
        assert is_cut(error) and len(error.encode()) <= MAX_ENGINE_STRING
        assert error.startswith("Failed to fetch pause status: Call to is_scheduler_paused")
        caplog.clear()
        caplog.set_level(logging.INFO)
        first = run.exporter.poller.snapshot.poll_number
        await eventually(
            lambda: run.exporter.poller.snapshot.poll_number >= first + 20, 15, "20 polls"
        )
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 2, [r.getMessage()[:120] for r in warnings]
        assert sum(len(r.getMessage()) for r in caplog.records) < SMALL


@pytest.mark.parametrize(
    ("length", "outcome"),
    [(10_000, "inconsistent"), (MAX_VALUE_CHARS + 1, "failed"), (HUGE, "failed")],
    ids=["within_the_bound", "a_value_over_its_cap", "a_megabyte"],
)
async def test_values_of_a_long_disagreement_are_cut(length: int, outcome: str) -> None:
    """An API server whose own engines disagree about a long weight version answers vLLM's 500
    naming both values: within ``MAX_CONSENSUS_MESSAGE`` and ``MAX_VALUE_CHARS`` the target is
    inconsistent with each value cut; a value over its cap (the message within the bound) or a
    megabyte message is not read, the target's call failed (its error cut), and nothing
    grows."""
    assert length == HUGE or length + 1024 < MAX_CONSENSUS_MESSAGE  # the message fits the bound
    servers = ApiServers()
    try:
        split = await servers.start(
            engines=2,
            engine_options=[
                SimOptions(weight_version="v" * length),
                SimOptions(weight_version="v1"),
            ],
        )
        config = http_config([f"0={split.url}"], poll_interval=0.05, gate_min_interval=0)
        run = await start_service(config)
        try:
            await run.fresh_poll(10)
            found = await sizes(run)
            assert all(size < SMALL for size in found.values()), found
            doc = (await run.status())["engines"][0]["invariants"]["get_weight_version"]
            assert doc["outcome"] == outcome, doc
            if outcome == "inconsistent":
                long_value, short_value = doc["values"]
                assert is_cut(long_value) and len(long_value.encode()) <= MAX_ENGINE_STRING
                assert short_value == "v1"
            else:
                assert is_cut(doc["error"]) and len(doc["error"].encode()) <= MAX_ENGINE_STRING
        finally:
            await run.stop()
    finally:
        await servers.close()


async def test_lone_surrogates_from_an_api_server_do_not_break_scrapes() -> None:
    """JSON may carry ``\\ud800``, which no exposition format can encode: it becomes U+FFFD."""
    async with fleet(0, hostile_app('{"weight_version": "v\\ud800"}')) as run:
        await run.fresh_poll(10)
        status, text = await get(run, "/metrics")
        assert status == 200
        (row,) = samples(parse_metrics(text), "vllm_dp_engine_weight_version_info", engine="0")
        assert row.labels["weight_version"] == "v\ufffd"
