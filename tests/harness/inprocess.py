"""In-process mode over real sockets: simulated engines behind a simulated vLLM ``AsyncLLM``.

``SimVllm`` is N ``RecordingSimEngine``s on real loopback ZMQ sockets, handshaken with
``start_sim_vllm``'s ``SimAsyncLLM`` (whose ``engine_core`` has vLLM's semantics). Tests of the
in-process fleet client, of ``start_exporter`` and of the endpoint plugin's routes all start from
it (``tests/integration/inprocess/conftest.py``: ``sim_vllm``, ``sim_vllm_factory``,
``embedded``). Everything binds 127.0.0.1 with ports the kernel chooses; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import zmq.asyncio

from bench.sim_vllm import SimAsyncLLM, SimEngineCore, start_sim_vllm
from exporter.base.ports import free_listen_port
from exporter.client.fleet import DEFAULT_ALLOWED_METHODS
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.inprocess import start_exporter
from exporter.sim.options import RequestHook, SimOptions
from exporter.web.app import RunningService
from tests.harness.scrape import parse_metrics
from tests.harness.service import RecordingSimEngine
from tests.harness.statusschema import validate_status

WAIT_S = 5.0  # upper bound of one wait (a handshake, an engine's exit, a stop)
POLL_INTERVAL = 0.1
CALL_TIMEOUT = 0.4
ADMIN_TOKEN = "inproc-token-4d1c9e7a2b"


@dataclass
class SimVllm:
    """Simulated engines (``engines``, engine i is DP rank i) and the simulated ``AsyncLLM``
    (``llm``) whose engine-core client is connected to all of them."""

    llm: SimAsyncLLM
    engines: list[RecordingSimEngine]
    tasks: list[asyncio.Task[str]]
    context: zmq.asyncio.Context
    handshake_address: str
    clients: list[InProcessFleetClient] = field(default_factory=list)
    stopped: bool = False

    @property
    def core(self) -> SimEngineCore:
        """vLLM's engine-core client (simulated): ``utility_results``, ``resources`` ..."""
        return self.llm.engine_core

    def fleet_client(
        self, allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS, **kwargs: Any
    ) -> InProcessFleetClient:
        """An ``InProcessFleetClient`` over this ``AsyncLLM`` (closed by ``stop``)."""
        client = InProcessFleetClient(
            VllmCore(self.core, vllm_version="0.33.0", enable_sleep_mode=True),
            allowed_methods=allowed_methods,
            **kwargs,
        )
        self.clients.append(client)
        return client

    def calls(self) -> list[int]:
        """Utility requests each engine has read so far (hung engines included)."""
        return [e.calls for e in self.engines]

    def received(self, method: str) -> list[int]:
        """Requests for ``method`` each engine has answered (or is about to)."""
        return [len(e.args_of(method)) for e in self.engines]

    def script(self, index: int, hook: RequestHook | None) -> None:
        """Answer engine ``index``'s requests with ``hook`` from now on (recorded first)."""
        self.engines[index]._then = hook

    async def direct_call(self, method: str, rank: int, *args: Any) -> Any:
        """One call through vLLM's own client, as vLLM itself makes it (bounded here)."""
        call = self.core._call_utility_async(method, *args, engine=rank.to_bytes(2, "little"))
        return await asyncio.wait_for(call, WAIT_S)

    async def stop_engine(self, index: int) -> None:
        """Stop one engine (no shutdown window) and wait for it to exit."""
        engine = self.engines[index]
        engine.options.shutdown_window_s = 0.0
        engine.stop()
        await asyncio.wait_for(asyncio.gather(self.tasks[index], return_exceptions=True), WAIT_S)

    async def stop(self) -> None:
        """Close the fleet clients made here, the ``AsyncLLM``, then every engine."""
        if self.stopped:
            return
        self.stopped = True
        for client in self.clients:
            await client.close()
        await asyncio.wait_for(self.llm.shutdown(), WAIT_S)
        for engine in self.engines:
            engine.options.shutdown_window_s = 0.0
            engine.stop()
        await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True), WAIT_S)
        self.context.term()


async def start_sim_vllm_fleet(
    engine_count: int = 3,
    options: SimOptions | None = None,
    *,
    by_index: Mapping[int, SimOptions] | None = None,
    enable_sleep_mode: bool = True,
    api_server_index: int = 0,
    api_server_count: int = 1,
    hook: Callable[[int], RequestHook | None] | None = None,
    **per_engine: Mapping[int, Any],
) -> SimVllm:
    """``engine_count`` engines and a ``SimAsyncLLM`` they have all handshaken with.

    ``options`` is every engine's template (copied), ``by_index`` replaces it for some and
    ``per_engine`` sets single fields by index (``sleeping={1: True}``); ``hook(rank)`` is
    engine ``rank``'s ``on_request`` hook (run after the recording); the ``AsyncLLM`` is API
    server ``api_server_index`` of ``api_server_count``."""
    context = zmq.asyncio.Context()
    address = f"tcp://127.0.0.1:{free_listen_port()}"
    llm = await start_sim_vllm(
        address,
        engine_count,
        enable_sleep_mode=enable_sleep_mode,
        api_server_index=api_server_index,
        api_server_count=api_server_count,
        context=context,
    )
    engines: list[RecordingSimEngine] = []
    for index in range(engine_count):
        chosen = (by_index or {}).get(index)
        opts = chosen if chosen is not None else replace(options or SimOptions())
        for name, by in per_engine.items():
            if index in by:
                setattr(opts, name, by[index])
        on_request = hook(index) if hook is not None else None
        engines.append(
            RecordingSimEngine(address, index, opts, context=context, on_request=on_request)
        )
    tasks = [asyncio.create_task(e.run()) for e in engines]
    sim = SimVllm(llm, engines, tasks, context, address)
    try:
        await llm.engine_core.wait_connected(WAIT_S)
    except BaseException:
        await sim.stop()
        raise
    return sim


