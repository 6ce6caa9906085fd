"""What each rank is doing (``has_work``, its running and waiting requests, ``drained``) through
``exporter.remote``: ``/status`` rows and the gate's ``drained`` condition against the real
service (owner mode over simulated engines: ``has_work`` only; HTTP mode over simulated API
servers: the counts vLLM publishes too), and against stand-ins for an older exporter and a
hostile one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from exporter.remote import (
    NO_RETRY,
    BadRequest,
    Client,
    EngineRequests,
    GateResult,
    InvalidAnswer,
    Progress,
    SyncClient,
    Unsupported,
    WaitTimeout,
)
from exporter.sim.options import SimOptions
from tests.harness.apiservers import ApiServer
from tests.harness.service import Service, ServiceFactory
from tests.integration.remote.conftest import AppServer

#: Longer than any test here runs: a rank given this much work stays busy throughout.
FOREVER_S = 600.0


def give_work(svc: Service, engine: int, seconds: float, count: int = 1) -> None:
    """``count`` requests of ``seconds`` each arrive at engine ``engine`` now."""
    svc.engines[engine].state.submit(seconds, time.monotonic(), count)


async def test_status_rows_and_the_gate_say_which_rank_has_work(fleet: ServiceFactory) -> None:
    svc = await fleet(3, gate_min_interval=0.0)
    give_work(svc, 1, FOREVER_S)
    await svc.next_polls()
    async with Client(svc.url, None) as dp:
        status = await dp.status()
        busy, idle = status.engine(1), status.engine(0)
        assert (busy.has_work, busy.drained) == (True, False)
        assert (idle.has_work, idle.drained) == (False, True)
        # Owner mode reads has_work; vLLM publishes no per-rank counts to it.
        assert (busy.running, busy.waiting, busy.requests) == (None, None, None)

        closed = await dp.gate(drained=True)
        assert (closed.ok, closed.status, closed.failing_engines) == (False, 412, ("1",))
        assert closed.conditions == {"drained": True}
        (failing,) = closed.failing
        assert failing.failures == ("drained: has work, expected drained=true",)
        assert failing.drained is False and failing.requests is None
        assert [e.drained for e in closed.engines] == [True, False, True]

        bare = await dp.gate()  # every read: has_work among the values
        assert bare.ok and [e.has_work for e in bare.engines] == [False, True, False]

        every_one_busy = await dp.gate(drained=False)
        assert every_one_busy.failing_engines == ("0", "2")
        assert "drained: no work, expected drained=false" in every_one_busy.failing[0].failures


async def test_http_mode_gives_each_rank_s_counts(
    http_fleet: tuple[Service, list[ApiServer]],
) -> None:
    svc, servers = http_fleet
    servers[1].sim.engines[0].submit(FOREVER_S, time.monotonic(), 6)  # 4 run, 2 queue
    async with Client(svc.url, None) as dp:
        closed = await dp.gate(drained=True)
        assert closed.status == 412 and closed.failing_engines == ("1",)
        idle, busy = closed.engines
        assert idle.requests == EngineRequests(0, 0) and idle.drained is True
        assert busy.requests == EngineRequests(4, 2) and busy.requests.total == 6
        assert busy.failures == ("drained: has work (running 4, waiting 2), expected drained=true",)
        await svc.fresh_poll()
        status = await dp.status()
    row = status.engine(1)
    assert (row.has_work, row.running, row.waiting, row.drained) == (True, 4, 2, False)
    assert row.requests == EngineRequests(4, 2)
    assert status.engine(0).requests == EngineRequests(0, 0) and status.engine(0).drained


async def test_wait_drained_holds_once_the_last_rank_drains(fleet: ServiceFactory) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    give_work(svc, 0, 0.8, count=2)
    seen: list[Progress] = []
    started = time.monotonic()
    async with Client(svc.url, None) as dp:
        opened = await asyncio.wait_for(
            dp.wait(drained=True, timeout_s=10, progress=seen.append, interval_s=0.1), 15
        )
    assert opened.ok and opened.conditions == {"drained": True}
    assert all(e.drained for e in opened.engines)
    assert time.monotonic() - started >= 0.5, "it opened before the work was done"
    assert seen and seen[0].result is not None and seen[0].result.failing_engines == ("0",)
    assert seen[0].summary == "engine 0: drained: has work, expected drained=true"


async def test_wait_drained_times_out_naming_the_busy_rank(
    http_fleet: tuple[Service, list[ApiServer]],
) -> None:
    svc, servers = http_fleet
    servers[0].sim.engines[0].submit(FOREVER_S, time.monotonic(), 1)
    started = time.monotonic()
    async with Client(svc.url, None) as dp:
        with pytest.raises(WaitTimeout) as timed_out:
            await dp.wait({"sleeping": False}, 0.6, drained=True, interval_s=0.1)
    assert 0.6 <= time.monotonic() - started < 5
    error = timed_out.value
    assert str(error).startswith("wait timed out after 0.6s for sleeping=false drained=true")
    assert error.last is not None and error.last.failing_engines == ("0",)
    (busy,) = error.last.failing
    assert busy.requests == EngineRequests(1, 0)
    assert busy.failures == ("drained: has work (running 1, waiting 0), expected drained=true",)


async def test_the_sync_client_takes_drained_too(fleet: ServiceFactory) -> None:
    svc = await fleet(2, gate_min_interval=0.0)
    give_work(svc, 1, 0.5)

    def calls() -> tuple[GateResult, GateResult]:
        with SyncClient(svc.url, None) as dp:
            closed = dp.gate(drained=True)
            return closed, dp.wait(drained=True, timeout_s=10, interval_s=0.1)

    closed, opened = await asyncio.to_thread(calls)
    assert closed.status == 412 and closed.failing_engines == ("1",)
    assert opened.ok and opened.conditions == {"drained": True}


async def test_a_bad_drained_is_refused_before_anything_is_sent(serve_app: AppServer) -> None:
    asked: list[str] = []

    async def gate(request: web.Request) -> web.Response:
        asked.append(request.query_string)
        return web.json_response({"ok": True, "engines": []})

    app = web.Application()
    app.router.add_get("/gate", gate)
    url = await serve_app(app)
    started = time.monotonic()
    async with Client(url, None, retry=NO_RETRY) as dp:
        with pytest.raises(BadRequest, match="drained must be True, False or None, got 'yes'"):
            await dp.gate(drained="yes")  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="drained must be True, False or None, got 1"):
            await dp.wait(drained=1, timeout_s=30)  # type: ignore[arg-type]
        with pytest.raises(BadRequest, match="contradicts"):
            await dp.wait({"drained": False}, 30, drained=True)
        assert (await dp.gate(drained=False)).ok
    assert time.monotonic() - started < 5, "a bad question was retried"
    assert asked == ["drained=false"]


async def test_no_vllm_with_has_work_is_unsupported_at_once(fleet: ServiceFactory) -> None:
    svc = await fleet(2, options=SimOptions(missing_methods=frozenset({"has_work"})))
    started = time.monotonic()
    async with Client(svc.url, None) as dp:
        with pytest.raises(Unsupported) as unsupported:
            await dp.wait(drained=True, timeout_s=30, interval_s=0.1)
        status = await dp.status()
    assert unsupported.value.conditions == ("drained",) and unsupported.value.status == 501
    assert time.monotonic() - started < 10, "a 501 was retried"
    assert [(e.has_work, e.drained) for e in status.engines] == [(None, None), (None, None)]


OLD_STATUS: dict[str, Any] = {
    "version": "0.0.9",
    "attach": "owner",
    "ready": True,
    "engines_expected": 1,
    "engines_connected": 1,
    "last_poll": {"number": 4},
    "aggregate": {"is_sleeping": {"state": "consistent", "value": False}},
    "engines": [{"engine": "0", "connected": True, "up": True, "state": "awake"}],
}
OLD_GATE: dict[str, Any] = {
    "ok": True,
    "conditions": {},
    "engines": [{"engine": "0", "ok": True, "values": {"sleeping": False}, "failures": []}],
    "failing_engines": [],
}


async def test_an_older_exporter_s_answers_have_no_activity(serve_app: AppServer) -> None:
    async def status(request: web.Request) -> web.Response:
        return web.json_response(OLD_STATUS)

    async def gate(request: web.Request) -> web.Response:
        if "drained" in request.query:  # its gate does not know the condition
            known = "weight_version, sleeping, paused, healthy"
            return web.json_response(
                {"error": f"unknown condition 'drained' (known: {known})"}, status=400
            )
        return web.json_response(OLD_GATE)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/gate", gate)
    url = await serve_app(app)
    async with Client(url, None, retry=NO_RETRY) as dp:
        (row,) = (await dp.status()).engines
        assert (row.has_work, row.running, row.waiting, row.drained) == (None,) * 4
        assert row.requests is None
        (engine,) = (await dp.gate()).engines
        assert engine.requests is None and engine.has_work is None
        with pytest.raises(BadRequest) as unknown:
            await dp.wait(drained=True, timeout_s=30)
    assert "unknown condition 'drained'" in unknown.value.detail


@pytest.mark.parametrize(
    ("activity", "says"),
    [
        ({"has_work": True, "running": -1, "waiting": 0, "drained": False}, "running must be"),
        ({"has_work": "yes", "running": 0, "waiting": 0, "drained": True}, "has_work must be"),
        ({"has_work": True, "running": 1, "waiting": 0.5, "drained": False}, "waiting must be"),
        ("idle", "activity must be an object"),
    ],
)
async def test_malformed_activity_is_an_invalid_answer(
    serve_app: AppServer, activity: Any, says: str
) -> None:
    doc = {**OLD_STATUS, "engines": [{**OLD_STATUS["engines"][0], "activity": activity}]}
    requests = {"running": -1, "waiting": 0}  # and a gate answer with a negative count
    gate_body = {**OLD_GATE, "engines": [{**OLD_GATE["engines"][0], "requests": requests}]}

    async def status(request: web.Request) -> web.Response:
        return web.json_response(doc)

    async def gate(request: web.Request) -> web.Response:
        return web.json_response(gate_body)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/gate", gate)
    url = await serve_app(app)
    async with Client(url, None, retry=NO_RETRY) as dp:
        with pytest.raises(InvalidAnswer) as bad:
            await dp.status()
        with pytest.raises(InvalidAnswer) as bad_gate:
            await dp.gate()
    assert str(bad.value).startswith("HTTP 200: engines[0].activity")
    assert says in str(bad.value)
    assert "engines[0].requests.running must be a count" in str(bad_gate.value)


async def test_the_counts_follow_the_rank_as_it_drains(
    http_fleet: tuple[Service, list[ApiServer]],
) -> None:
    """Each check reads the counts afresh: a rank working through its queue shows fewer."""
    svc, servers = http_fleet
    servers[1].sim.engines[0].submit(0.6, time.monotonic(), 6)  # 4 run, 2 wait, ~1.2 s in all
    counts: list[EngineRequests] = []

    def record(p: Progress) -> None:
        if p.result is not None:
            found = p.result.failing[0].requests if p.result.failing else None
            if found is not None and (not counts or counts[-1] != found):
                counts.append(found)

    async with Client(svc.url, None) as dp:
        opened = await dp.wait(drained=True, timeout_s=10, progress=record, interval_s=0.1)
    assert opened.ok and counts and counts[0] == EngineRequests(4, 2)
    assert [c.total for c in counts] == sorted((c.total for c in counts), reverse=True)
