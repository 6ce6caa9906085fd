"""In-process mode's request counts (docs/activity.md): read from vLLM's front-end
load-balancing table (``lb_engines``, ``[waiting, running, kv_cache_usage]`` per managed rank)
only while the front end's subscription to the DP coordinator runs
(``resources.stats_update_task``). With the coordinator simulated
(``SimEngineCore.start_coordinator``), ``/status`` activity and ``vllm_dp_engine_requests``
follow the simulated engines' requests; a hostile entry makes that rank's counts null; without
the subscription (never started, or ended) every rank's counts are null, never zero (the
front end's own requests still count: test_inprocess_floor.py). Real ZMQ
engines behind the simulated ``AsyncLLM``, the exporter embedded with ``start_exporter`` and
read over real HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from exporter.client.inprocess.vllm_core import VllmCore
from exporter.protocol.activity import RequestCounts
from exporter.web.app import RunningService
from tests.harness.inprocess import (
    EmbeddedExporters,
    SimVllm,
    coordinate,
    http_session,
    read_activity,
)
from tests.harness.scrape import metric_value

WAIT_S = 10.0
LONG_S = 600.0


def set_table(sim: SimVllm, table: Any, managed: Any = (0, 1, 2)) -> None:
    """What vLLM's front end holds (whatever it is): its table and the ranks it manages."""
    core: Any = sim.core
    core.lb_engines = table
    core.engine_ranks_managed = list(managed) if isinstance(managed, tuple) else managed


def idle_subscription(sim: SimVllm) -> asyncio.Task[None]:
    """A subscription that runs but never writes the table: the test writes it."""
    task: asyncio.Task[None] = asyncio.ensure_future(asyncio.sleep(3600))
    sim.core.resources.stats_update_task = task
    return task


