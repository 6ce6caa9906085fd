"""One started ``FleetClient`` of every kind, over three engines, with the faults a test needs.

``start_kind(name, ...)`` (here; the kinds themselves in ``fleet_kinds_zmq`` and
``fleet_kinds_http``, what they share in ``fleet_kind_base``) builds the client through the
composition root (``exporter.control.attach.build_fleet``) where the mode has a configuration,
starts it over three simulated engines on 127.0.0.1 (the fake: none, it is the socket-free
reference) and returns a ``FleetKind``: the client, its labels, what the mode documents about
itself, and hooks that make engine ``i`` hang, answer late, fail, shut down, die, answer a long
string or lack a method, and that give it requests (``give_work``: they run for their duration
on the engine's simulated scheduler, queued while it is paused) or make its ``has_work`` answer
hostile. A kind that cannot produce a fault raises ``pytest.skip`` with the reason, never a
silent pass. ``serve_kind`` serves the exporter (``create_app`` and the admin app) over a
started kind's client on real HTTP.

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from exporter.client.fake import FakeFleet
from exporter.client.fleet import (
    Capabilities,
    EngineOutcome,
    FleetClient,
    Outcome,
)
from exporter.control.runtime import Exporter
from exporter.sim.state import EngineState
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.web.app import create_app
from tests.harness.fleet_kind_base import DEFAULT_ANSWERS, WAIT_S
from tests.harness.fleet_kind_base import ENGINE_STRINGS as ENGINE_STRINGS  # the tests'
from tests.harness.fleet_kind_base import ENGINES as ENGINES  # the tests'
from tests.harness.fleet_kind_base import EVERY_READ_METHOD as EVERY_READ_METHOD  # the tests'
from tests.harness.fleet_kind_base import KINDS as KINDS  # the tests'
from tests.harness.fleet_kind_base import FleetKind as FleetKind  # the tests'
from tests.harness.fleet_kinds_http import start_http, start_http_plugin
from tests.harness.fleet_kinds_zmq import start_inprocess, start_owner, start_relay
from tests.harness.scrape import Families, parse_metrics
from tests.harness.service import fresh_poll, serve_config


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

    async def slow(self, i: int, delay_s: float) -> None:
        pytest.skip("FakeFleet's handler answers synchronously: no answer can come late")

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

    def answered(self, i: int) -> int:
        return self.sent_to(i)  # the handler answers each call as it is made

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
