"""The main application over the in-memory ``FakeFleet``, never served: the routes and hooks
``create_app`` registers, ``/readyz`` before and after a poll, and each handler's status,
headers and body from mocked requests. (Served over loopback: tests/integration/service.)"""

from __future__ import annotations

import gzip
import json
from typing import Any

import bcrypt
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from exporter.config.webconfig import WebConfig
from exporter.control.runtime import Exporter
from exporter.metrics.negotiation import VARY
from exporter.web import app as web_app
from exporter.web.answers import READ_ROUTES, ROUTABLE_CACHE, gate_answer, readiness
from exporter.web.app import EXPORTER_KEY, create_app, read_handler
from exporter.web.statuspage import HEADERS as PAGE_HEADERS
from tests.harness.fakefleets import awake, fleet_of
from tests.unit.web.test_admin import make_exporter


def service(**overrides: Any) -> tuple[web.Application, Exporter]:
    """The app over two engines awake at weight ``v1`` (not polled yet)."""
    exporter = make_exporter(fleet_of(awake(["0", "1"])), **overrides)
    return create_app(exporter.config, exporter), exporter


async def get(app: web.Application, handler: Any, path: str, **headers: str) -> web.Response:
    response = await handler(make_mocked_request("GET", path, headers=headers, app=app))
    assert isinstance(response, web.Response)
    return response


#: Path → the service's handler of each read route (``exporter.web.answers``).
READS = {r.path: read_handler(r) for r in READ_ROUTES}


def body_of(response: web.Response) -> Any:
    assert isinstance(response.body, bytes)
    return json.loads(response.body)


def test_the_app_serves_every_route_and_runs_the_exporter_in_its_cleanup_context() -> None:
    app, exporter = service()
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert routes == {
        "/metrics",
        "/healthz",
        "/readyz",
        "/status",
        "/gate",
        "/routable",
        "/kv_events_targets",
        "/watch",
        "/",
    }
    assert app[EXPORTER_KEY] is exporter
    assert exporter.faults.http_bad_requests == {"metrics": 0}, "its series starts at 0"
    assert len(app.cleanup_ctx) == 2 and not app.middlewares


def test_a_web_config_with_users_puts_basic_auth_in_front() -> None:
    users = {b"ann": bcrypt.hashpw(b"pw", bcrypt.gensalt(4))}
    app, _ = service(web=WebConfig("web.yml", users=users))
    assert len(app.middlewares) == 1


async def test_readyz_waits_for_a_poll_and_judges_one_engine_on_request() -> None:
    _, exporter = service()
    status, body = readiness(exporter)
    assert (status, body["ready"], body["engines_expected"], body["last_poll"]) == (
        503,
        False,
        2,
        0,
    )
    await exporter.poller.poll_once()
    assert readiness(exporter) == (
        200,
        {"ready": True, "engines_expected": 2, "engines_connected": 2, "last_poll": 1},
    )
    assert readiness(exporter, ["1"])[0] == 200
    assert readiness(exporter, ["9"])[0] == 404
    assert readiness(exporter, ["0", "1"]) == (400, {"error": "engine given more than once"})


async def test_the_probes_and_the_routable_document() -> None:
    app, exporter = service()
    assert body_of(await get(app, web_app.healthz, "/healthz")) == {"status": "ok"}
    assert (await get(app, READS["/readyz"], "/readyz")).status == 503
    await exporter.poller.poll_once()
    assert (await get(app, READS["/readyz"], "/readyz?engine=0")).status == 200
    routable = await get(app, READS["/routable"], "/routable")
    assert routable.headers["Cache-Control"] == ROUTABLE_CACHE
    assert body_of(routable)["routable_engines"] == ["0", "1"]


async def test_the_gate_answers_json_a_bad_query_included() -> None:
    app, exporter = service()
    bad = await get(app, READS["/gate"], "/gate?nonsense=1")
    assert bad.status == 400 and bad.headers["Cache-Control"] == "no-store"
    assert body_of(bad)["ok"] is False and "unknown condition 'nonsense'" in body_of(bad)["error"]
    status, body = await gate_answer(exporter, {"sleeping": ["yes"]})
    assert (status, body["ok"]) == (400, False)


async def test_metrics_are_negotiated_and_gzipped_on_request() -> None:
    app, exporter = service()
    await exporter.poller.poll_once()
    plain = await get(app, web_app.metrics, "/metrics")
    zipped = await get(app, web_app.metrics, "/metrics", **{"Accept-Encoding": "gzip"})
    assert plain.headers["Vary"] == VARY and "Content-Encoding" not in plain.headers
    assert zipped.headers["Content-Encoding"] == "gzip"
    assert isinstance(plain.body, bytes) and isinstance(zipped.body, bytes)
    assert b"vllm_dp_" in plain.body
    assert gzip.decompress(zipped.body).startswith(plain.body.split(b"\n", 1)[0])


async def test_status_kv_targets_and_the_page_are_never_cached() -> None:
    app, exporter = service()
    await exporter.poller.poll_once()
    status = await get(app, READS["/status"], "/status")
    assert status.headers["Cache-Control"] == "no-store"
    assert [e["engine"] for e in body_of(status)["engines"]] == ["0", "1"]
    targets = await get(app, READS["/kv_events_targets"], "/kv_events_targets")
    assert (body_of(targets), targets.headers["Cache-Control"]) == ([], "no-store")
    page = await get(app, READS["/"], "/")
    assert page.content_type == "text/html"
    assert all(page.headers[name] == value for name, value in PAGE_HEADERS.items())


async def test_the_gate_holds_or_not_on_a_fresh_read() -> None:
    _, exporter = service()
    held_status, held = await gate_answer(
        exporter, {"sleeping": ["false"], "weight_version": ["v1"]}
    )
    assert (held_status, held["ok"]) == (200, True)
    status, not_held = await gate_answer(exporter, {"weight_version": ["v2"]})
    assert status != 200 and not_held["ok"] is False
