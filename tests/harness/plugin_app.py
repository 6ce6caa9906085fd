"""The ``dp_exporter`` endpoint plugin on a real FastAPI app served by uvicorn on 127.0.0.1,
over a simulated vLLM ``AsyncLLM`` whose engines are simulated engines on real ZMQ sockets.

The order is vLLM's: the app is built and ``attach_router(app)`` adds the plugin's routes, then
``init_state(engine_client, state, args)`` starts the exporter, then uvicorn serves the app (its
lifespan starts; its end stops the exporter). The plugin reads its settings from the process
environment, as inside ``vllm serve``: ``plugin_env`` sets them through pytest's
``monkeypatch`` (any ``VLLM_DP_EXPORTER_*`` of the machine removed first). Every port is
chosen by the kernel; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from argparse import Namespace
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from multidict import CIMultiDictProxy
from prometheus_client import REGISTRY, Gauge

from exporter.inprocess.plugin import DpExporterPlugin
from exporter.inprocess.runtime import InProcessRuntime
from tests.harness.inprocess import SimVllm, start_sim_vllm_fleet
from tests.harness.waiting import eventually

WAIT_S = 10.0
POLL_INTERVAL = "0.1"
CALL_TIMEOUT = "0.5"
#: A series of "vLLM's own" registry (prometheus_client's global REGISTRY, which the plugin's
#: /metrics renders first, as vLLM's own /metrics does).
VLLM_MARKER = "vllm:dp_plugin_test_marker"
TOKEN = "tok-plugin-5c2e9a71d04b"


def plugin_env(monkeypatch: pytest.MonkeyPatch, **settings: str) -> None:
    """The plugin's environment: fast polls, no reset interval, then ``settings``
    (``POLL_INTERVAL="abc"`` sets ``VLLM_DP_EXPORTER_POLL_INTERVAL``)."""
    for name in list(os.environ):
        if name.startswith("VLLM_DP_EXPORTER_") or name == "PROMETHEUS_MULTIPROC_DIR":
            monkeypatch.delenv(name)
    values = {
        "POLL_INTERVAL": POLL_INTERVAL,
        "CALL_TIMEOUT": CALL_TIMEOUT,
        "RESET_MIN_INTERVAL": "0",
        "SHUTDOWN_GRACE": "1",
        **settings,
    }
    for name, value in values.items():
        monkeypatch.setenv(f"VLLM_DP_EXPORTER_{name}", value)


@contextlib.contextmanager
def vllm_series(value: float = 42.0) -> Iterator[Gauge]:
    """One series in prometheus_client's global registry for the test's duration."""
    gauge = Gauge(VLLM_MARKER, "a series of vLLM's own", registry=REGISTRY)
    gauge.set(value)
    try:
        yield gauge
    finally:
        REGISTRY.unregister(gauge)


async def serve(
    app: FastAPI, *, lifespan: Literal["auto", "on", "off"] = "on"
) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """``app`` served by uvicorn on 127.0.0.1 (a kernel-chosen port), started (bounded)."""
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        lifespan=lifespan,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started or task.done(), WAIT_S, "uvicorn's start")
    if task.done():
        task.result()
        raise AssertionError("uvicorn exited at start")
    return server, task


def server_url(server: uvicorn.Server) -> str:
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    assert host == "127.0.0.1"
    return f"http://{host}:{port}"


async def stop_server(server: uvicorn.Server, task: asyncio.Task[None]) -> None:
    """uvicorn's graceful exit (the app's lifespan ends), bounded."""
    server.should_exit = True
    await asyncio.wait_for(task, WAIT_S)


@dataclass
class PluginApp:
    """A FastAPI app with the plugin, served by uvicorn; HTTP helpers over aiohttp."""

    app: FastAPI
    plugin: DpExporterPlugin
    server: uvicorn.Server
    task: asyncio.Task[None]
    url: str
    session: aiohttp.ClientSession
    fleet: SimVllm | None = None
    stopped: bool = field(default=False)

    @property
    def runtime(self) -> InProcessRuntime:
        return self.plugin.runtime

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def get(self, path: str) -> tuple[int, CIMultiDictProxy[str], str]:
        async with self.session.get(self.url + path, allow_redirects=False) as resp:
            return resp.status, resp.headers, await resp.text()

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def metrics(self) -> str:
        status, headers, text = await self.get("/metrics")
        assert status == 200, (status, text[:300])
        assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return text

    async def post(
        self,
        action: str,
        *,
        token: str | None = None,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        data: Any = None,
    ) -> tuple[int, Any, CIMultiDictProxy[str]]:
        """POST ``/dp/admin/<action>``: (status, JSON body, response headers)."""
        sent = dict(headers or {})
        if token is not None:
            sent["Authorization"] = f"Bearer {token}"
        async with self.session.post(
            f"{self.url}/dp/admin/{action}", params=params or {}, headers=sent, data=data
        ) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers

    async def stop(self) -> None:
        """uvicorn exits (the lifespan ends: the plugin stops its exporter), then the
        simulated vLLM stops."""
        if self.stopped:
            return
        self.stopped = True
        await self.session.close()
        try:
            await stop_server(self.server, self.task)
        finally:
            await asyncio.wait_for(self.runtime.stop(), WAIT_S)  # idempotent
            if self.fleet is not None:
                await self.fleet.stop()


def add_fault_tolerance_route(app: FastAPI, engine_client: Any) -> None:
    """vLLM 0.33's own ``GET /fault_tolerance/status`` beside the plugin's routes: the front
    end's cached status of every rank it manages (``_engine_status``); 404 while fault
    tolerance is off (vLLM registers the route only with it on). ``fault_status_body``, when
    set on ``app.state``, is answered instead (a hostile server); ``fault_status_under_v1``
    serves it under ``/v1/`` only (vLLM's open PR #46370), 404 at the root."""

    @app.get("/fault_tolerance/status")
    async def fault_tolerance_status() -> Response:
        if getattr(app.state, "fault_status_under_v1", False):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await answer()

    @app.get("/v1/fault_tolerance/status")
    async def fault_tolerance_status_v1() -> Response:
        if not getattr(app.state, "fault_status_under_v1", False):
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return await answer()

    async def answer() -> Response:
        hostile = getattr(app.state, "fault_status_body", None)
        if hostile is not None:
            return Response(hostile, media_type="application/json")
        statuses = getattr(getattr(engine_client, "engine_core", None), "_engine_status", None)
        if not statuses:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        doc = {
            "schema_version": 1,
            "total_engines": len(statuses),
            "engines": list(statuses.values()),
        }
        return JSONResponse(doc)


async def start_plugin_app(
    engine_client: Any,
    *,
    fleet: SimVllm | None = None,
    plugin: DpExporterPlugin | None = None,
    args: Namespace | None = None,
) -> PluginApp:
    """vLLM's order: ``attach_router``, ``init_state`` (must not raise), then uvicorn."""
    app = FastAPI()
    add_fault_tolerance_route(app, engine_client)
    plugin = plugin if plugin is not None else DpExporterPlugin()
    plugin.attach_router(app)
    await plugin.init_state(engine_client, app.state, args or Namespace())
    server, task = await serve(app)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
    return PluginApp(app, plugin, server, task, server_url(server), session, fleet)


async def start_with_fleet(
    engine_count: int = 2, *, ready: bool = True, **fleet_options: Any
) -> PluginApp:
    """A simulated vLLM with ``engine_count`` engines and the plugin's app over it, ready
    (``ready=False``: not waited for; a fleet with a hung engine never is)."""
    fleet = await start_sim_vllm_fleet(engine_count, **fleet_options)
    try:
        app = await start_plugin_app(fleet.llm, fleet=fleet)
    except BaseException:
        await fleet.stop()
        raise
    exporter = app.runtime.exporter
    if ready and exporter is not None:
        await eventually(lambda: exporter.poller.snapshot.ready, WAIT_S, "a ready fleet")
    return app


async def raw_request(port: int, head: bytes, body: bytes = b"") -> bytes:
    """One request over raw TCP to 127.0.0.1 (exactly these bytes); the whole answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


class PluginApps:
    """``await apps(n, ready=True, **fleet_options)``: the plugin's app over ``n`` simulated
    engines (``ready``: once the plugin's first polls saw every engine); ``await
    apps.bare(engine_client)``: over any engine client. ``close`` stops every app made."""

    def __init__(self) -> None:
        self.made: list[PluginApp] = []

    async def __call__(
        self, engine_count: int = 3, *, ready: bool = True, **fleet_options: Any
    ) -> PluginApp:
        app = await start_with_fleet(engine_count, ready=ready, **fleet_options)
        self.made.append(app)
        return app

    async def bare(self, engine_client: Any) -> PluginApp:
        app = await start_plugin_app(engine_client)
        self.made.append(app)
        return app

    async def close(self) -> None:
        for app in reversed(self.made):
            await app.stop()
