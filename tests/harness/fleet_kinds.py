"""One started ``FleetClient`` of every kind, over three engines, with the faults a test needs.

``start_kind(name, ...)`` builds the client through the composition root
(``exporter.control.attach.build_fleet``) where the mode has a configuration, starts it over
three simulated engines on 127.0.0.1 (the fake: none, it is the socket-free reference) and
returns a ``FleetKind``: the client, its labels, what the mode documents about itself, and
hooks that make engine ``i`` hang, fail, shut down, die, answer a long string or lack a method,
and that give it requests (``give_work``: they run for their duration on the engine's simulated
scheduler, queued while it is paused) or make its ``has_work`` answer hostile. A kind that
cannot produce a fault raises ``pytest.skip`` with the reason, never a silent pass.
``serve_kind`` serves the exporter (``create_app`` and the admin app) over a started kind's
client on real HTTP.

Kinds (``KINDS``):

* ``fake``: ``FakeFleet`` over a handler (faults are the handler's answers; nothing can hang);
* ``owner``: owner mode over ``RecordingSimEngine``s;
* ``relay``: relay mode beside a simulated stock front end (its call loop off, so every
  request an engine reads is the exporter's) and DP coordinator (publishing each engine's
  requests);
* ``http``: HTTP mode over three simulated API servers of one engine each;
* ``http_plugin``: HTTP mode over one plugin-enabled server (a target URL ending in ``/dp``)
  whose three engines are ``a/0``..``a/2``; its HTTP requests are recorded by a middleware;
* ``inprocess``: in-process mode over the simulated ``AsyncLLM``, its DP coordinator simulated
  (``SimEngineCore.start_coordinator``: the front end's load-balancing counts follow the engines'
  requests).

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from argparse import Namespace
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from aiohttp import web
from fastapi import FastAPI, Request, Response

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fake import FakeFleet
from exporter.client.fleet import (
    Capabilities,
    EngineOutcome,
    FleetClient,
    Outcome,
)
from exporter.client.http.client import HttpFleetClient
from exporter.client.http.plugin_read import PLUGIN_SHARE_S
from exporter.client.http.target import PluginTargetState
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore, is_engine_dead_error
from exporter.control.attach import build_fleet
from exporter.control.runtime import Exporter
from exporter.inprocess.plugin import DpExporterPlugin
from exporter.inprocess.trainer import inprocess_config
from exporter.sim.options import SimOptions, SimReply
from exporter.sim.state import EngineState
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.web.app import create_app
from tests.harness.apiservers import ApiServer, ApiServers, http_config
from tests.harness.inprocess import SimVllm, start_sim_vllm_fleet
from tests.harness.plugin_app import (
    PluginApp,
    add_fault_tolerance_route,
    plugin_env,
    serve,
    server_url,
)
from tests.harness.relay import RelayHarness
from tests.harness.scrape import Families, parse_metrics
from tests.harness.service import RecordingSimEngine, fresh_poll, make_config, serve_config
from tests.harness.waiting import eventually

ENGINES = 3
WAIT_S = 10.0
#: The plugin's own call timeout: its gate answers a hung engine within it, well inside the
#: deadlines the suite gives the sidecar's calls.
PLUGIN_CALL_TIMEOUT = "0.3"
#: Paths a server answers that are not a utility call (the version and fault-status reads
#: HTTP mode makes beside its calls).
SIDE_PATHS = ("/version", "/fault_tolerance/status", "/v1/fault_tolerance/status")
KINDS = ("fake", "owner", "relay", "http", "http_plugin", "inprocess")
#: Promises a kind may break today (``FleetKind.known_gaps``).
ENGINE_STRINGS = "engine strings are cut where a reply is decoded"
EVERY_READ_METHOD = "every read method is answered"
#: What the fake's engines answer by default (a fresh simulated engine's answers).
DEFAULT_ANSWERS: dict[str, Any] = {
    "is_sleeping": False,
    "is_scheduler_paused": False,
    "get_weight_version": None,
    "has_work": False,
    "reset_prefix_cache": True,
}


def _engine_fault(engine: RecordingSimEngine, reply: SimReply) -> None:
    """Engine answers every request with ``reply`` from now on (recorded first)."""
    engine._then = lambda _c, _i, _m, _a: reply


def _has_work_fault(engine: RecordingSimEngine, reply: SimReply) -> None:
    """Engine answers ``has_work`` with ``reply`` from now on; everything else as before."""
    engine._then = lambda _c, _i, method, _a: reply if method == "has_work" else None


def _finish(state: EngineState) -> None:
    """Every request of ``state`` is done (their clients got their answers)."""
    state.work.running.clear()
    state.work.waiting.clear()


@dataclass
class FleetKind:
    """A started client of one kind over ``ENGINES`` engines, and what a test may do to them.

    What the mode documents, as data: ``capabilities`` and ``counter_families`` (its own
    series), ``death_takes_all`` (vLLM's front end fails as a whole when one engine dies:
    in-process mode and a plugin-enabled server), ``flags_shutting_down`` (a "Server shutting
    down" failure is marked ``shutting_down``). ``known_gaps``: promise → why this kind breaks
    it today (a product bug the suite reports; those tests are strict xfails for this kind)."""

    name: str
    client: FleetClient
    capabilities: Capabilities
    counter_families: frozenset[str] = frozenset()
    death_takes_all: bool = False
    flags_shutting_down: bool = True
    #: A failure's text is the outcome's error as the engine sent it (HTTP mode: inside the
    #: server's or the gate's own wording).
    failure_text_as_sent: bool = True
    known_gaps: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    _cleanups: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    @property
    def labels(self) -> list[str]:
        return self.client.engine_labels

    # -- faults of engine i (overridden per kind) -------------------------------------------

    async def hang(self, i: int) -> None:
        """Engine ``i`` reads requests and never answers."""
        raise NotImplementedError

    async def recover(self, i: int) -> None:
        """Engine ``i``, hung, answers again (the calls it read meanwhile stay unanswered)."""
        raise NotImplementedError

    async def freeze(self, i: int) -> None:
        """Engine ``i`` stops as a process stopped with SIGSTOP: nothing it is sent is read."""
        await self.hang(i)

    async def thaw(self, i: int) -> None:
        """Engine ``i`` runs again (SIGCONT) and answers what waited, in order."""
        await self.recover(i)

    async def fail(self, i: int, text: str) -> None:
        """Engine ``i`` answers every call with the failure ``text``."""
        raise NotImplementedError

    async def shut_down(self, i: int) -> None:
        """Engine ``i`` is between SIGTERM and exit: its calls fail "Server shutting down"."""
        raise NotImplementedError

    async def disconnect(self, i: int) -> None:
        """Engine ``i`` is gone; returns once the client can know it (bounded)."""
        raise NotImplementedError

    async def answer_long(self, i: int, text: str) -> None:
        """Engine ``i`` answers ``get_weight_version`` with ``text``."""
        raise NotImplementedError

    async def lack(self, i: int, method: str) -> None:
        """Engine ``i`` has no ``method`` (an older vLLM)."""
        raise NotImplementedError

    # -- the work of engine i --------------------------------------------------------------

    def work_state(self, i: int) -> EngineState:
        """Engine ``i``'s simulated state, its requests included (``EngineState.work``)."""
        raise NotImplementedError

    async def _fresh(self) -> None:
        """Wait until the client's next call asks the engines again (only where answers are
        shared for a while: a plugin-enabled server)."""

    async def give_work(self, i: int, duration_s: float, count: int = 1) -> None:
        """``count`` requests of ``duration_s`` seconds arrive at engine ``i`` (queued while its
        scheduler is paused; its ``has_work`` is true until they are done)."""
        self.work_state(i).submit(duration_s, time.monotonic(), count)
        await self._fresh()

    async def finish_work(self, i: int) -> None:
        """Engine ``i``'s requests are all done."""
        _finish(self.work_state(i))
        await self._fresh()

    def counts(self, i: int) -> tuple[int, int]:
        """Engine ``i``'s (running, waiting) requests now."""
        return self.work_state(i).request_counts(time.monotonic())

    def paused(self, i: int) -> bool:
        """Whether engine ``i``'s scheduler is paused."""
        return self.work_state(i).paused

    async def answer_has_work(self, i: int, value: Any) -> None:
        """Engine ``i`` answers ``has_work`` with ``value`` (a hostile one: not a boolean)."""
        raise NotImplementedError

    async def fail_has_work(self, i: int, text: str) -> None:
        """Engine ``i``'s ``has_work`` fails with ``text``; its other calls are answered."""
        raise NotImplementedError

    # -- what reached the engines -----------------------------------------------------------

    def requests(self) -> int:
        """Utility requests from this client that reached the far side so far."""
        raise NotImplementedError

    def sent_to(self, i: int) -> int:
        """Utility requests from this client that engine ``i`` read so far."""
        raise NotImplementedError

    def asked(self, i: int) -> int:
        """Requests from this client that reached engine ``i``'s side (its own reads, or its
        server's): what a test waits on before acting on a call in flight."""
        return self.sent_to(i)

    def pending(self) -> int:
        """Calls this client still has in flight (bookkeeping a closed client must not keep)."""
        raise NotImplementedError

    # -- life cycle -------------------------------------------------------------------------

    async def close_client(self) -> None:
        if not self.closed:
            self.closed = True
            await self.client.close()

    async def stop(self) -> None:
        """The client, then whatever it was attached to (every step bounded)."""
        await asyncio.wait_for(self.close_client(), WAIT_S)
        for cleanup in reversed(self._cleanups):
            await asyncio.wait_for(cleanup(), 15)


# -- the fake ----------------------------------------------------------------------------------


class FakeKind(FleetKind):
    """``FakeFleet``: a handler answers; faults are what the handler answers."""

    fleet: FakeFleet
    scripted: dict[str, Callable[[str, str], Any]]
    states: list[EngineState]

    def work_state(self, i: int) -> EngineState:
        return self.states[i]

    async def answer_has_work(self, i: int, value: Any) -> None:
        self.scripted[self.labels[i]] = lambda _l, m: (
            value if m == "has_work" else DEFAULT_ANSWERS.get(m)
        )

    async def fail_has_work(self, i: int, text: str) -> None:
        def failing(label: str, method: str) -> Any:
            if method != "has_work":
                return DEFAULT_ANSWERS.get(method)
            return EngineOutcome(label, Outcome.FAILED, error=text, duration_s=0.001)

        self.scripted[self.labels[i]] = failing

    async def hang(self, i: int) -> None:
        pytest.skip("FakeFleet's handler answers synchronously: no call can hang or be in flight")

    async def fail(self, i: int, text: str) -> None:
        self.scripted[self.labels[i]] = lambda label, _m: EngineOutcome(
            label, Outcome.FAILED, error=text, duration_s=0.001
        )

    async def shut_down(self, i: int) -> None:
        pytest.skip(
            "FakeFleet returns the handler's outcome as it is: the shutting_down flag would be "
            "the test's own script"
        )

    async def disconnect(self, i: int) -> None:
        self.fleet.disconnected.add(self.labels[i])

    async def answer_long(self, i: int, text: str) -> None:
        self.scripted[self.labels[i]] = lambda _l, m: text if m == "get_weight_version" else False

    async def lack(self, i: int, method: str) -> None:
        def lacking(label: str, called: str) -> Any:
            if called != method:
                return False
            error = f"Call to {called} method failed: 'EngineCoreProc' object has no attribute"
            return EngineOutcome(label, Outcome.FAILED, error=error, duration_s=0.001)

        self.scripted[self.labels[i]] = lacking

    def requests(self) -> int:
        return len(self.fleet.calls)

    def sent_to(self, i: int) -> int:
        return sum(1 for engine, _, _ in self.fleet.calls if engine == self.labels[i])

    def pending(self) -> int:
        return 0


async def start_fake() -> FakeKind:
    scripted: dict[str, Callable[[str, str], Any]] = {}
    # Each engine's requests (has_work); the fake's engines have no scheduler to pause.
    states = [EngineState() for _ in range(ENGINES)]

    def handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
        answer = scripted.get(engine)
        if answer is not None:
            return answer(engine, method)
        if method == "has_work":
            return states[int(engine)].call(method, now=time.monotonic())
        return DEFAULT_ANSWERS.get(method)

    fleet = FakeFleet(handler, engines=tuple(str(i) for i in range(ENGINES)))
    await fleet.start()
    kind = FakeKind("fake", fleet, Capabilities(fault_status=True))
    kind.fleet, kind.scripted, kind.states = fleet, scripted, states
    return kind


# -- the ZMQ-engine kinds (owner, relay, in-process) -------------------------------------------


class SimEngineKind(FleetKind):
    """Faults of simulated engines on real ZMQ (owner, relay and in-process mode)."""

    engines: list[RecordingSimEngine]
    tasks: list[asyncio.Task[str]]

    def _state(self, i: int) -> EngineState:
        return self.engines[i].state

    def work_state(self, i: int) -> EngineState:
        return self.engines[i].state

    async def answer_has_work(self, i: int, value: Any) -> None:
        _has_work_fault(self.engines[i], SimReply(value=value))

    async def fail_has_work(self, i: int, text: str) -> None:
        _has_work_fault(self.engines[i], SimReply(failure=text))

    async def hang(self, i: int) -> None:
        self.engines[i].options.hang = True

    async def recover(self, i: int) -> None:
        self.engines[i].options.hang = False

    async def freeze(self, i: int) -> None:
        self.engines[i].options.frozen = True

    async def thaw(self, i: int) -> None:
        self.engines[i].options.frozen = False

    async def fail(self, i: int, text: str) -> None:
        _engine_fault(self.engines[i], SimReply(failure=text))

    async def shut_down(self, i: int) -> None:
        engine = self.engines[i]
        engine.options.shutdown_window_s = 30.0  # the teardown cancels it long before
        engine.stop()

    async def disconnect(self, i: int) -> None:
        engine = self.engines[i]
        engine.options.shutdown_window_s = 0.0
        engine.stop()
        await asyncio.wait_for(asyncio.gather(self.tasks[i], return_exceptions=True), WAIT_S)
        await self._wait_gone(i)

    async def _wait_gone(self, i: int) -> None:
        await eventually(
            lambda: self.client.connected_count() == ENGINES - 1,
            WAIT_S,
            f"the client to see engine {i} gone",
        )

    async def answer_long(self, i: int, text: str) -> None:
        self._state(i).weight_version = text

    async def lack(self, i: int, method: str) -> None:
        state = self._state(i)
        state.missing_methods = state.missing_methods | {method}

    def requests(self) -> int:
        return sum(e.calls for e in self.engines)

    def sent_to(self, i: int) -> int:
        return self.engines[i].calls

    def pending(self) -> int:
        assert isinstance(self.client, EngineCoreClient)
        return self.client.pending_count

    async def stop_engines(self) -> None:
        """Every engine out, at once: no shutdown window waited for."""
        for engine, task in zip(self.engines, self.tasks, strict=True):
            if engine.shutting_down or not engine.connected.is_set():
                task.cancel()
            else:
                engine.options.shutdown_window_s = 0.0
                engine.stop()
        await asyncio.wait(self.tasks, timeout=2.0)
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _recording_engines(
    address: str, context: zmq.asyncio.Context
) -> tuple[list[RecordingSimEngine], list[asyncio.Task[str]]]:
    engines = [
        RecordingSimEngine(address, i, SimOptions(), context=context) for i in range(ENGINES)
    ]
    return engines, [asyncio.create_task(e.run()) for e in engines]


async def start_owner() -> SimEngineKind:
    config = make_config(ENGINES)
    client = build_fleet(config, ProtocolErrorTally())
    kind = SimEngineKind(
        "owner",
        client,
        Capabilities(fault_status=True, handshakes=True),
        frozenset({"vllm_dp_state_file_writes_total"}),
    )
    context = zmq.asyncio.Context()

    async def stop_context() -> None:
        await kind.stop_engines()
        context.term()

    kind._cleanups.append(stop_context)
    try:
        await client.start()
        kind.engines, kind.tasks = _recording_engines(config.handshake_address, context)
        await eventually(lambda: client.connected_count() == ENGINES, WAIT_S, "3 handshakes")
    except BaseException:
        await kind.stop()
        raise
    return kind


class RelayKind(SimEngineKind):
    """Relay mode: the engines also handshook with ``harness``'s simulated front end."""

    harness: RelayHarness


async def start_relay(tmp_path: Path) -> RelayKind:
    harness = RelayHarness(ENGINES, tmp_path)
    engines: list[RecordingSimEngine] = []

    def published() -> list[Any]:
        """vLLM's DP coordinator (simulated beside the front end): each engine's requests."""
        now = time.monotonic()
        return [engine.state.request_counts(now) for engine in engines]

    await harness.start_frontend(call_loop=False, coordinator=published)
    try:
        relay = await harness.start_relay()
    except BaseException:
        await harness.close()
        raise
    kind = RelayKind(
        "relay",
        relay.client,
        Capabilities(
            fault_status=False, beside_a_front_end=True, handshakes=True, request_counts=True
        ),
        frozenset({"vllm_dp_relay_handshakes_total", "vllm_dp_state_file_writes_total"}),
    )
    kind.harness = harness
    context = zmq.asyncio.Context()

    async def stop_all() -> None:
        await kind.stop_engines()
        await harness.close()
        context.term()

    kind._cleanups.append(stop_all)
    try:
        kind.engines, kind.tasks = _recording_engines(harness.relay_address, context)
        engines.extend(kind.engines)
        await harness.wait_handshakes(WAIT_S)
    except BaseException:
        await kind.stop()
        raise
    return kind


async def front_end_sees_death(sim: SimVllm, i: int) -> None:
    """vLLM's front end learns that engine ``i`` is gone (the simulated one learns it from a
    call, as vLLM's own client would from its engine monitor) and fails as a whole: every
    engine is disconnected from then on."""
    if not sim.core.resources.engine_dead:
        try:
            await sim.direct_call("is_sleeping", i)
        except Exception as exc:  # vLLM's EngineDeadError, known by its name
            assert is_engine_dead_error(exc), repr(exc)
        else:
            raise AssertionError(f"engine {i} answered after it stopped")
    assert sim.core.resources.engine_dead


class InProcessKind(SimEngineKind):
    sim: SimVllm

    @property
    def inprocess(self) -> InProcessFleetClient:
        assert isinstance(self.client, InProcessFleetClient)
        return self.client

    async def _wait_gone(self, i: int) -> None:
        await front_end_sees_death(self.sim, i)

    def pending(self) -> int:
        return sum(self.inprocess.in_flight.values())


def start_coordinator(sim: SimVllm) -> None:
    """vLLM's DP coordinator (simulated): the front end's load-balancing counts follow each
    engine's requests (in-process mode reads them)."""
    engines = sim.engines
    sim.core.start_coordinator(lambda r: engines[r].state.request_counts(time.monotonic()))


async def start_inprocess() -> InProcessKind:
    sim = await start_sim_vllm_fleet(ENGINES)
    start_coordinator(sim)
    core = VllmCore(sim.core, vllm_version="0.33.0", enable_sleep_mode=True)
    client = build_fleet(inprocess_config(environ={}), ProtocolErrorTally(), vllm=core)
    assert isinstance(client, InProcessFleetClient)
    sim.clients.append(client)
    # The simulated vLLM keeps vLLM 0.33's table of fault-tolerance statuses (empty until
    # fault tolerance is on): the front end's copy, which this mode reads.
    kind = InProcessKind(
        "inprocess",
        client,
        Capabilities(fault_status=True, request_counts=True),
        death_takes_all=True,
    )
    kind.sim, kind.engines, kind.tasks = sim, sim.engines, sim.tasks
    kind._cleanups.append(sim.stop)
    await client.start()
    return kind


# -- HTTP mode over simulated API servers ------------------------------------------------------


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
        Capabilities(fault_status=True, request_counts=True),
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
    """The plugin's app (``PluginApp``) and every request path it received."""

    app: PluginApp
    paths: list[str]


async def start_recorded_plugin_app(fleet: SimVllm) -> RecordedPluginApp:
    """``tests.harness.plugin_app.start_plugin_app`` in vLLM's order (``attach_router``,
    ``init_state``, then uvicorn), with a middleware recording every request's path."""
    app = FastAPI()
    paths: list[str] = []

    @app.middleware("http")
    async def record(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Any:
        paths.append(request.url.path)
        return await call_next(request)

    add_fault_tolerance_route(app, fleet.llm)
    plugin = DpExporterPlugin()
    plugin.attach_router(app)
    await plugin.init_state(fleet.llm, app.state, Namespace())
    server, task = await serve(app)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=WAIT_S))
    plugin_app = PluginApp(app, plugin, server, task, server_url(server), session, fleet)
    return RecordedPluginApp(plugin_app, paths)


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
        _engine_fault(self.sim.engines[i], SimReply(failure=text))
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
        _has_work_fault(self.sim.engines[i], SimReply(value=value))
        await self._fresh()

    async def fail_has_work(self, i: int, text: str) -> None:
        _has_work_fault(self.sim.engines[i], SimReply(failure=text))
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
        Capabilities(fault_status=True, request_counts=True),
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


