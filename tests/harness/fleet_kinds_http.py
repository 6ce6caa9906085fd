"""The conformance kinds over simulated API servers: HTTP mode over dev routes, and over
plugin-enabled servers (``/dp``)."""

from __future__ import annotations

import asyncio
from argparse import Namespace
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exporter.base.faults import ProtocolErrorTally
from exporter.client.fleet import DEFAULT_ALLOWED_METHODS, Capabilities, Outcome
from exporter.client.http.client import HttpFleetClient
from exporter.client.http.plugin_read import PLUGIN_SHARE_S
from exporter.client.http.routes import ROUTED_METHODS
from exporter.client.http.target import PluginTargetState
from exporter.control.attach import build_fleet
from exporter.inprocess.plugin import DpExporterPlugin
from exporter.sim.options import SimReply
from exporter.sim.state import EngineState
from tests.harness.apiservers import ApiServer, ApiServers, http_config
from tests.harness.fleet_kind_base import (
    ENGINES,
    PLUGIN_CALL_TIMEOUT,
    SIDE_PATHS,
    WAIT_S,
    FleetKind,
    engine_fault,
    has_work_fault,
)
from tests.harness.fleet_kinds_zmq import front_end_sees_death, start_coordinator
from tests.harness.inprocess import SimVllm, start_sim_vllm_fleet
from tests.harness.plugin_app import (
    PluginApp,
    add_fault_tolerance_route,
    plugin_env,
    serve,
    server_url,
)
from tests.harness.waiting import eventually

#: HTTP mode asks the allow-listed methods that have a route (``is_inference_ready`` has none).
HTTP_METHODS = DEFAULT_ALLOWED_METHODS & ROUTED_METHODS


class HttpKind(FleetKind):
    """Three simulated API servers of one engine each: target i is engine i."""

    servers: list[ApiServer]
    down: set[int]

    @property
    def http(self) -> HttpFleetClient:
        assert isinstance(self.client, HttpFleetClient)
        return self.client

    async def hang(self, i: int) -> None:
        self.servers[i].sim.engine_options[0].hang = True

    async def slow(self, i: int, delay_s: float) -> None:
        self.servers[i].sim.engine_options[0].reply_delay_s = delay_s

    async def recover(self, i: int) -> None:
        self.servers[i].sim.engine_options[0].hang = False

    async def fail(self, i: int, text: str) -> None:
        self.servers[i].sim.options.failures[0] = text

    async def shut_down(self, i: int) -> None:
        pytest.skip(
            "the simulated API server has no shutdown window (and vLLM's server answers "
            '"Server shutting down" only inside its own error envelope)'
        )

    async def disconnect(self, i: int) -> None:
        self.down.add(i)
        await asyncio.wait_for(self.servers[i].runner.cleanup(), WAIT_S)

    async def answer_long(self, i: int, text: str) -> None:
        self.servers[i].sim.engines[0].weight_version = text

    async def lack(self, i: int, method: str) -> None:
        if method == "has_work":  # read from GET /metrics: vLLM with --disable-log-stats
            self.servers[i].sim.options.log_stats = False
            return
        state = self.servers[i].sim.engines[0]
        state.missing_methods = state.missing_methods | {method}

    def work_state(self, i: int) -> EngineState:
        return self.servers[i].sim.engines[0]

    async def answer_has_work(self, i: int, value: Any) -> None:
        """HTTP mode reads ``has_work`` from ``GET /metrics``: the server publishes counts of
        engine ``i``'s rank that are not counts (what a wrong-typed answer is there)."""
        sim = self.servers[i].sim
        rank = sim.options.story_offset
        sample = HOSTILE_SAMPLES.get(type(value), "-1")
        sim.metrics_answer = (
            f'vllm:num_requests_running{{engine="{rank}",model_name="sim"}} {sample}\n'
            f'vllm:num_requests_waiting{{engine="{rank}",model_name="sim"}} 0.0\n'
        ).encode()

    async def fail_has_work(self, i: int, text: str) -> None:
        pytest.skip(
            "HTTP mode reads has_work from GET /metrics, which vLLM's API server answers "
            "without calling an engine: an engine's failure cannot reach it (answer_has_work "
            "and lack cover /metrics' own faults)"
        )

    def _calls(self, i: int) -> int:
        return sum(1 for _, path, _ in self.servers[i].sim.requests if path not in SIDE_PATHS)

    def requests(self) -> int:
        return sum(self._calls(i) for i in range(ENGINES))

    def sent_to(self, i: int) -> int:
        return self._calls(i)

    def answered(self, i: int) -> int:
        answered = self.servers[i].sim.answered
        return sum(n for path, n in answered.items() if path not in SIDE_PATHS)

    def pending(self) -> int:
        return http_pending(self.http)


