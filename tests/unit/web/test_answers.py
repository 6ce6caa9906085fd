"""The read answers (``exporter.web.answers``), framework-free: one table both servers register,
the same answer whether its steps run at once (the service) or a step per loop turn (the
plugin), and one answer while there is no exporter."""

from __future__ import annotations

import json
from typing import Any

from exporter.base.steps import run_steps_async
from exporter.web.answers import (
    HTML,
    JSON,
    NO_STORE,
    READ_ROUTES,
    ROUTABLE_CACHE,
    RouteAnswer,
    at_once,
    not_started,
)
from exporter.web.statuspage import HEADERS as PAGE_HEADERS
from tests.harness.fakefleets import awake, fleet_of
from tests.unit.web.test_admin import make_exporter

ROUTES = {r.path: r for r in READ_ROUTES}


def body(answer: RouteAnswer) -> Any:
    assert answer.content_type == JSON
    return json.loads(answer.body)


def test_the_table_has_every_read_route_once_with_a_name_and_summary() -> None:
    assert list(ROUTES) == ["/status", "/", "/gate", "/readyz", "/routable", "/kv_events_targets"]
    assert len({r.name for r in READ_ROUTES}) == len(READ_ROUTES)
    assert all(r.summary for r in READ_ROUTES)


async def test_at_once_and_in_steps_give_the_same_answer() -> None:
    exporter = make_exporter(fleet_of(awake(["0", "1", "2"])))
    await exporter.poller.poll_once()
    for path in ("/readyz", "/routable", "/kv_events_targets"):
        route = ROUTES[path]
        served = await route.answer(exporter, {}, at_once)
        plugin = await route.answer(exporter, {}, run_steps_async)
        assert served == plugin, path
    served = await ROUTES["/status"].answer(exporter, {}, at_once)
    plugin = await ROUTES["/status"].answer(exporter, {}, run_steps_async)
    assert served.headers == plugin.headers == NO_STORE
    assert [e["engine"] for e in body(served)["engines"]] == ["0", "1", "2"]
    # The same document but for the clock (seconds since each engine's last answer).
    assert [
        (e["engine"], e["state"], e["routable"], e["invariants"]) for e in body(plugin)["engines"]
    ] == [
        (e["engine"], e["state"], e["routable"], e["invariants"]) for e in body(served)["engines"]
    ]


async def test_each_answer_s_status_type_and_caching() -> None:
    exporter = make_exporter(fleet_of(awake(["0", "1"])))
    not_yet = await ROUTES["/readyz"].answer(exporter, {}, at_once)
    assert not_yet.status == 503 and body(not_yet)["ready"] is False
    await exporter.poller.poll_once()
    routable = await ROUTES["/routable"].answer(exporter, {}, at_once)
    assert routable.headers == {"Cache-Control": ROUTABLE_CACHE}
    assert body(routable)["routable_engines"] == ["0", "1"]
    one = await ROUTES["/readyz"].answer(exporter, {"engine": ["1"]}, at_once)
    twice = await ROUTES["/readyz"].answer(exporter, {"engine": ["0", "1"]}, at_once)
    assert (one.status, twice.status) == (200, 400)
    bad = await ROUTES["/gate"].answer(exporter, {"nonsense": ["1"]}, at_once)
    assert bad.status == 400 and bad.headers == NO_STORE and body(bad)["ok"] is False
    held = await ROUTES["/gate"].answer(exporter, {"sleeping": ["false"]}, at_once)
    assert held.status == 200 and body(held)["ok"] is True
    page = await ROUTES["/"].answer(exporter, {}, at_once)
    assert (page.status, page.content_type, page.headers) == (200, HTML, PAGE_HEADERS)
    assert page.body.startswith(b"<!DOCTYPE html>") or b"<html" in page.body[:200]


def test_not_started_is_one_503_with_the_problem() -> None:
    answer = not_started("vLLM is still starting")
    assert answer.status == 503
    assert body(answer) == {"ok": False, "error": "vLLM is still starting"}