async def start_kind(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FleetKind:
    """The started kind ``name`` (one of ``KINDS``) over ``ENGINES`` engines, every engine
    connected and answering."""
    if name == "fake":
        return await start_fake()
    if name == "owner":
        return await start_owner()
    if name == "relay":
        return await start_relay(tmp_path)
    if name == "http":
        return await start_http()
    if name == "http_plugin":
        return await start_http_plugin(monkeypatch)
    if name == "inprocess":
        return await start_inprocess()
    raise ValueError(f"unknown fleet kind {name!r}")


# -- the exporter over a kind, on real HTTP ----------------------------------------------------


class _Started:
    """A kind's client as the exporter sees it: started and closed by the kind (twice would
    bind its sockets twice), everything else its own."""

    def __init__(self, client: FleetClient) -> None:
        self._client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


@dataclass
class ServedKind:
    """The exporter (``create_app``: /metrics, /status, /gate and its poller) over a started
    kind's client, and its admin app on a listener of its own; ``close`` stops both, never the
    kind (whose fixture stops it afterwards)."""

    kind: FleetKind
    exporter: Exporter
    runners: list[web.AppRunner]
    url: str
    admin_url: str
    session: aiohttp.ClientSession

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json()

    async def status(self) -> dict[str, Any]:
        code, body = await self.get_json("/status")
        assert code == 200, body
        result: dict[str, Any] = body
        return result

    async def scrape(self) -> Families:
        async with self.session.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            return parse_metrics(await resp.text())

    async def gate(self, query: str) -> tuple[int, dict[str, Any]]:
        code, body = await self.get_json(f"/gate?{query}")
        result: dict[str, Any] = body
        return code, result

    async def post(self, action: str, query: str = "") -> tuple[int, dict[str, Any]]:
        async with self.session.post(f"{self.admin_url}/admin/{action}?{query}") as resp:
            body: dict[str, Any] = await resp.json()
            return resp.status, body

    async def fresh_poll(self, timeout_s: float = WAIT_S) -> None:
        """A poll that started after this call is published (bounded)."""
        await fresh_poll(self.exporter.poller, timeout_s)

    async def close(self) -> None:
        await self.session.close()
        admin, main = self.runners
        await asyncio.wait_for(admin.app[ADMIN_SHUTDOWN_KEY](), WAIT_S)
        await asyncio.wait_for(admin.cleanup(), WAIT_S)
        await asyncio.wait_for(main.cleanup(), WAIT_S)


async def _serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def serve_kind(kind: FleetKind, **settings: Any) -> ServedKind:
    """The exporter over ``kind``'s client on 127.0.0.1 (fast polls, a gate that never reuses
    a sample, state changes allowed beside a front end), its first poll published."""
    values: dict[str, Any] = {
        "attach": "owner",  # the config's mode is not used: the client is the kind's
        "engine_count": ENGINES,
        "handshake_address": "tcp://127.0.0.1:1",
        "admin_listen": "off",
        "gate_min_interval": 0.0,
        "relay_allow_state_changes": True,
    }
    values.update(settings)
    config = serve_config(**values)
    exporter = Exporter(config, client=_Started(kind.client))
    main, url = await _serve_app(create_app(config, exporter))
    try:
        admin, admin_url = await _serve_app(create_admin_app(exporter, audit=lambda _r: None))
    except BaseException:
        await main.cleanup()
        raise
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
    served = ServedKind(kind, exporter, [admin, main], url, admin_url, session)
    await exporter.poller.wait_for_poll(0, WAIT_S)
    return served
