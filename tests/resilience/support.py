"""Helpers for the fault-injection suite: real sockets on 127.0.0.1, kernel-chosen ports, every
wait bounded. Each test builds its own exporter (own registry, own ZMQ context), so tests are
independent under ``pytest -n 2``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from exporter.client import EngineCoreClient
from exporter.config import ServeConfig, resolve_config
from exporter.httpguard import guarded_runner
from exporter.ports import free_listen_port, free_port_range
from exporter.runtime import Exporter
from exporter.server import ADMIN_URL_KEY, create_app
from exporter.sim.engine import SimEngine, SimOptions
from tests.helpers import eventually, parse_metrics
from tests.helpers import metric_value as metric

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
WAIT_S = 5.0


def can_bind(port: int) -> bool:
    """True when a listening TCP socket could take ``port`` now (nobody listens on it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def make_config(engine_count: int, **overrides: Any) -> ServeConfig:
    settings: dict[str, Any] = {
        "attach": "owner",
        "engine_count": engine_count,
        "handshake_address": f"tcp://127.0.0.1:{free_listen_port()}",
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "poll_interval": 0.1,
        "call_timeout": 0.3,
        "reset_min_interval": 0,
    }
    settings.update(overrides)
    return resolve_config(None, environ={}, **settings)


@dataclass
class Service:
    """``create_app(config)`` served on a kernel-chosen port, plus in-process engines."""

    config: ServeConfig
    exporter: Exporter
    runner: web.AppRunner
    url: str
    context: zmq.asyncio.Context
    session: aiohttp.ClientSession
    admin_url: str | None = None
    engines: list[SimEngine] = field(default_factory=list)
    engine_tasks: list[asyncio.Task[str]] = field(default_factory=list)
    stopped: bool = False

    @property
    def client(self) -> EngineCoreClient:
        assert isinstance(self.exporter.client, EngineCoreClient)
        return self.exporter.client

    async def start_engines(
        self, options: dict[int, SimOptions] | None = None, indices: list[int] | None = None
    ) -> None:
        first = self.config.start_rank
        wanted = indices if indices is not None else range(first, first + self.config.engine_count)
        for index in wanted:
            opts = (options or {}).get(index, SimOptions())
            engine = SimEngine(self.config.handshake_address, index, opts, context=self.context)
            self.engines.append(engine)
            self.engine_tasks.append(asyncio.create_task(engine.run()))
        await eventually(
            lambda: self.client.connected_count() >= len(self.engines), what="handshakes"
        )

    async def scrape(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/metrics") as resp:
            assert resp.status == 200
            return parse_metrics(await resp.text())

    async def status(self) -> dict[str, Any]:
        async with self.session.get(self.url + "/status") as resp:
            assert resp.status == 200
            body: dict[str, Any] = await resp.json()
            return body

    async def next_polls(self, count: int = 2) -> None:
        poller = self.exporter.poller
        for _ in range(count):
            await poller.wait_for_poll(poller.snapshot.poll_number, WAIT_S)

    async def ready(self) -> None:
        await eventually(lambda: self.exporter.poller.snapshot.ready, what="a ready fleet")

    async def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        await self.session.close()
        for engine in self.engines:
            engine.options.shutdown_window_s = 0.0
            engine.stop()
        if self.engine_tasks:
            await asyncio.wait_for(
                asyncio.gather(*self.engine_tasks, return_exceptions=True), WAIT_S
            )
        await self.runner.cleanup()
        self.context.term()


async def start_service(config: ServeConfig, *, guarded: bool = False) -> Service:
    """``guarded``: serve with ``exporter.httpguard.guarded_runner`` (as ``serve`` should)."""
    exporter = Exporter(config)
    app = create_app(config, exporter)
    if guarded:
        runner: web.AppRunner = guarded_runner(app, access_log=None, shutdown_timeout=0.5)
    else:
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    return Service(
        config,
        exporter,
        runner,
        f"http://127.0.0.1:{port}",
        zmq.asyncio.Context(),
        session,
        admin_url=app.get(ADMIN_URL_KEY),
    )


class SimProcess:
    """``python -m exporter sim-engine`` as a subprocess (killable with SIGKILL)."""

    def __init__(self, handshake_address: str, index: int, *extra: str) -> None:
        self.args = [
            PYTHON,
            "-m",
            "exporter",
            "--log-level",
            "warning",
            "sim-engine",
            "--handshake-address",
            handshake_address,
            "--engine-index",
            str(index),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SimProcess:
        self.proc = subprocess.Popen(
            self.args,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(WAIT_S)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def sim_processes(*procs: SimProcess) -> Any:
    try:
        yield [p.start() for p in procs]
    finally:
        for p in procs:
            p.kill()


def tcp_endpoint_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


__all__ = [
    "ROOT",
    "WAIT_S",
    "Service",
    "SimProcess",
    "can_bind",
    "eventually",
    "free_listen_port",
    "free_port_range",
    "make_config",
    "metric",
    "parse_metrics",
    "sim_processes",
    "start_service",
    "tcp_endpoint_port",
    "zmq",
]
