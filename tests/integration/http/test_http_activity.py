"""HTTP mode's activity read over dev-routes targets: ``has_work`` and each target's running and
waiting requests from vLLM's ``GET /metrics`` (summed over its ranks), through the client and
through the whole exporter (``/gate``, ``/status``, ``/metrics``). A server without the request
families (``--disable-log-stats``) is unsupported, never idle; one whose families cannot be read
fails closed. Real sockets: simulated API servers on loopback (plugin targets:
tests/integration/http/test_http_activity_plugin.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from exporter.client.fleet import Outcome
from exporter.client.http.client import HttpFleetClient
from exporter.control.attach import parse_targets
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.activity import RequestCounts
from exporter.sim.work import MAX_RUNNING
from tests.harness.apiservers import ApiServer, StartApi, http_config
from tests.harness.hostile_api import HostileApi
from tests.harness.scrape import metric_value, parse_metrics
from tests.harness.service import Service, ServiceFactory
from tests.harness.waiting import WAIT_S

NAMES = ("first", "middle", "last")
POSITIONS = {name: i for i, name in enumerate(NAMES)}
IDLE = {"running": 0, "waiting": 0}
#: Seconds of work a request given for the whole test holds (never reached).
FOREVER_S = 600.0


async def servers(
    start_api: StartApi, log_stats: tuple[bool, ...] = (True,) * 3
) -> list[ApiServer]:
    """One API server of two engines per flag (fleet-wide DP ranks 0-1, 2-3, 4-5)."""
    return [
        await start_api(engines=2, story_offset=2 * i, log_stats=on)
        for i, on in enumerate(log_stats)
    ]


def targets(apis: list[ApiServer]) -> list[str]:
    return [f"{name}={api.url}" for name, api in zip(NAMES, apis, strict=False)]


async def exporter(start_exporter: ServiceFactory, apis: list[ApiServer]) -> Service:
    ex = await start_exporter(http_config(targets(apis), gate_min_interval=0))
    await ex.fresh_poll()
    return ex


async def gate(ex: Service, query: str = "") -> tuple[int, dict[str, Any]]:
    status, body = await asyncio.wait_for(ex.get_json(f"/gate{query}"), WAIT_S)
    return status, body


def by_engine(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["engine"]: e for e in body["engines"]}


async def activity(ex: Service) -> dict[str, dict[str, Any]]:
    """Each engine's ``activity`` in ``/status`` after two fresh polls (a poll publishes the
    counts the one before it read)."""
    await ex.fresh_poll()
    await ex.fresh_poll()
    doc = await asyncio.wait_for(ex.status(), WAIT_S)
    return {e["engine"]: e["activity"] for e in doc["engines"]}


async def eventually_async(check: Any, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.1)


# -- the client --------------------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_has_work_and_counts_per_target(
    start_api: StartApi, clients: list[HttpFleetClient], position: int
) -> None:
    apis = await servers(start_api)
    client = HttpFleetClient(parse_targets(targets(apis)))
    await client.start()
    clients.append(client)
    assert client.capabilities.request_counts
    assert [d.requests for d in client.engine_details()] == [None] * 3  # nothing read yet
    # The target's two ranks: its counts are their sum.
    now = time.monotonic()
    busy = apis[position].sim.engines
    busy[0].submit(FOREVER_S, now)
    busy[1].submit(FOREVER_S, now, count=MAX_RUNNING + 1)
    outcomes = await client.call_utility("has_work", timeout_s=WAIT_S)
    assert [(o.engine, o.outcome, o.value) for o in outcomes] == [
        (name, Outcome.OK, i == position) for i, name in enumerate(NAMES)
    ]
    expected = RequestCounts(MAX_RUNNING + 1, 1)
    assert {d.engine: d.requests for d in client.engine_details()} == {
        name: expected if i == position else RequestCounts(0, 0) for i, name in enumerate(NAMES)
    }
    # The read is GET /metrics, no dev route.
    assert ("GET", "/metrics") in [(m, p) for m, p, _ in apis[position].sim.requests]


async def test_an_unreachable_target_has_no_counts(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    apis = await servers(start_api)
    client = HttpFleetClient(parse_targets(targets(apis)))
    await client.start()
    clients.append(client)
    await client.call_utility("has_work", timeout_s=WAIT_S)
    assert all(d.requests == RequestCounts(0, 0) for d in client.engine_details())
    await asyncio.wait_for(apis[1].runner.cleanup(), WAIT_S)
    outcomes = await client.call_utility("has_work", timeout_s=WAIT_S)
    assert outcomes[1].outcome is Outcome.DISCONNECTED
    assert [d.requests for d in client.engine_details()] == [
        RequestCounts(0, 0),
        None,
        RequestCounts(0, 0),
    ]


async def test_a_read_that_never_ends_leaves_no_counts(
    start_api: StartApi, clients: list[HttpFleetClient]
) -> None:
    """A ``/metrics`` that drips its answer past the deadline: timeout, its counts unknown."""
    apis = await servers(start_api)
    slow = await HostileApi().start()
    try:
        slow.json("/version", {"version": "0.33.0"})

        async def metrics(_: web.Request) -> web.StreamResponse:
            return web.Response(body=pairs((0, "1.0", "0.0")), content_type="text/plain")

        slow.routes["/metrics"] = metrics
        client = HttpFleetClient(parse_targets([*targets(apis[:2]), f"slow={slow.url}"]))
        await client.start()
        clients.append(client)
        await client.call_utility("has_work", timeout_s=WAIT_S)
        assert client.engine_details()[2].requests == RequestCounts(1, 0)
        slow.drip("/metrics")
        outcomes = await client.call_utility("has_work", timeout_s=0.5)
        assert [o.outcome for o in outcomes] == [Outcome.OK, Outcome.OK, Outcome.TIMEOUT]
        assert [d.requests for d in client.engine_details()] == [
            RequestCounts(0, 0),
            RequestCounts(0, 0),
            None,
        ]
    finally:
        await slow.close()


# -- the exporter --------------------------------------------------------------------------------


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_target_with_work_then_drained(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    apis = await servers(start_api)
    ex = await exporter(start_exporter, apis)
    name = NAMES[position]
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (200, []), body
    assert all(e["requests"] == IDLE for e in body["engines"])

    # Requests queue behind the target's paused schedulers (nothing runs): waiting is work.
    both = apis[position].sim.engines
    for engine in both:
        engine.call("pause_scheduler", ["keep"], now=time.monotonic())
    both[1].submit(1.0, time.monotonic(), count=MAX_RUNNING + 2)
    status, body = await gate(ex)
    mine = by_engine(body)[name]
    assert mine["values"]["has_work"] is True
    assert mine["requests"] == {"running": 0, "waiting": MAX_RUNNING + 2}
    assert all(e["values"]["has_work"] is False for e in body["engines"] if e["engine"] != name)
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (412, [name])
    (failure,) = by_engine(body)[name]["failures"]
    assert "has work" in failure and f"waiting {MAX_RUNNING + 2}" in failure
    status, body = await gate(ex, "?drained=false")
    assert status == 412 and name not in body["failing_engines"]
    found = await activity(ex)
    assert found[name] == {
        "has_work": True,
        "has_work_read": "asked",  # HTTP mode's /metrics read
        "running": 0,
        "waiting": MAX_RUNNING + 2,
        "drained": False,
    }
    families = parse_metrics(await ex.metrics())
    assert metric_value(families, "vllm_dp_engine_has_work", engine=name) == 1
    assert (
        metric_value(families, "vllm_dp_engine_requests", engine=name, state="waiting")
        == MAX_RUNNING + 2
    )

    # Resumed, they run for a second or two and the target drains by itself.
    for engine in both:
        engine.call("resume_scheduler", [], now=time.monotonic())

    async def drained() -> bool:
        return (await gate(ex, "?drained=true"))[0] == 200

    await eventually_async(drained, f"{name} drained")
    status, body = await gate(ex)
    assert by_engine(body)[name]["values"]["has_work"] is False
    assert by_engine(body)[name]["requests"] == IDLE
    found = await activity(ex)
    assert found[name] == {
        "has_work": False,
        "has_work_read": "asked",
        "running": 0,
        "waiting": 0,
        "drained": True,
    }
    families = parse_metrics(await ex.metrics())
    assert metric_value(families, "vllm_dp_engine_has_work", engine=name) == 0


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
async def test_a_server_with_disable_log_stats_is_unsupported_never_idle(
    start_api: StartApi, start_exporter: ServiceFactory, position: int
) -> None:
    flags = tuple(i != position for i in range(3))
    apis = await servers(start_api, flags)
    ex = await exporter(start_exporter, apis)
    name = NAMES[position]
    apis[position].sim.engines[0].submit(FOREVER_S, time.monotonic())  # unseen
    status, body = await gate(ex)
    mine = by_engine(body)[name]
    assert "has_work" not in mine["values"] and mine["requests"] is None
    assert any("has_work: unsupported" in u for u in mine["unread"]), mine
    # Unknown is never drained: the gate fails for it (the others answer).
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (412, [name]), body
    assert "unknown" in by_engine(body)[name]["failures"][0]
    found = await activity(ex)
    assert found[name]["has_work"] is None and found[name]["drained"] is None
    assert all(found[n]["drained"] is True for n in NAMES if n != name)
    families = parse_metrics(await ex.metrics())
    assert metric_value(families, "vllm_dp_engine_has_work", engine=name) is None
    assert metric_value(families, "vllm_dp_engine_requests", engine=name, state="running") is None
    # The other reads are unharmed.
    assert found[name] is not None and (await ex.status())["engines"][position]["state"] == "awake"


async def test_drained_is_501_when_no_target_publishes_its_requests(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    apis = await servers(start_api, (False, False, False))
    ex = await exporter(start_exporter, apis)
    status, body = await gate(ex, "?drained=true")
    assert status == 501 and body["unsupported"] == ["drained"], body
    status, _ = await gate(ex, "?sleeping=false")
    assert status == 200


# -- hostile /metrics ------------------------------------------------------------------------------


def pairs(*series: tuple[int | str, str, str]) -> bytes:
    """A ``/metrics`` body: (engine, running, waiting) per rank, around vLLM's other lines."""
    lines = ["# TYPE vllm:num_requests_running gauge", 'vllm:gpu_cache_usage_perc{engine="0"} 0.1']
    for rank, running, waiting in series:
        lines.append(f'vllm:num_requests_running{{engine="{rank}",model_name="m"}} {running}')
        lines.append(f'vllm:num_requests_waiting{{engine="{rank}",model_name="m"}} {waiting}')
    return ("\n".join(lines) + "\n").encode()


