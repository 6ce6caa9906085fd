"""Engines answering megabyte strings (a weight version, a failure text) in owner and relay mode:
every string is cut where the reply is decoded, so scrapes, /status, the page and the gate stay
small, the label carries the cut marker, and the inconsistency warning stays rate-limited.
Real ZMQ sockets on loopback, simulated engines, every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from exporter.protocol.strings import CUT_MARKER, MAX_ENGINE_STRING, is_cut
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions, SimReply
from tests.harness.scrape import parse_metrics, samples
from tests.harness.service import Service, serve_config, start_service
from tests.harness.waiting import eventually

ENGINES = 3
POSITIONS = {"first": 0, "middle": 1, "last": 2}
HUGE = 1_000_000
#: Generous bound for any answer about a few engines.
SMALL = 64 * 1024
HUGE_VERSION = "v" * HUGE
HUGE_FAILURE = "E" * HUGE


def huge_strings(client_index: int, call_id: int, method: str, args: list[Any]) -> SimReply | None:
    """The hostile engine's ``on_request`` hook: ``get_weight_version`` answers a 1 MB string and
    ``is_scheduler_paused`` fails with a 1 MB failure text; everything else as a simulated engine
    does."""
    if method == "get_weight_version":
        return SimReply(value=HUGE_VERSION)
    if method == "is_scheduler_paused":
        return SimReply(failure=HUGE_FAILURE)
    return None


@contextlib.asynccontextmanager
async def fleet(mode: str, hostile: int) -> AsyncIterator[Service]:
    """An exporter in ``mode`` over three engines at weight version "v1", the one at
    ``hostile`` answering megabyte strings."""
    handshake = f"tcp://127.0.0.1:{free_listen_port()}"
    settings: dict[str, Any] = {
        "attach": mode,
        "engine_count": ENGINES,
        "handshake_address": handshake,
    }
    frontend: SimFrontend | None = None
    if mode == "relay":
        upstream = f"tcp://127.0.0.1:{free_listen_port()}"
        settings["upstream_handshake_address"] = upstream
        frontend = SimFrontend(upstream, ENGINES)
        await frontend.start(call_loop=False)
    service = await start_service(
        serve_config(poll_interval=0.05, call_timeout=1.0, gate_min_interval=0, **settings)
    )
    engines: list[SimEngine] = []
    tasks: list[asyncio.Task[str]] = []
    try:
        for i in range(ENGINES):
            hook = huge_strings if i == hostile else None
            engine = SimEngine(handshake, i, SimOptions(weight_version="v1"), on_request=hook)
            engines.append(engine)
            tasks.append(asyncio.create_task(engine.run()))
        await eventually(
            lambda: connected_count(service.exporter.client) == ENGINES, 10, "handshakes"
        )
        yield service
    finally:
        for engine in engines:
            engine.stop()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        await service.stop()
        if frontend is not None:
            await frontend.close()


async def get(run: Service, path: str) -> tuple[int, str]:
    async with run.session.get(run.url + path) as resp:
        return resp.status, await resp.text()


async def assert_answers_stay_small(run: Service, hostile: str) -> None:
    """/metrics, /status, / and /gate are small; the weight version label and every text that
    came from the hostile engine are cut, with the marker."""
    sizes = {}
    for path in ("/metrics", "/status", "/", "/gate?weight_version=v1"):
        status, body = await get(run, path)
        assert status in (200, 412), (path, status)
        sizes[path] = len(body.encode())
    assert all(size < SMALL for size in sizes.values()), sizes
    _, text = await get(run, "/metrics")
    families = parse_metrics(text)
    (row,) = samples(families, "vllm_dp_engine_weight_version_info", engine=hostile)
    label = row.labels["weight_version"]
    assert is_cut(label) and CUT_MARKER in label, label[:80]
    assert len(label.encode()) <= MAX_ENGINE_STRING
    assert label.startswith("vvvv")
    status_doc = (await run.status())["engines"]
    entry = next(e for e in status_doc if e["engine"] == hostile)
    paused = entry["invariants"]["is_scheduler_paused"]
    assert paused["outcome"] == "failed"
    assert is_cut(paused["error"]) and len(paused["error"].encode()) <= MAX_ENGINE_STRING
    assert entry["invariants"]["get_weight_version"]["value"] == label


@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("mode", ["owner", "relay"])
async def test_megabyte_engine_strings_are_cut_where_replies_are_decoded(
    mode: str, position: str, caplog: pytest.LogCaptureFixture
) -> None:
    hostile = POSITIONS[position]
    async with fleet(mode, hostile) as run:
        await run.fresh_poll(10)
        await assert_answers_stay_small(run, str(hostile))
        caplog.clear()
        caplog.set_level(logging.INFO)
        first = run.exporter.poller.snapshot.poll_number
        await eventually(
            lambda: run.exporter.poller.snapshot.poll_number >= first + 20, 15, "20 polls"
        )
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 2, [r.getMessage()[:120] for r in warnings]
        logged = sum(len(r.getMessage()) for r in caplog.records)
        assert logged < SMALL, logged
        families = parse_metrics((await get(run, "/metrics"))[1])
        (count,) = samples(
            families, "vllm_dp_inconsistent_utility_results_total", method="get_weight_version"
        )
        assert count.value >= 20, "the counter keeps the full count"