class SimVllmFactory:
    """``await factory(n, ...)`` (``start_sim_vllm_fleet``'s arguments); ``close`` stops every
    fleet it made."""

    def __init__(self) -> None:
        self.made: list[SimVllm] = []

    async def __call__(self, engine_count: int = 3, *args: Any, **kwargs: Any) -> SimVllm:
        sim = await start_sim_vllm_fleet(engine_count, *args, **kwargs)
        self.made.append(sim)
        return sim

    async def close(self) -> None:
        for sim in reversed(self.made):
            await sim.stop()


# -- the trainer embedding API -----------------------------------------------------------------


def token_file(directory: Path, token: str = ADMIN_TOKEN) -> str:
    """An admin token file, mode 0600, in ``directory``."""
    path = directory / "admin-token"
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return str(path)


def fast_settings(**settings: Any) -> dict[str, Any]:
    """``start_exporter`` keyword arguments: loopback, kernel-chosen ports, an empty
    environment (the machine's cannot leak in), fast polls."""
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "environ": {},
        "poll_interval": POLL_INTERVAL,
        "call_timeout": CALL_TIMEOUT,
        "reset_min_interval": 0,
    }
    values.update(settings)
    return values


class EmbeddedExporters:
    """``await embedded(llm, **settings)``: ``start_exporter`` with ``fast_settings``; ``close``
    stops whatever a test did not stop itself."""

    def __init__(self) -> None:
        self.running: list[RunningService] = []

    async def __call__(self, llm: Any, **settings: Any) -> RunningService:
        service = await start_exporter(llm, **fast_settings(**settings))
        self.running.append(service)
        return service

    async def stop(self, service: RunningService) -> None:
        self.running.remove(service)
        await asyncio.wait_for(service.stop(), WAIT_S)

    async def close(self) -> None:
        for service in reversed(self.running):
            await asyncio.wait_for(service.stop(), WAIT_S)
        self.running.clear()


async def fresh_poll(service: RunningService, timeout_s: float = WAIT_S) -> None:
    """Ask for a poll now and wait (bounded) for one that started after this call: a poll may
    be running already, so two more published polls guarantee it."""
    poller = service.exporter.poller
    after = poller.snapshot.poll_number
    poller.poll_soon()
    await poller.wait_for_poll(after, timeout_s)
    poller.poll_soon()
    await poller.wait_for_poll(after + 1, timeout_s)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None, url
    return parts.hostname, parts.port


async def refuses_connections(url: str) -> bool:
    """Whether nothing listens at ``url``'s host and port (the connection is refused)."""
    host, port = host_port(url)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), WAIT_S)
    except ConnectionRefusedError:
        return True
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


def http_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))


#: How long a held request lasts on a simulated engine (longer than any test).
HOLD_S = 600.0


@dataclass
class TokenStats:
    """vLLM's ``IterationStats`` as a stat logger reads it: one step's tokens."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0


def coordinate(sim: SimVllm) -> None:
    """vLLM's DP coordinator, simulated: the table follows each engine's requests."""
    engines = sim.engines
    sim.core.start_coordinator(lambda r: engines[r].state.request_counts(time.monotonic()))


def holding(sim: SimVllm, rank: int, count: int) -> None:
    """The front end sent ``count`` requests to ``rank`` and its engine holds them."""
    core = sim.core
    core.engine_inflight[core.core_engines[rank]] = count
    sim.engines[rank].state.submit(HOLD_S, time.monotonic(), count=count)


async def read_status(service: RunningService) -> tuple[dict[str, Any], Any]:
    """``/status`` (checked against its schema) and the scrape, after a fresh poll."""
    await fresh_poll(service)
    async with http_session() as session:
        async with session.get(service.url + "/status") as resp:
            assert resp.status == 200
            doc = await resp.json()
        async with session.get(service.url + "/metrics") as resp:
            assert resp.status == 200
            metrics = parse_metrics(await resp.text())
    validate_status(doc)
    return doc, metrics


async def read_activity(service: RunningService) -> tuple[list[dict[str, Any]], Any]:
    """Every engine's ``/status`` activity and the scrape, after a fresh poll."""
    doc, metrics = await read_status(service)
    return [e["activity"] for e in doc["engines"]], metrics
