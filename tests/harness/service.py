"""The real exporter (``create_app(config)``) served over real HTTP, with in-process simulated
engines on real ZMQ sockets.

Everything binds 127.0.0.1 with ports chosen by the kernel (bind port 0). Each ``Service`` has its
own ``Exporter`` (no global registry), its own ZMQ context and its own HTTP servers, so tests are
independent under ``pytest -n 2``. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import zmq.asyncio
from aiohttp import web
from multidict import CIMultiDictProxy

from exporter.base.ports import free_listen_port
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import connected_count
from exporter.config.settings import ServeConfig, resolve_config
from exporter.control.poller import Poller
from exporter.control.runtime import Exporter
from exporter.sim.engine import SimEngine
from exporter.sim.frontend import SimFrontend
from exporter.sim.options import SimOptions, SimReply
from exporter.web.admin import ADMIN_SHUTDOWN_KEY, create_admin_app
from exporter.web.app import ADMIN_URL_KEY, create_app
from exporter.web.httpguard import guarded_runner
from tests.harness.scrape import Families, parse_metrics
from tests.harness.waiting import eventually

WAIT_S = 5.0  # upper bound of a service-level wait (polls, engine shutdown)
POLL_INTERVAL = 0.1
CALL_TIMEOUT = 0.4

Audit = Callable[[dict[str, Any]], None]


def serve_config(**settings: Any) -> ServeConfig:
    """A loopback config with fast polls; ``environ={}`` so the machine's env cannot leak in."""
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "poll_interval": POLL_INTERVAL,
        "call_timeout": CALL_TIMEOUT,
        "reset_min_interval": 0,
    }
    values.update(settings)
    return resolve_config(None, environ={}, **values)


def make_config(engine_count: int, **overrides: Any) -> ServeConfig:
    """Owner mode over ``engine_count`` engines on a fresh loopback handshake address."""
    settings: dict[str, Any] = {
        "attach": "owner",
        "engine_count": engine_count,
        "handshake_address": f"tcp://127.0.0.1:{free_listen_port()}",
    }
    settings.update(overrides)
    return serve_config(**settings)


