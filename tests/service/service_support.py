"""Shared helpers for the service tests: simulated engines and the real exporter, real sockets.

Everything runs on 127.0.0.1 with ports chosen by the kernel (bind port 0). Each test builds its
own ``Exporter`` (no global registry), its own ZMQ context and its own HTTP servers, so tests are
independent under ``pytest -n 2``. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from exporter.config import ServeConfig, resolve_config
from exporter.ports import free_listen_port
from exporter.runtime import Exporter
from exporter.sim.engine import SimEngine, SimOptions
from tests.helpers import eventually, parse_metrics

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 5.0  # upper bound of every "eventually" in these tests
POLL_INTERVAL = 0.1
CALL_TIMEOUT = 0.4


class RecordingSimEngine(SimEngine):
    """A simulated engine that also remembers every utility call's method and arguments."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.received: list[tuple[str, list[Any]]] = []

    async def _dispatch(
        self, client_index: int, call_id: int, method: str, args: list[Any]
    ) -> None:
        self.received.append((method, list(args)))
        await super()._dispatch(client_index, call_id, method, args)

    def args_of(self, method: str) -> list[list[Any]]:
        return [args for m, args in self.received if m == method]


@dataclass
class Fleet:
    """Simulated engines + one exporter served over real HTTP; built by the ``fleet`` fixture."""

    config: ServeConfig
    exporter: Exporter
    app: web.Application
    url: str
    context: zmq.asyncio.Context
    engines: list[RecordingSimEngine] = field(default_factory=list)
    admin_url: str | None = None
    session: aiohttp.ClientSession | None = None
    _engine_tasks: list[asyncio.Task[str]] = field(default_factory=list)

    # -- engines ---------------------------------------------------------------------------

    async def start_engines(self, options: SimOptions | None = None, **per_engine: Any) -> None:
        """Start one simulated engine per expected index, wait for every handshake."""
        for index in range(self.config.engine_count):
            opts = SimOptions(**(vars(options) if options else {}))
            for name, by_index in per_engine.items():
                if index in by_index:
                    setattr(opts, name, by_index[index])
            engine = RecordingSimEngine(
                self.config.handshake_address, index, opts, context=self.context
            )
            self.engines.append(engine)
            self._engine_tasks.append(asyncio.create_task(engine.run()))
        await eventually(
            lambda: self.exporter.client.connected_count() == len(self.engines),
            what="every engine's handshake",
        )

    async def stop_engines(self) -> None:
        for engine in self.engines:
            engine.options.shutdown_window_s = 0.0
            engine.stop()
        if self._engine_tasks:
            await asyncio.wait_for(
                asyncio.gather(*self._engine_tasks, return_exceptions=True), WAIT_S
            )
        self._engine_tasks.clear()

    # -- polling ---------------------------------------------------------------------------

    async def next_polls(self, count: int = 2) -> None:
        """Wait until ``count`` polls that started after this call have been published.

        The poll running now may have read the old state, so the default waits for two.
        """
        poller = self.exporter.poller
        for _ in range(count):
            await poller.wait_for_poll(poller.snapshot.poll_number, WAIT_S)

    async def ready(self) -> None:
        await eventually(lambda: self.exporter.poller.snapshot.ready, what="a ready fleet")

    # -- HTTP ------------------------------------------------------------------------------

    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None
        return self.session

    async def scrape(self, **headers: str) -> dict[str, Any]:
        async with self.http.get(self.url + "/metrics", headers=headers) as resp:
            assert resp.status == 200
            return parse_metrics(await resp.text())

    async def get_json(self, path: str) -> tuple[int, Any]:
        async with self.http.get(self.url + path) as resp:
            return resp.status, await resp.json()

    async def reset(
        self,
        params: dict[str, str] | None = None,
        token: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, dict[str, Any], Any]:
        """POST the admin reset; returns (status, JSON body, response headers)."""
        assert self.admin_url is not None
        h = dict(headers or {})
        if token is not None:
            h["Authorization"] = f"Bearer {token}"
        async with self.http.post(
            self.admin_url + "/admin/reset_prefix_cache", params=params or {}, headers=h
        ) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


FleetFactory = Callable[..., Awaitable[Fleet]]


def make_config(engine_count: int, **overrides: Any) -> ServeConfig:
    """A loopback config with fast polls; ``environ={}`` so the machine's env cannot leak in."""
    settings: dict[str, Any] = {
        "attach": "owner",
        "engine_count": engine_count,
        "handshake_address": f"tcp://127.0.0.1:{free_listen_port()}",
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "poll_interval": POLL_INTERVAL,
        "call_timeout": CALL_TIMEOUT,
        "reset_min_interval": 0,
    }
    settings.update(overrides)
    return resolve_config(None, environ={}, **settings)


# -- subprocesses ----------------------------------------------------------------------------


def python_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "exporter", *args]


def clean_env() -> dict[str, str]:
    """The test process's environment without VLLM_DP_EXPORTER_* (no leaks into children)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_DP_EXPORTER_")}


async def run_cli(*args: str, timeout_s: float = 20.0) -> tuple[int, str, str]:
    """Run ``python -m exporter ARGS`` without blocking the event loop (the server lives there)."""
    proc = await asyncio.create_subprocess_exec(
        *python_cmd(*args),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=ROOT,
        env=clean_env(),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc/*/stat (no psutil)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name (2nd field) may contain spaces; fields resume after the last ')'.
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def process_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """Best-effort teardown of a process this test started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout_s)
