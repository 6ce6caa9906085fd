"""The simulated vLLM API server's ``GET /metrics``: vLLM's Prometheus exposition with each
engine's running and waiting requests under its DP rank's ``engine`` label, served whatever the
dev mode (as vLLM's), without the request families under ``--disable-log-stats``
(``log_stats=False``). Real HTTP on loopback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from exporter.protocol.activity import RequestCounts, metrics_counts
from exporter.sim.options import SimOptions
from exporter.sim.work import MAX_RUNNING
from tests.harness.apiservers import ApiServer, StartApi


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        yield s


async def scrape(session: aiohttp.ClientSession, api: ApiServer) -> str:
    async with session.get(f"{api.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/plain")
        return await resp.text()


@pytest.mark.parametrize("dev_mode", [True, False])
async def test_each_engine_is_published_under_its_dp_rank(
    start_api: StartApi, session: aiohttp.ClientSession, dev_mode: bool
) -> None:
    api = await start_api(engines=3, story_offset=4, dev_mode=dev_mode)
    text = await scrape(session, api)
    assert metrics_counts(text) == dict.fromkeys((4, 5, 6), RequestCounts(0, 0))
    assert 'vllm:num_requests_running{engine="5",model_name="sim"} 0.0' in text.splitlines()
    # Other families around them, as vLLM's exposition has.
    assert "# TYPE vllm:num_requests_waiting gauge" in text
    assert 'vllm:kv_cache_usage_perc{engine="4",model_name="sim"} 0.0' in text
    assert "python_gc_objects_collected_total" in text
    # No engine is called for it: a hung engine does not hold the scrape.
    api.sim.engine_options[1].hang = True
    assert metrics_counts(await scrape(session, api)) is not None


async def test_the_counts_follow_each_engines_requests(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    api = await start_api(engines=2, engine_options=[SimOptions(), SimOptions()])
    now = time.monotonic()
    api.sim.engines[1].submit(60.0, now, count=MAX_RUNNING + 2)  # long: running for the test
    api.sim.engines[0].submit(60.0, now)
    counts = metrics_counts(await scrape(session, api))
    assert counts == {0: RequestCounts(1, 0), 1: RequestCounts(MAX_RUNNING, 2)}


async def test_disable_log_stats_leaves_the_families_out(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    api = await start_api(engines=2, log_stats=False)
    api.sim.engines[0].submit(60.0, time.monotonic())
    text = await scrape(session, api)
    assert metrics_counts(text) is None
    assert "vllm:num_requests" not in text and "python_gc_objects_collected_total" in text


async def test_a_tests_own_answer_is_served_instead(
    start_api: StartApi, session: aiohttp.ClientSession
) -> None:
    api = await start_api(engines=1)
    api.sim.metrics_answer = b'vllm:num_requests_running{engine="0"} NaN\n'
    assert await scrape(session, api) == 'vllm:num_requests_running{engine="0"} NaN\n'
    api.sim.metrics_answer = None
    assert metrics_counts(await scrape(session, api)) == {0: RequestCounts(0, 0)}