#: Bodies whose request counts cannot be read, and a word of the error each gives.
HOSTILE: dict[str, tuple[bytes, str]] = {
    "negative": (pairs((0, "-1.0", "0.0"), (1, "0.0", "0.0")), "cannot be read"),
    "nan": (pairs((0, "NaN", "0.0"), (1, "0.0", "0.0")), "cannot be read"),
    "huge": (pairs((0, "1e30", "0.0"), (1, "0.0", "0.0")), "cannot be read"),
    "string": (pairs((0, "zero", "0.0"), (1, "0.0", "0.0")), "cannot be read"),
    "bool_ish": (pairs((0, "True", "False"), (1, "0.0", "0.0")), "cannot be read"),
    "no_engine_label": (
        b'vllm:num_requests_running{model_name="m"} 0.0\n'
        b'vllm:num_requests_waiting{model_name="m"} 0.0\n',
        "names no engine",
    ),
    "over_the_limit": (
        pairs((0, "0.0", "0.0")) + b"# " + b"x" * (20 << 20) + b"\n",
        "longer than 16 MiB",
    ),
}


@pytest.mark.parametrize("position", POSITIONS.values(), ids=POSITIONS.keys())
@pytest.mark.parametrize("kind", HOSTILE, ids=HOSTILE.keys())
async def test_an_unreadable_metrics_answer_fails_closed(
    start_api: StartApi, start_exporter: ServiceFactory, kind: str, position: int
) -> None:
    """A target whose ``/metrics`` turns unreadable: its ``has_work`` failed and its counts
    unknown (never the idle it was), the gate's ``drained`` fails for it, the exporter keeps
    serving; readable again, drained again."""
    text, error = HOSTILE[kind]
    apis = await servers(start_api)
    ex = await exporter(start_exporter, apis)
    name = NAMES[position]
    assert (await gate(ex, "?drained=true"))[0] == 200
    apis[position].sim.metrics_answer = text
    status, body = await gate(ex)
    mine = by_engine(body)[name]
    assert mine["requests"] is None and "has_work" not in mine["values"]
    (unread,) = [u for u in mine["unread"] if u.startswith("has_work")]
    assert "failed" in unread and error in unread, unread
    assert all(by_engine(body)[n]["requests"] == IDLE for n in NAMES if n != name)
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (412, [name]), body
    # /metrics and /status keep answering; the failure is counted.
    found = await activity(ex)
    assert found[name] == {
        "has_work": None,
        "has_work_read": None,
        "running": None,
        "waiting": None,
        "drained": None,
    }
    families = parse_metrics(await asyncio.wait_for(ex.metrics(), WAIT_S))
    failed = metric_value(
        families, "vllm_dp_utility_calls", method="has_work", engine=name, outcome="failed"
    )
    assert failed is not None and failed >= 1
    assert metric_value(families, "vllm_dp_engine_up", engine=name) == 1  # is_sleeping answers
    apis[position].sim.metrics_answer = None
    assert (await gate(ex, "?drained=true"))[0] == 200


