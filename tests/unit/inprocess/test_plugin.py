"""vLLM's endpoint plugin (``exporter.inprocess.plugin``): vLLM calls its two hooks while it
builds its app, and has no shutdown hook for plugins, so the routes must be registered on the
app, the start handed to the runtime, and the stop tied to the app's own lifespan."""

from __future__ import annotations

import contextlib
from argparse import Namespace
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute

from exporter.control.actions import ACTIONS
from exporter.inprocess.plugin import PLUGIN_NAME, DpExporterPlugin, vllm_metrics_renderer
from exporter.inprocess.runtime import InProcessRuntime


class RecordingRuntime(InProcessRuntime):
    """The runtime's two hooks, recorded instead of run."""

    def __init__(self) -> None:
        super().__init__(environ={})
        self.events: list[Any] = []

    async def start(self, engine_client: Any, args: Namespace | None) -> None:
        self.events.append(("start", engine_client, args))

    async def stop(self) -> None:
        self.events.append("stop")


def test_the_plugin_is_named_as_vllms_allow_list_names_it() -> None:
    plugin = DpExporterPlugin()
    assert plugin.name == PLUGIN_NAME == "dp_exporter"
    assert plugin.required_tasks is None  # every server with engines
    assert isinstance(plugin.runtime, InProcessRuntime)


def test_attach_router_registers_every_route_on_vllms_app() -> None:
    app = FastAPI()
    DpExporterPlugin(RecordingRuntime()).attach_router(app)
    paths = {r.path for r in app.routes if isinstance(r, APIRoute)}
    assert {"/metrics", "/dp/status", "/dp/", "/dp/gate", "/dp/readyz"} <= paths
    assert {f"/dp/admin/{name}" for name in ACTIONS} <= paths


async def test_init_state_starts_the_runtime_with_vllms_client_and_args() -> None:
    runtime = RecordingRuntime()
    client, args = object(), Namespace(api_server_count=2)
    await DpExporterPlugin(runtime).init_state(client, object(), args)
    assert runtime.events == [("start", client, args)]


async def test_the_exporter_stops_when_vllms_lifespan_ends() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def vllm_lifespan(app: Any) -> AsyncIterator[dict[str, str]]:
        events.append("vllm up")
        yield {"state": "vllm's"}
        events.append("vllm down")

    app = FastAPI(lifespan=vllm_lifespan)
    runtime = RecordingRuntime()
    DpExporterPlugin(runtime).attach_router(app)
    async with app.router.lifespan_context(app) as state:
        assert state == {"state": "vllm's"}  # vLLM's own state passes through
        assert runtime.events == []
    assert events == ["vllm up", "vllm down"]
    assert runtime.events == ["stop"]


async def test_the_exporter_stops_even_when_vllms_lifespan_fails() -> None:
    app = FastAPI()
    runtime = RecordingRuntime()
    DpExporterPlugin(runtime).attach_router(app)
    with pytest.raises(RuntimeError):
        async with app.router.lifespan_context(app):
            raise RuntimeError("vLLM failed while serving")
    assert runtime.events == ["stop"]


def test_vllms_series_come_from_its_registry_or_the_multiprocess_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from prometheus_client import REGISTRY, Counter

    counter = Counter("dp_plugin_test_requests", "a series of vLLM's", registry=REGISTRY)
    try:
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
        render = vllm_metrics_renderer()
        assert b"dp_plugin_test_requests_total 0.0" in render()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
        assert b"dp_plugin_test_requests" not in render()  # the files' series, not this one's
    finally:
        REGISTRY.unregister(counter)