#: The ``/metrics`` sample text standing for a hostile ``has_work`` answer of each type.
HOSTILE_SAMPLES: dict[type, str] = {str: "yes", int: "-1", type(None): "NaN", list: "1e300"}


def http_pending(client: HttpFleetClient) -> int:
    """HTTP mode's work still running: its background reads (version, fault status) and any
    plugin target's gate read (shared by calls, so not the caller's to cancel)."""
    samples = [
        s.sample
        for s in client._states
        if isinstance(s, PluginTargetState) and s.sample is not None
    ]
    return len(client._background) + sum(1 for task in samples if not task.done())


async def _settled(client: HttpFleetClient) -> None:
    """Wait (bounded) until the background reads of a first call are done."""
    await eventually(lambda: not client._background, WAIT_S, "HTTP mode's background reads")


async def start_http() -> HttpKind:
    servers = ApiServers()
    started = [await servers.start(engines=1) for _ in range(ENGINES)]
    client = build_fleet(http_config([s.url for s in started]), ProtocolErrorTally())
    assert isinstance(client, HttpFleetClient)
    kind = HttpKind(
        "http",
        client,
        Capabilities(
            fault_status=True,
            request_counts=True,
            methods=HTTP_METHODS,
            calls_per_engine=False,
        ),
        flags_shutting_down=False,
        failure_text_as_sent=False,
    )
    kind.servers, kind.down = started, set()

    async def stop_servers() -> None:
        for i, server in enumerate(started):
            if i not in kind.down:
                await asyncio.wait_for(server.runner.cleanup(), 5)

    kind._cleanups.append(stop_servers)
    try:
        await client.start()
        first = await client.call_utility("is_sleeping", timeout_s=WAIT_S)
        assert [o.outcome for o in first] == [Outcome.OK] * ENGINES, first
        await _settled(client)
    except BaseException:
        await kind.stop()
        raise
    return kind


# -- HTTP mode over a plugin-enabled server ----------------------------------------------------


@dataclass
class RecordedPluginApp:
    """The plugin's app (``PluginApp``), every request path it received (``paths``) and the
    path of every request it answered, once the answer's last byte was handed to the server
    (``answered``)."""

    app: PluginApp
    paths: list[str]
    answered: list[str]


class Recorder:
    """ASGI middleware: each HTTP request's path as it arrives, and again once its answer is
    sent (the last ``http.response.body`` message passed on to the server)."""

    def __init__(self, app: ASGIApp, paths: list[str], answered: list[str]) -> None:
        self.app, self.paths, self.answered = app, paths, answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        self.paths.append(path)

        async def sending(message: Message) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.answered.append(path)

        await self.app(scope, receive, sending)


async def start_recorded_plugin_app(fleet: SimVllm) -> RecordedPluginApp:
    """``tests.harness.plugin_app.start_plugin_app`` in vLLM's order (``attach_router``,
    ``init_state``, then uvicorn), with a middleware recording every request's path, and
    again once it is answered."""
    app = FastAPI()
    paths: list[str] = []
    answered: list[str] = []
    app.add_middleware(Recorder, paths=paths, answered=answered)
    add_fault_tolerance_route(app, fleet.llm)
    plugin = DpExporterPlugin()
    plugin.attach_router(app)
    await plugin.init_state(fleet.llm, app.state, Namespace())
    server, task = await serve(app)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
    plugin_app = PluginApp(app, plugin, server, task, server_url(server), session, fleet)
    return RecordedPluginApp(plugin_app, paths, answered)


