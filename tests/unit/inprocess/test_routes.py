"""The plugin's routes on vLLM's port (``exporter.inprocess.routes``), called as handlers over
Starlette requests built in memory: each must answer 503 with the runtime's problem until the
exporter runs (vLLM serves on meanwhile), ``/metrics`` must never cost vLLM its own series,
and the admin routes' guards must get the connection's peer and a bounded body."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from starlette.requests import Request

from exporter.client.fake import FakeFleet
from exporter.control.actions import ACTIONS
from exporter.control.runtime import Exporter
from exporter.inprocess.peer import Peer
from exporter.inprocess.routes import (
    METRICS_CONTENT_TYPE,
    NO_TOKEN,
    PluginHandlers,
    admin_route,
    from_starlette,
    read_handler,
    route_table,
)
from exporter.inprocess.runtime import NOT_STARTED, InProcessRuntime
from exporter.web.admin import AdminController
from exporter.web.answers import READ_ROUTES
from tests.unit.control.test_runtime import awake, config

VLLM_SERIES = b"vllm:num_requests_running 0.0\n"


def request(
    path: str = "/dp/status",
    *,
    method: str = "GET",
    query: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    chunks: list[bytes] | None = None,
    delay_s: float = 0.0,
) -> Request:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "query_string": query,
        "headers": headers or [],
        "client": ("10.0.0.1", 1234),
    }
    parts = list(chunks or [b""])

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(delay_s)
        body = parts.pop(0) if parts else b""
        return {"type": "http.request", "body": body, "more_body": bool(parts)}

    return Request(scope, receive)


def body_of(response: Any) -> Any:
    return json.loads(bytes(response.body))


async def running() -> InProcessRuntime:
    runtime = InProcessRuntime(environ={})
    exporter = Exporter(config(), client=FakeFleet(awake))
    await exporter.poller.poll_once()
    runtime.exporter, runtime.admin, runtime.problem = (
        exporter,
        AdminController(exporter.action_parts()),
        None,
    )
    return runtime


def test_the_route_table_names_every_route_and_admin_action() -> None:
    routes = route_table(PluginHandlers(InProcessRuntime(environ={}), lambda: b""))
    paths = {(r.method, r.path) for r in routes}
    assert {("GET", "/metrics"), ("GET", "/dp/status"), ("GET", "/dp/gate")} <= paths
    admin = {f"/dp/admin/{p}" for spec in ACTIONS.values() for p in spec.paths}
    assert {p for m, p in paths if m == "POST"} == admin
    assert "/dp/admin/checkpoint/prepare" in admin  # vLLM's own route name, as an alias
    by_path = {r.path: r for r in routes}
    assert by_path["/dp"].options() == {"include_in_schema": False}  # the redirect is no API
    assert by_path["/dp/gate"].options()["tags"] == ["dp_exporter"]
    assert len(paths) == len(routes)  # no route registered twice
    # The service's read routes, every one, under /dp (one table: exporter.web.answers).
    assert {f"/dp{r.path}" for r in READ_ROUTES} <= set(by_path)
    assert by_path["/dp/status"].handler.__name__ == "dp_status"


def reads(runtime: InProcessRuntime) -> dict[str, Any]:
    """Path → the plugin's handler of each read route over ``runtime``."""
    return {r.path: read_handler(runtime, r) for r in READ_ROUTES}


async def test_before_the_start_every_read_answers_503_with_the_problem() -> None:
    runtime = InProcessRuntime(environ={})
    handlers = PluginHandlers(runtime, lambda: VLLM_SERIES)
    for handler in reads(runtime).values():
        response = await handler(request())
        assert response.status_code == 503
        assert body_of(response) == {"ok": False, "error": NOT_STARTED}
    assert (await handlers.dp_metrics(request())).status_code == 503
    assert body_of(await handlers.healthz(request())) == {"status": "not running"}
    metrics = await handlers.metrics(request("/metrics"))
    assert metrics.status_code == 200 and bytes(metrics.body) == VLLM_SERIES  # vLLM's alone


async def test_a_running_plugin_serves_vllms_series_then_its_own() -> None:
    runtime = await running()
    handlers, read = PluginHandlers(runtime, lambda: VLLM_SERIES), reads(runtime)
    metrics = await handlers.metrics(request("/metrics"))
    assert metrics.headers["content-type"] == METRICS_CONTENT_TYPE
    assert bytes(metrics.body).startswith(VLLM_SERIES)
    assert b"# HELP vllm_dp_" in bytes(metrics.body)
    status = await read["/status"](request())
    assert status.headers["cache-control"] == "no-store"
    assert [e["engine"] for e in body_of(status)["engines"]] == ["0", "1"]
    assert body_of(await handlers.healthz(request())) == {"status": "ok"}
    assert (await read["/readyz"](request("/dp/readyz"))).status_code == 200
    redirect = await handlers.to_page(request("/dp"))
    assert (redirect.status_code, redirect.headers["location"]) == (308, "/dp/")


async def test_a_failure_of_our_series_never_costs_vllm_its_own(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    runtime = await running()

    async def broken() -> bytes:
        raise RuntimeError("render failed")

    monkeypatch.setattr(runtime, "series", broken)
    with caplog.at_level(logging.ERROR, logger="exporter.inprocess"):
        metrics = await PluginHandlers(runtime, lambda: VLLM_SERIES).metrics(request("/metrics"))
    assert metrics.status_code == 200 and bytes(metrics.body) == VLLM_SERIES
    assert "could not be rendered" in caplog.text


async def test_admin_routes_need_a_running_plugin_and_its_own_token() -> None:
    spec = ACTIONS["sleep"]
    handler = admin_route(InProcessRuntime(environ={}), spec)
    assert handler.__name__ == "dp_admin_sleep"
    assert (await handler(request("/dp/admin/sleep", method="POST"))).status_code == 503
    refused = await admin_route(await running(), spec)(request("/dp/admin/sleep", method="POST"))
    assert refused.status_code == 403 and body_of(refused) == {"error": NO_TOKEN}


async def test_the_guards_get_the_peer_and_the_raw_headers() -> None:
    raw = request(headers=[(b"x-token", "é".encode()), (b"x-bad", b"\xff")], query=b"a=1&a=2")
    admin = from_starlette(raw, Peer("127.0.0.1", "6.6.6.6"))
    assert admin.remote == "127.0.0.1"  # the connection's, not what a header claimed
    assert admin.headers["X-Token"] == "é"
    assert admin.headers["x-bad"] == "\udcff"  # not UTF-8: a surrogate escape, as aiohttp
    assert admin.query == {"a": ["1", "2"]}
    assert from_starlette(raw, Peer(None, None)).remote is None


@pytest.mark.parametrize(
    ("headers", "chunks", "delay_s", "read"),
    [
        ([], [b"abc", b"de"], 0.0, b"abcde"),
        ([(b"content-length", b"99")], [b"abc"], 0.0, (413, "request body too large")),
        ([], [b"abc", b"def"], 0.0, (413, "request body too large")),
        ([(b"content-length", "²".encode())], [b"ab"], 0.0, b"ab"),  # no ASCII digits: read
        ([], [b"ab"], 1.0, (408, "request body not received in time")),
    ],
)
async def test_the_body_is_read_bounded_in_size_and_time(
    headers: list[tuple[bytes, bytes]], chunks: list[bytes], delay_s: float, read: Any
) -> None:
    admin = from_starlette(
        request(headers=headers, chunks=chunks, delay_s=delay_s), Peer(None, None)
    )
    assert await admin.read_body(5, 0.05) == read
