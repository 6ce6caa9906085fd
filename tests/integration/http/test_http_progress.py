"""HTTP mode's forward progress (docs/activity.md): each dev-routes target's computed tokens,
summed over its ranks, from the ``/metrics`` answer its ``has_work`` read fetches anyway (no
request of its own), and when they last grew. A target whose engines compute keeps moving; one
whose engines hold their requests and compute nothing (``stuck``) shows tokens that no longer
grow, and is never called stalled (vLLM's request gauges are refreshed only while an engine
steps); a hostile counter, at the first, middle or last target, makes that target's progress
unknown. Real sockets: simulated API servers on loopback, the whole exporter read over HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.harness.apiservers import ApiServer, StartApi, http_config
from tests.harness.scrape import metric_value
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import WAIT_S

NAMES = ("first", "middle", "last")
FOREVER_S = 600.0


async def fleet(
    start_api: StartApi, start_exporter: ServiceFactory
) -> tuple[list[ApiServer], Service]:
    apis = [await start_api(engines=2, story_offset=2 * i) for i in range(3)]
    targets = [f"{n}={api.url}" for n, api in zip(NAMES, apis, strict=True)]
    ex = await start_exporter(http_config(targets, stall_after=0.5))
    return apis, ex


async def progress(ex: Service) -> dict[str, Any]:
    await ex.fresh_poll()
    doc = await asyncio.wait_for(ex.status(), WAIT_S)
    return {e["engine"]: e for e in doc["engines"]}


async def test_a_target_s_tokens_grow_while_it_computes_and_stop_while_it_is_stuck(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis, ex = await fleet(start_api, start_exporter)
    now = time.monotonic()
    for engine in apis[1].sim.engines:
        engine.submit(FOREVER_S, now)
    for engine in apis[2].sim.engines:
        engine.submit(FOREVER_S, now)
        engine.work.stuck = True  # holds its request, computes nothing, answers every call
    first = await progress(ex)
    deadline = time.monotonic() + WAIT_S
    while True:
        later = await progress(ex)
        grew = later["middle"]["progress"]["tokens"] > first["middle"]["progress"]["tokens"]
        if grew and later["last"]["progress"]["age_seconds"] > 0.5:
            break
        assert time.monotonic() < deadline, later
        await asyncio.sleep(0.1)
    assert later["first"]["progress"]["tokens"] == 0  # idle: nothing to compute
    assert later["middle"]["progress"]["source"] == "metrics"
    assert later["middle"]["progress"]["held"] is None
    last = later["last"]
    assert last["progress"]["tokens"] == first["last"]["progress"]["tokens"]
    assert last["state"] == "awake" and last["routable"]["routable"]  # never stalled here
    assert last["activity"]["running"] == 2
    metrics = await ex.scrape()
    middle = later["middle"]["progress"]["tokens"]
    published = metric_value(metrics, "vllm_dp_engine_progress_tokens_total", engine="middle")
    assert published is not None and published >= middle
    age = metric_value(metrics, "vllm_dp_engine_last_progress_age_seconds", engine="last")
    assert age is not None and age > 0.5
    assert metric_value(metrics, "vllm_dp_engine_state", engine="last", state="stalled") == 0.0


@pytest.mark.parametrize("position", [0, 1, 2], ids=NAMES)
@pytest.mark.parametrize("hostile", ["-3.0", "NaN", "1e30", "lots"])
async def test_a_hostile_token_counter_makes_that_target_s_progress_unknown(
    start_api: StartApi, start_exporter: ServiceFactory, position: int, hostile: str
) -> None:
    apis, ex = await fleet(start_api, start_exporter)
    sim = apis[position].sim
    rank = 2 * position
    sim.metrics_answer = (
        f'vllm:num_requests_running{{engine="{rank}"}} 0.0\n'
        f'vllm:num_requests_waiting{{engine="{rank}"}} 0.0\n'
        f'vllm:generation_tokens_total{{engine="{rank}"}} 5.0\n'
        f'vllm:generation_tokens_total{{engine="{rank + 1}"}} {hostile}\n'
    ).encode()
    seen = await progress(ex)
    assert seen[NAMES[position]]["progress"] is None
    assert seen[NAMES[position]]["activity"]["has_work"] is False  # the counts still read
    assert all(seen[n]["progress"] is not None for n in NAMES if n != NAMES[position])
    sim.metrics_answer = None
    assert (await progress(ex))[NAMES[position]]["progress"] is not None
