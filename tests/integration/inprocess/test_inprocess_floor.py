"""A rank holding the front end's requests is never drained, whatever vLLM's coordinator table
says or fails to say (docs/activity.md). vLLM 0.33's subscription to the DP coordinator ends on
one publication it cannot unpack, and its router keeps scoring by the front end's own in-flight
count (``engine_inflight``): so does the exporter. A rank paused with ``has_work`` false while
this front end's requests are on it (a keep pause, or requests queued behind a wait pause)
fails ``/dp/gate?drained=true`` named with its requests, and ``POST /dp/admin/pause?mode=wait``
does not claim it drained; an own count that cannot be read is unknown, never drained. Through
the plugin's app (uvicorn), ``start_exporter``'s service (aiohttp) and a sidecar in HTTP mode
over the plugin; real ZMQ to simulated engines, loopback only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from exporter.web.app import RunningService, start_service
from tests.harness.inprocess import ADMIN_TOKEN, EmbeddedExporters, SimVllm, token_file
from tests.harness.plugin_app import TOKEN, PluginApp, PluginApps
from tests.harness.service import serve_config
from tests.harness.waiting import eventually

WAIT_S = 10.0
HELD = "paused, has_work is false but vLLM publishes requests (running 2, waiting 0)"


async def unpack_fails() -> None:
    """vLLM's ``run_engine_stats_update_task`` on a publication that is not three values:
    ``counts, wave, running = msgspec.msgpack.decode(buf)`` raises and the task ends."""
    _counts, _wave, _running = msgspec.msgpack.decode(msgspec.msgpack.encode([[0, 0, 0.0]]))


async def subscription_ended(sim: SimVllm) -> None:
    task: asyncio.Task[None] = asyncio.ensure_future(unpack_fails())
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
    assert task.done() and isinstance(task.exception(), ValueError)
    sim.core.resources.stats_update_task = task


async def table_not_a_list(sim: SimVllm) -> None:
    sim.core.resources.stats_update_task = asyncio.ensure_future(asyncio.sleep(3600))
    core: Any = sim.core
    core.lb_engines = {0: [0, 0, 0.0], 1: [0, 0, 0.0], 2: [0, 0, 0.0]}


TABLE_STATES: dict[str, Callable[[SimVllm], Awaitable[None]]] = {
    "subscription ended": subscription_ended,
    "table not a list": table_not_a_list,
}


def hold(sim: SimVllm, rank: int, count: Any) -> None:
    """This front end's unfinished requests on ``rank``, as vLLM's router counts them."""
    core: Any = sim.core
    core.engine_inflight[core.core_engines[rank]] = count


def verdicts(body: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(e["reason"], e["error"]) for e in body["engines"]]


async def stop_subscription(sim: SimVllm) -> None:
    task = sim.core.resources.stats_update_task
    if task is not None:
        task.cancel()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)


@pytest.mark.parametrize("state", TABLE_STATES)
async def test_the_plugin_never_calls_a_rank_holding_requests_drained(
    plugin_apps: PluginApps, env: Callable[..., None], tmp_path: Path, state: str
) -> None:
    env(
        ADMIN_TOKEN_FILE=token_file(tmp_path, TOKEN),
        ACTION_TIMEOUT="1",
        GATE_MIN_INTERVAL="0",
    )
    app = await plugin_apps(3)
    assert app.fleet is not None
    await TABLE_STATES[state](app.fleet)
    hold(app.fleet, 1, 2)
    status, body = await app.get_json("/dp/gate?drained=true")
    assert (status, body["failing_engines"]) == (412, ["1"]), body
    rank = body["engines"][1]
    assert rank["failures"] == [
        "drained: has_work false but requests published (running 2, waiting 0), "
        "expected drained=true"
    ]
    assert rank["requests"] == {"running": 2, "waiting": 0}
    status, body, _ = await app.post("pause", token=TOKEN, params={"mode": "wait"})
    assert status == 502 and body["outcome"] == "partial_failure", body
    assert verdicts(body) == [(None, None), ("unverified", HELD), (None, None)], body
    hold(app.fleet, 1, 0)  # finished: vLLM decrements it
    status, body = await app.get_json("/dp/gate?drained=true")
    assert status == 200, body
    await stop_subscription(app.fleet)


HOSTILE_COUNTS = {"negative": -2, "string": "2", "huge": 10**30, "fraction": 1.5}


@pytest.mark.parametrize("value", HOSTILE_COUNTS.values(), ids=HOSTILE_COUNTS.keys())
async def test_an_unreadable_own_count_is_unknown_never_drained(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, tmp_path: Path, value: Any
) -> None:
    """``start_exporter``'s service: the rank's ``has_work`` is unknown, the gate names it,
    the wait pause cannot verify it; the other ranks are drained as before."""
    service = await embedded(
        sim_vllm.llm,
        admin_token_file=token_file(tmp_path),
        action_timeout=1,
        gate_min_interval=0,
    )
    await subscription_ended(sim_vllm)
    hold(sim_vllm, 1, value)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S)) as session:
        async with session.get(service.url + "/gate", params={"drained": "true"}) as resp:
            status, body = resp.status, await resp.json()
        assert (status, body["failing_engines"]) == (412, ["1"]), body
        (failure,) = body["engines"][1]["failures"]
        assert failure.startswith("drained: unknown, has_work: failed"), failure
        assert "engine_inflight" in failure
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        url = f"{service.admin_url}/admin/pause?mode=wait"
        async with session.post(url, headers=headers) as resp:
            status, body = resp.status, await resp.json()
    assert status == 502, body
    (first, unread, last) = verdicts(body)
    assert first == last == (None, None), body
    assert unread[0] == "unverified" and unread[1].startswith("could not read has_work"), body
    await stop_subscription(sim_vllm)


async def sidecar_gate(service: RunningService) -> tuple[int, Any]:
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(service.url + "/gate", params={"drained": "true"}) as resp:
            return resp.status, await resp.json(content_type=None)


@pytest.mark.parametrize("value", [2, "2"], ids=["held", "unreadable"])
async def test_http_mode_over_the_plugin_keeps_the_rank_busy(
    plugin_apps: PluginApps, env: Callable[..., None], value: Any
) -> None:
    """A sidecar reading the server's ``/dp/gate`` per rank: the same rank fails its gate."""
    env(GATE_MIN_INTERVAL="0")
    app: PluginApp = await plugin_apps(3)
    assert app.fleet is not None
    await subscription_ended(app.fleet)
    hold(app.fleet, 1, value)
    service = await start_service(
        serve_config(attach="http", http_target=(f"a={app.url}/dp",), gate_min_interval=0)
    )
    try:
        await eventually(lambda: service.exporter.poller.snapshot.ready, WAIT_S, "ready")
        status, body = await sidecar_gate(service)
        assert (status, body["failing_engines"]) == (412, ["a/1"]), body
    finally:
        await asyncio.wait_for(service.stop(), WAIT_S)
        await stop_subscription(app.fleet)