async def activity_until(
    service: RunningService, wanted: list[tuple[Any, Any]]
) -> tuple[list[dict[str, Any]], Any]:
    """Fresh reads until every rank's (running, waiting) is ``wanted`` (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        activity, metrics = await read_activity(service)
        seen = [(a["running"], a["waiting"]) for a in activity]
        if seen == wanted:
            return activity, metrics
        if time.monotonic() > deadline:
            raise AssertionError(f"counts never {wanted}: last {seen}")
        await asyncio.sleep(0.05)


def requests_series(metrics: Any, engine: str) -> tuple[float | None, float | None]:
    return (
        metric_value(metrics, "vllm_dp_engine_requests", engine=engine, state="running"),
        metric_value(metrics, "vllm_dp_engine_requests", engine=engine, state="waiting"),
    )


async def test_status_and_metrics_follow_the_coordinators_counts(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    now = time.monotonic()
    sim_vllm.engines[1].state.submit(LONG_S, now, count=2)
    sim_vllm.engines[2].state.submit(LONG_S, now, count=6)  # 4 run, 2 queue
    activity, metrics = await activity_until(service, [(0, 0), (2, 0), (4, 2)])
    assert [a["has_work"] for a in activity] == [False, True, True]
    assert [a["drained"] for a in activity] == [True, False, False]
    assert [requests_series(metrics, e) for e in "012"] == [(0.0, 0.0), (2.0, 0.0), (4.0, 2.0)]
    assert [metric_value(metrics, "vllm_dp_engine_has_work", engine=e) for e in "012"] == [
        0.0,
        1.0,
        1.0,
    ]
    for engine in sim_vllm.engines[1:]:
        engine.state.work.running.clear()
        engine.state.work.waiting.clear()
    activity, metrics = await activity_until(service, [(0, 0)] * 3)
    assert all(a["has_work"] is False and a["drained"] is True for a in activity)
    assert [requests_series(metrics, e) for e in "012"] == [(0.0, 0.0)] * 3


async def test_requests_queued_behind_a_paused_scheduler_are_waiting(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    await sim_vllm.direct_call("pause_scheduler", 0, "keep")
    sim_vllm.engines[0].state.submit(LONG_S, time.monotonic(), count=3)
    activity, _ = await activity_until(service, [(0, 3), (0, 0), (0, 0)])
    assert activity[0]["has_work"] is True and activity[0]["drained"] is False
    # The gate names the rank with its counts.
    async with http_session() as session:
        async with session.get(service.url + "/gate", params={"drained": "true"}) as resp:
            body = await resp.json()
    assert resp.status == 412 and body["failing_engines"] == ["0"]
    assert body["engines"][0]["failures"] == [
        "drained: has work (running 0, waiting 3), expected drained=true"
    ]
    assert body["engines"][0]["requests"] == {"running": 0, "waiting": 3}


async def test_requests_a_keep_pause_hides_are_counted_from_the_front_ends_own_count(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    """vLLM 0.32 under ``pause_scheduler(mode="keep")`` answers ``has_work`` false and the
    coordinator publishes no requests while the scheduler holds them (measured for real,
    docs/activity.md). The front end's own ``engine_inflight`` still counts them: that rank
    is never drained, the gate names it, until they finish."""
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)  # every engine's own counts: 0 (nothing the scheduler admits to)
    identity = sim_vllm.core.core_engines[1]
    sim_vllm.core.engine_inflight[identity] = 2
    activity, metrics = await activity_until(service, [(0, 0), (2, 0), (0, 0)])
    # The poll listens: each rank's activity is what its counts tell (vLLM's has_work would
    # answer false for rank 1 too), so rank 1 has work and is never drained.
    assert [(a["has_work"], a["has_work_read"]) for a in activity] == [
        (False, "told"),
        (True, "told"),
        (False, "told"),
    ]
    assert [a["drained"] for a in activity] == [True, False, True]
    assert requests_series(metrics, "1") == (2.0, 0.0)
    async with http_session() as session:
        async with session.get(service.url + "/gate", params={"drained": "true"}) as resp:
            body = await resp.json()
    assert resp.status == 412 and body["failing_engines"] == ["1"], body
    sim_vllm.core.engine_inflight[identity] = 0  # finished: vLLM decrements it
    activity, _ = await activity_until(service, [(0, 0)] * 3)
    assert all(a["drained"] is True for a in activity)


@pytest.mark.parametrize(
    "inflight",
    [{b"\x01\x00": -3}, {b"\x01\x00": "many"}, {b"\x01\x00": 1e30}, "not a map"],
    ids=["negative", "string", "huge", "not_a_map"],
)
async def test_a_hostile_in_flight_count_leaves_the_coordinators_counts_and_is_not_drained(
    sim_vllm: SimVllm, embedded: EmbeddedExporters, inflight: Any
) -> None:
    """The coordinator's counts stand; the rank whose own count cannot be read (every rank
    when the table is not a map) is not drained: its ``has_work`` false is unknown."""
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    core: Any = sim_vllm.core
    core.engine_inflight = inflight
    activity, _ = await activity_until(service, [(0, 0)] * 3)
    unreadable = [True] * 3 if isinstance(inflight, str) else [False, True, False]
    assert [a["drained"] for a in activity] == [None if u else True for u in unreadable]
    assert [a["has_work"] for a in activity] == [None if u else False for u in unreadable]


async def test_without_a_coordinator_subscription_no_count_is_known(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    sim_vllm.engines[1].state.submit(LONG_S, time.monotonic())
    # vLLM's table stays at its initial zeros without the subscription: never read as idle.
    assert sim_vllm.core.lb_engines == [[0, 0, 0.0]] * 3
    activity, metrics = await read_activity(service)
    assert [(a["running"], a["waiting"]) for a in activity] == [(None, None)] * 3
    assert [a["has_work"] for a in activity] == [False, True, False]  # has_work is its own read
    assert [requests_series(metrics, e) for e in "012"] == [(None, None)] * 3


async def test_counts_are_unknown_again_once_the_subscription_ended(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    coordinate(sim_vllm)
    await activity_until(service, [(0, 0)] * 3)
    task = sim_vllm.core.resources.stats_update_task
    assert task is not None
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
    assert task.done() and sim_vllm.core.lb_engines == [[0, 0, 0.0]] * 3  # the last publication
    _, metrics = await activity_until(service, [(None, None)] * 3)
    assert [requests_series(metrics, e) for e in "012"] == [(None, None)] * 3


async def test_a_hostile_entry_makes_that_ranks_counts_null_end_to_end(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    idle_subscription(sim_vllm)
    set_table(sim_vllm, [[1, 2, 0.5], [-1, 0, 0.0], [0, "busy", 0.0]])
    activity, metrics = await activity_until(service, [(2, 1), (None, None), (None, None)])
    # vLLM publishes requests on rank 0: it has work, told by its counts (not asked).
    assert (activity[0]["has_work"], activity[0]["drained"]) == (True, False)
    assert activity[0]["has_work_read"] == "told"
    # No counts for ranks 1 and 2: asked, and vLLM's has_work false with no count is drained.
    assert [(a["has_work_read"], a["drained"]) for a in activity[1:]] == [("asked", True)] * 2
    assert requests_series(metrics, "0") == (2.0, 1.0)
    assert requests_series(metrics, "1") == requests_series(metrics, "2") == (None, None)


ENTRY_CASES: dict[str, tuple[Any, list[RequestCounts | None]]] = {
    "sound": (
        [[0, 1, 0.0], [2, 0, 0.3], [0, 0]],
        [RequestCounts(1, 0), RequestCounts(0, 2), RequestCounts(0, 0)],
    ),
    "negative": (
        [[0, 1, 0.0], [-1, 0, 0.0], [0, 0, 0.0]],
        [RequestCounts(1, 0), None, RequestCounts(0, 0)],
    ),
    "huge": (
        [[0, 10**30, 0.0], [0, 0, 0.0], [0, 0, 0.0]],
        [None, RequestCounts(0, 0), RequestCounts(0, 0)],
    ),
    "wrong types": ([["1", 0, 0.0], [0, None, 0.0], [True, 0, 0.0]], [None, None, None]),
    "fractions and nan": (
        [[0.5, 0, 0.0], [0, float("nan")], [0.0, 2.0, 0.1]],
        [None, None, RequestCounts(2, 0)],
    ),
    "short lists": ([[3], [], [0, 0, 0.0]], [None, None, RequestCounts(0, 0)]),
    "not lists": (["00", None, {"waiting": 0, "running": 0}], [None, None, None]),
    "table shorter than the ranks": ([[0, 4, 0.0]], [RequestCounts(4, 0), None, None]),
}


@pytest.mark.parametrize("case", ENTRY_CASES)
async def test_each_hostile_entry_is_that_ranks_alone(sim_vllm: SimVllm, case: str) -> None:
    table, expected = ENTRY_CASES[case]
    core = VllmCore(sim_vllm.core, vllm_version="0.33.0", enable_sleep_mode=True)
    idle_subscription(sim_vllm)
    set_table(sim_vllm, table)
    found = core.request_counts([0, 1, 2])
    assert [found.get(rank) for rank in range(3)] == expected
    assert core.request_counts([1]) == ({1: expected[1]} if expected[1] is not None else {})


@pytest.mark.parametrize(
    ("table", "managed"),
    [
        ("not a table", [0, 1, 2]),
        (None, [0, 1, 2]),
        ({0: [0, 1, 0.0]}, [0, 1, 2]),
        ((([0, 1, 0.0]),), [0, 1, 2]),  # a tuple is not vLLM's list
        ([[0, 1, 0.0]] * 3, None),
        ([[0, 1, 0.0]] * 3, "012"),
    ],
)
async def test_a_table_that_is_not_vllms_gives_no_counts(
    sim_vllm: SimVllm, table: Any, managed: Any
) -> None:
    core = VllmCore(sim_vllm.core, vllm_version="0.33.0", enable_sleep_mode=True)
    idle_subscription(sim_vllm)
    set_table(sim_vllm, table, managed)
    assert core.request_counts([0, 1, 2]) == {}
    # The front end's own requests still count (tests/unit/client/inprocess/test_vllm_core.py).
    sim_vllm.core.engine_inflight[sim_vllm.core.core_engines[2]] = 1
    assert core.request_counts([0, 1, 2]) == {2: RequestCounts(1, 0)}


async def test_managed_ranks_map_table_positions_to_ranks(sim_vllm: SimVllm) -> None:
    core = VllmCore(sim_vllm.core, vllm_version="0.33.0", enable_sleep_mode=True)
    idle_subscription(sim_vllm)
    # An API server that manages ranks 2 and 0 only (vLLM's hybrid load balancing), one that
    # is not a rank at all.
    set_table(sim_vllm, [[0, 5, 0.0], [0, 9, 0.0], [1, 0, 0.0]], managed=[2, "1", 0])
    assert core.request_counts([0, 1, 2]) == {2: RequestCounts(5, 0), 0: RequestCounts(0, 1)}
    assert core.request_counts([2]) == {2: RequestCounts(5, 0)}


async def test_the_exporter_keeps_serving_whatever_the_table_holds(
    sim_vllm: SimVllm, embedded: EmbeddedExporters
) -> None:
    service = await embedded(sim_vllm.llm)
    idle_subscription(sim_vllm)
    for table in ("garbage", [[0, 1]] * 5000, [[{"x": 1}, 2**70]] * 3, []):
        set_table(sim_vllm, table)
        activity, _ = await read_activity(service)
        assert len(activity) == 3
    async with aiohttp.ClientSession() as session:
        async with session.get(service.url + "/healthz") as resp:
            assert resp.status == 200