class RecordingSimEngine(SimEngine):
    """A simulated engine that also remembers every utility call's method and arguments (through
    its ``on_request`` hook; a hook given to the constructor still runs after the recording)
    and every output frame it sent (``sent``: (client_index, frame), through ``on_output``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.received: list[tuple[str, list[Any]]] = []
        self.sent: list[tuple[int, bytes]] = []
        self._then = self.on_request
        self.on_request = self._record
        self.on_output = lambda client_index, frame: self.sent.append((client_index, frame))

    def sent_to(self, client_index: int) -> list[bytes]:
        """The output frames sent to one client slot, in order."""
        return [frame for slot, frame in self.sent if slot == client_index]

    def _record(
        self, client_index: int, call_id: int, method: str, args: list[Any]
    ) -> SimReply | None:
        self.received.append((method, list(args)))
        return self._then(client_index, call_id, method, args) if self._then else None

    def args_of(self, method: str) -> list[list[Any]]:
        return [args for m, args in self.received if m == method]


async def fresh_poll(poller: Poller, timeout_s: float = WAIT_S) -> None:
    """Ask ``poller`` for polls now (whatever the interval) and wait for one that started after
    this call: a poll may be running already, so two more completed polls guarantee it."""
    after = poller.snapshot.poll_number
    poller.poll_soon()
    await poller.wait_for_poll(after, timeout_s)
    poller.poll_soon()
    await poller.wait_for_poll(after + 1, timeout_s)


@dataclass
class Service:
    """``create_app(config)`` served on a kernel-chosen port, plus in-process engines."""

    config: ServeConfig
    exporter: Exporter
    app: web.Application
    runner: web.AppRunner
    url: str
    context: zmq.asyncio.Context
    session: aiohttp.ClientSession
    admin_url: str | None = None
    admin_runner: web.AppRunner | None = None
    engines: list[RecordingSimEngine] = field(default_factory=list)
    engine_tasks: list[asyncio.Task[str]] = field(default_factory=list)
    stopped: bool = False

    @property
    def client(self) -> EngineCoreClient:
        """The ZMQ fleet client (owner and relay mode)."""
        assert isinstance(self.exporter.client, EngineCoreClient)
        return self.exporter.client

    # -- engines ---------------------------------------------------------------------------

    async def start_engines(
        self,
        options: SimOptions | None = None,
        *,
        by_index: Mapping[int, SimOptions] | None = None,
        indices: Iterable[int] | None = None,
        **per_engine: Mapping[int, Any],
    ) -> None:
        """Start one simulated engine per index (default: every expected one) and wait for
        every handshake.

        ``options`` is the template for every engine, ``by_index`` replaces it for some, and
        ``per_engine`` sets single fields by index (``sleeping={1: True}``).
        """
        first = self.config.start_rank
        wanted = indices if indices is not None else range(first, first + self.config.engine_count)
        for index in wanted:
            chosen = (by_index or {}).get(index)
            opts = chosen if chosen is not None else replace(options or SimOptions())
            for name, by in per_engine.items():
                if index in by:
                    setattr(opts, name, by[index])
            engine = RecordingSimEngine(
                self.config.handshake_address, index, opts, context=self.context
            )
            self.engines.append(engine)
            self.engine_tasks.append(asyncio.create_task(engine.run()))
        await eventually(
            lambda: connected_count(self.exporter.client) >= len(self.engines),
            what="every engine's handshake",
        )

    async def stop_engines(self) -> None:
        for engine in self.engines:
            engine.options.shutdown_window_s = 0.0
            engine.stop()
        if self.engine_tasks:
            await asyncio.wait_for(
                asyncio.gather(*self.engine_tasks, return_exceptions=True), WAIT_S
            )
        self.engine_tasks.clear()

    # -- polling ---------------------------------------------------------------------------

    async def next_polls(self, count: int = 2) -> None:
        """Wait until ``count`` polls that started after this call have been published.

        The poll running now may have read the old state, so the default waits for two.
        """
        poller = self.exporter.poller
        for _ in range(count):
            await poller.wait_for_poll(poller.snapshot.poll_number, WAIT_S)

    async def fresh_poll(self, timeout_s: float = WAIT_S) -> None:
        await fresh_poll(self.exporter.poller, timeout_s)

    async def ready(self) -> None:
        await eventually(lambda: self.exporter.poller.snapshot.ready, what="a ready fleet")

    # -- HTTP ------------------------------------------------------------------------------

    async def metrics(self, **headers: str) -> str:
        """The text of one 200 scrape."""
        async with self.session.get(self.url + "/metrics", headers=headers) as resp:
            assert resp.status == 200
            return await resp.text()

    async def scrape(self, **headers: str) -> Families:
        return parse_metrics(await self.metrics(**headers))

    async def status(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/status") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json()

    async def reset(
        self,
        params: dict[str, str] | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], CIMultiDictProxy[str]]:
        """POST the admin reset; returns (status, JSON body, response headers)."""
        assert self.admin_url is not None
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        async with self.session.post(
            self.admin_url + "/admin/reset_prefix_cache", params=params or {}, headers=h
        ) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers

    # -- teardown --------------------------------------------------------------------------

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.session.close()
        await self.stop_engines()
        if self.admin_runner is not None:
            await self.admin_runner.app[ADMIN_SHUTDOWN_KEY]()
            await self.admin_runner.cleanup()
        await self.runner.cleanup()
        self.context.term()


async def _serve(app: web.Application, runner: web.AppRunner | None = None) -> web.AppRunner:
    runner = runner or web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


def _url(runner: web.AppRunner) -> str:
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


async def start_service(
    config: ServeConfig, *, guarded: bool = False, audit: Audit | None = None
) -> Service:
    """Serve ``create_app(config)``; engines are not started.

    ``guarded``: serve with ``exporter.web.httpguard.guarded_runner`` (as ``serve`` does).
    ``audit``: serve the admin app from the test with that audit sink
    (``create_admin_app(exporter, audit=...)``) instead of the server's own listener; the config
    should then say ``admin_listen="off"``.
    """
    exporter = Exporter(config)
    app = create_app(config, exporter)
    runner = await _serve(
        app,
        guarded_runner(app, access_log=None, shutdown_timeout=0.5) if guarded else None,
    )
    service = Service(
        config,
        exporter,
        app,
        runner,
        _url(runner),
        zmq.asyncio.Context(),
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)),
        admin_url=app.get(ADMIN_URL_KEY),
    )
    if audit is not None:
        service.admin_runner = await _serve(create_admin_app(exporter, audit=audit))
        service.admin_url = _url(service.admin_runner)
    return service


ServiceFactory = Callable[..., Awaitable[Service]]


class Services:
    """Builds services for one test and stops them all at its end (``close``).

    ``start``: whether ``build`` starts the engines (and waits for a ready fleet) by default.
    """

    def __init__(self, *, start: bool) -> None:
        self.start = start
        self.made: list[Service] = []

    async def serve(
        self,
        config: ServeConfig,
        *,
        first_poll: bool = True,
        guarded: bool = False,
        audit: Audit | None = None,
    ) -> Service:
        """``start_service(config)``; ``first_poll``: wait (bounded) for the first poll."""
        service = await start_service(config, guarded=guarded, audit=audit)
        self.made.append(service)
        if first_poll:
            await service.exporter.poller.wait_for_poll(0, WAIT_S)
        return service

    async def build(
        self,
        engine_count: int = 2,
        *,
        start: bool | None = None,
        guarded: bool = False,
        audit: Audit | None = None,
        options: SimOptions | None = None,
        per_engine: dict[str, dict[int, Any]] | None = None,
        **overrides: Any,
    ) -> Service:
        """``await build(n, **config)`` → a running owner-mode ``Service``."""
        if audit is not None:
            overrides["admin_listen"] = "off"
        config = make_config(engine_count, **overrides)
        service = await self.serve(config, first_poll=False, guarded=guarded, audit=audit)
        if self.start if start is None else start:
            await service.start_engines(options, **(per_engine or {}))
            await service.ready()
        return service

    async def close(self) -> None:
        for service in reversed(self.made):
            await asyncio.wait_for(service.stop(), 15)


@contextlib.asynccontextmanager
async def relay_service(
    options: SimOptions | None = None,
    engine_count: int = 2,
    *,
    by_index: Mapping[int, SimOptions] | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[Service, SimFrontend]]:
    """A relay-mode ``Service`` beside a simulated stock front end, its engines up
    (``options`` and ``by_index`` as ``Service.start_engines`` takes them)."""
    upstream = f"tcp://127.0.0.1:{free_listen_port()}"
    frontend = SimFrontend(upstream, engine_count)
    await frontend.start(call_loop=False)
    services = Services(start=False)
    try:
        config = serve_config(
            attach="relay",
            engine_count=engine_count,
            handshake_address=f"tcp://127.0.0.1:{free_listen_port()}",
            upstream_handshake_address=upstream,
            **overrides,
        )
        svc = await services.serve(config, first_poll=False)
        await svc.start_engines(options, by_index=by_index)
        await frontend.wait_connected(5.0)
        await svc.ready()
        yield svc, frontend
    finally:
        await services.close()
        await frontend.close()