async def test_duplicated_series_are_summed(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """Two API-server processes each publishing a rank's series: the rank's are their sum."""
    apis = await servers(start_api)
    ex = await exporter(start_exporter, apis)
    apis[1].sim.metrics_answer = pairs(
        (2, "1.0", "0.0"), (3, "0.0", "0.0"), (2, "2.0", "1.0"), (3, "0.0", "0.0")
    )
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (412, ["middle"])
    assert by_engine(body)["middle"]["requests"] == {"running": 3, "waiting": 1}


def cancelling(rank: int, first: str, second: str) -> bytes:
    """``/metrics`` where ``rank``'s running requests are two ``model_name`` series whose sum
    reads as a count (``3`` and ``-3``), beside a sound next rank."""
    return (
        f'vllm:num_requests_running{{engine="{rank}",model_name="a"}} {first}\n'
        f'vllm:num_requests_running{{engine="{rank}",model_name="b"}} {second}\n'
        f'vllm:num_requests_waiting{{engine="{rank}",model_name="a"}} 0.0\n'
    ).encode() + pairs((rank + 1, "0.0", "0.0"))


@pytest.mark.parametrize(
    "samples",
    [("3.0", "-3.0"), ("1.5", "0.5"), ("1e30", "-1e30")],
    ids=["negative", "fractions", "huge"],
)
async def test_samples_that_cancel_out_are_unknown_never_drained(
    start_api: StartApi, start_exporter: ServiceFactory, samples: tuple[str, str]
) -> None:
    """Each sample is checked before any sum: ``running 3`` plus ``running -3`` of one engine
    is not the idle 0 it sums to; the gate answers 412 for that target."""
    apis = await servers(start_api)
    ex = await exporter(start_exporter, apis)
    assert (await gate(ex, "?drained=true"))[0] == 200
    apis[1].sim.metrics_answer = cancelling(2, *samples)
    status, body = await gate(ex, "?drained=true")
    assert (status, body["failing_engines"]) == (412, ["middle"]), body
    middle = by_engine(body)["middle"]
    assert middle["requests"] is None and middle["values"]["drained"] is None, middle
    assert middle["failures"][0].startswith("drained: unknown, has_work: failed"), middle


async def test_an_unreadable_answer_is_asked_again_next_poll(
    start_api: StartApi, start_exporter: ServiceFactory
) -> None:
    """An unreadable answer is a failure, asked again next poll (an unsupported method is
    not): the target recovers without a restart."""
    apis = await servers(start_api)
    ex = await exporter(start_exporter, apis)
    apis[0].sim.metrics_answer = HOSTILE["nan"][0]
    await ex.fresh_poll()
    asked = [p for _, p, _ in apis[0].sim.requests].count("/metrics")
    await ex.fresh_poll()
    assert [p for _, p, _ in apis[0].sim.requests].count("/metrics") > asked
    apis[0].sim.metrics_answer = None
    found = await activity(ex)
    assert found["first"]["drained"] is True
    o = ex.exporter.poller.snapshot.engines[0].outcomes["has_work"]
    assert o.outcome is Outcome.OK and not is_unsupported(o)