class HttpPluginKind(FleetKind):
    """One plugin-enabled server (target ``a``) over three engines: ``a/0``..``a/2``."""

    recorded: RecordedPluginApp
    sim: SimVllm

    @property
    def http(self) -> HttpFleetClient:
        assert isinstance(self.client, HttpFleetClient)
        return self.client

    async def _fresh(self) -> None:
        """The next call asks the server again (a gate answer serves the read methods of
        calls started within ``PLUGIN_SHARE_S``)."""
        await asyncio.sleep(PLUGIN_SHARE_S * 1.5)

    async def hang(self, i: int) -> None:
        self.sim.engines[i].options.hang = True
        await self._fresh()

    async def slow(self, i: int, delay_s: float) -> None:
        """Not followed by ``_fresh``: a test of late answers sets the time itself."""
        self.sim.engines[i].options.reply_delay_s = delay_s

    async def recover(self, i: int) -> None:
        self.sim.engines[i].options.hang = False
        await self._fresh()

    async def freeze(self, i: int) -> None:
        self.sim.engines[i].options.frozen = True
        await self._fresh()

    async def thaw(self, i: int) -> None:
        self.sim.engines[i].options.frozen = False
        await self._fresh()

    async def fail(self, i: int, text: str) -> None:
        engine_fault(self.sim.engines[i], SimReply(failure=text))
        await self._fresh()

    async def shut_down(self, i: int) -> None:
        engine = self.sim.engines[i]
        engine.options.shutdown_window_s = 30.0
        engine.stop()
        await self._fresh()

    async def disconnect(self, i: int) -> None:
        await self.sim.stop_engine(i)
        await front_end_sees_death(self.sim, i)
        await self._fresh()

    async def answer_long(self, i: int, text: str) -> None:
        self.sim.engines[i].state.weight_version = text
        await self._fresh()

    async def lack(self, i: int, method: str) -> None:
        state = self.sim.engines[i].state
        state.missing_methods = state.missing_methods | {method}
        await self._fresh()

    def work_state(self, i: int) -> EngineState:
        return self.sim.engines[i].state

    async def answer_has_work(self, i: int, value: Any) -> None:
        has_work_fault(self.sim.engines[i], SimReply(value=value))
        await self._fresh()

    async def fail_has_work(self, i: int, text: str) -> None:
        has_work_fault(self.sim.engines[i], SimReply(failure=text))
        await self._fresh()

    def requests(self) -> int:
        return sum(1 for path in self.recorded.paths if path not in SIDE_PATHS)

    def sent_to(self, i: int) -> int:
        pytest.skip(
            "a plugin-enabled server is asked once per call (GET /dp/gate) for all its engines, "
            "and the plugin's own poller calls them too: requests per engine are not the client's"
        )

    def asked(self, i: int) -> int:
        return self.requests()  # one gate request asks every engine of the server

    def answered(self, i: int) -> int:
        return sum(1 for path in self.recorded.answered if path not in SIDE_PATHS)

    def pending(self) -> int:
        return http_pending(self.http)


async def start_http_plugin(monkeypatch: pytest.MonkeyPatch) -> HttpPluginKind:
    plugin_env(monkeypatch, CALL_TIMEOUT=PLUGIN_CALL_TIMEOUT, GATE_MIN_INTERVAL="0")
    sim = await start_sim_vllm_fleet(ENGINES)
    start_coordinator(sim)
    try:
        recorded = await start_recorded_plugin_app(sim)
    except BaseException:
        await sim.stop()
        raise
    app = recorded.app
    client = build_fleet(http_config([f"a={app.url}/dp"]), ProtocolErrorTally())
    assert isinstance(client, HttpFleetClient)
    kind = HttpPluginKind(
        "http_plugin",
        client,
        Capabilities(
            fault_status=True,
            request_counts=True,
            methods=HTTP_METHODS,
            calls_per_engine=False,
        ),
        death_takes_all=True,
        flags_shutting_down=False,
        failure_text_as_sent=False,
    )
    kind.recorded, kind.sim = recorded, sim
    kind._cleanups.append(app.stop)  # the server, then the simulated vLLM
    try:
        exporter = app.runtime.exporter
        assert exporter is not None
        await eventually(lambda: exporter.poller.snapshot.ready, WAIT_S, "the plugin's fleet")
        await client.start()
        # The first answer names the server's engines (before it, the target is one engine).
        first = await client.call_utility("is_sleeping", timeout_s=WAIT_S)
        assert [o.outcome for o in first] == [Outcome.OK] * ENGINES, first
        assert client.engine_labels == [f"a/{i}" for i in range(ENGINES)]
        await _settled(client)
        await kind._fresh()
    except BaseException:
        await kind.stop()
        raise
    return kind
