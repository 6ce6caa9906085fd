"""A simulated vLLM ``AsyncLLM`` as in-process mode sees it, over real ZMQ to simulated engines.

``SimEngineCore`` has what ``exporter.client.inprocess.vllm_core`` reads of vLLM's engine-core
client (``core_engines``, ``utility_results``, ``resources.engine_dead``, ``client_index``,
``_call_utility_async``, ``get_kv_event_sources``, vLLM 0.33's ``_engine_status``: every rank
healthy when built with fault tolerance, ``{}`` otherwise; ``set_engine_status`` is a sentinel's
push) with vLLM's semantics: no timeout, one
future per call kept in ``utility_results`` until the engine answers (and popped without a
default when it does, as vLLM's reply handler does), a failure message raised as a plain
``Exception``, and after an engine's death ``engine_dead`` set and ``EngineDeadError`` for every
call. Its wire is the
exporter's own owner-mode client, so the engines are real processes' peers on real sockets
(``SimEngine``). The tests and ``bench.plugin_loop`` use it (test support, kept out of the
``exporter`` package and its wheel; the tests may import ``bench``); nothing here imports vLLM.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import DEFAULT_ALLOWED_METHODS, connected_count
from exporter.client.owner import OwnerConfig, OwnerTransport
from exporter.error import EngineUnavailable
from exporter.protocol import EngineOutput, encode_utility_request
from exporter.protocol.kv_events import KvEventsSource
from exporter.protocol.pushes import encode_ft_status_value


class EngineDeadError(Exception):
    """vLLM's ``EngineDeadError`` (in-process mode recognises it by its class name)."""

    def __init__(self) -> None:
        super().__init__("EngineCore encountered an issue. See stack trace for the root cause.")


@dataclass
class Resources:
    engine_dead: bool = False
    #: vLLM's subscription to the DP coordinator's counts (``start_coordinator``).
    stats_update_task: asyncio.Task[None] | None = None


#: How often vLLM's DP coordinator publishes the engines' counts (its ``stats_update_interval``
#: is 100 ms).
COORDINATOR_INTERVAL_S = 0.1


class SimWire(EngineCoreClient):
    """The simulated client's wire: the owner-mode transport (handshake, sockets) with vLLM's
    per-call path on top (``send_call``: one encoded request written to one engine's socket;
    replies to those calls go to ``SimEngineCore``, by call id, as vLLM's output handler
    routes them). Its own fan-out (``call_utility``) is not used: that is the exporter's
    owner-mode client, whose per-call cost is not vLLM's."""

    def __init__(
        self,
        config: OwnerConfig,
        faults: ProtocolErrorTally,
        *,
        context: zmq.asyncio.Context | None = None,
        allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS,
    ) -> None:
        super().__init__(
            lambda listener: OwnerTransport(config, listener, faults, context=context),
            faults,
            allowed_methods=allowed_methods,
        )
        #: call id → engine, for the calls ``send_call`` sent and no reply answered yet.
        self._sim_calls: dict[int, int] = {}
        self._reply: Callable[[int, str | None, Any], None] = lambda *_: None
        self._gone: Callable[[list[int]], None] = lambda _: None
        self._up: Callable[[int, KvEventsSource | None], None] = lambda *_: None

    def replies_to(
        self,
        reply: Callable[[int, str | None, Any], None],
        gone: Callable[[list[int]], None],
        up: Callable[[int, KvEventsSource | None], None],
    ) -> None:
        self._reply, self._gone, self._up = reply, gone, up

    def on_engine_up(self, engine_index: int, handshaken: bool) -> None:
        super().on_engine_up(engine_index, handshaken)
        for link in self.transport.link_snapshots():
            if link.engine_index == engine_index:
                reg = link.registration
                self._up(engine_index, reg.kv_events if reg is not None else None)

    def send_call(
        self, call_id: int, engine_index: int, method: str, args: tuple[Any, ...]
    ) -> None:
        """Encode one utility request and write it to ``engine_index``'s socket
        (``EngineUnavailable`` when that engine is not connected)."""
        transport = self.transport
        payload = encode_utility_request(
            transport.client_index(engine_index), call_id, method, args
        )
        transport.send_utility(engine_index, payload)
        self._sim_calls[call_id] = engine_index

    def on_output(self, engine_index: int, output: EngineOutput) -> bool:
        reply = output.utility
        if reply is not None and self._sim_calls.get(reply.call_id) == engine_index:
            del self._sim_calls[reply.call_id]
            self._reply(reply.call_id, reply.failure_message, reply.value)
            return True
        return super().on_output(engine_index, output)

    def on_engine_down(self, engine_index: int, reason: str) -> None:
        super().on_engine_down(engine_index, reason)
        lost = [c for c, e in self._sim_calls.items() if e == engine_index]
        for call_id in lost:
            del self._sim_calls[call_id]
        if lost:
            self._gone(lost)


class SimEngineCore:
    """vLLM's engine-core client, as far as in-process mode reads it (module docstring)."""

    def __init__(
        self,
        wire: SimWire,
        ranks: list[int],
        client_index: int = 0,
        *,
        fault_tolerance: bool = False,
    ) -> None:
        self._wire = wire
        self.core_engines: list[bytes] = [rank.to_bytes(2, "little") for rank in ranks]
        self.utility_results: dict[int, asyncio.Future[Any]] = {}
        self.resources = Resources()
        self.client_index = client_index
        self._ids = itertools.count(1)
        #: DP rank → its registered KV-events config (vLLM's ``_kv_event_sources``).
        self._kv_event_sources: dict[int, Any] = {}
        wire.replies_to(self._on_reply, self._on_engine_gone, self._on_engine_up)
        #: vLLM 0.33's locally-cached engine status (``AsyncMPClient.__init__``).
        self._engine_status: dict[int, dict[str, Any]] = {}
        #: vLLM's load-balancing table, ``[waiting, running, kv_cache_usage]`` per managed
        #: rank; live only once ``start_coordinator`` runs (as vLLM's internal balancing).
        self.engine_ranks_managed = list(ranks)
        self.lb_engines: list[list[int | float]] = [[0, 0, 0.0] for _ in ranks]
        #: vLLM's "exact per-engine count of this client's unfinished requests" (by engine
        #: identity; ``DPLBAsyncMPClient.engine_inflight``, vLLM 0.30-0.33).
        self.engine_inflight: Counter[bytes] = Counter()
        if fault_tolerance:
            self.enable_fault_tolerance()

    def enable_fault_tolerance(self) -> None:
        """Every managed rank healthy, as vLLM's client starts with fault tolerance on."""
        ranks = [int.from_bytes(i, "little") for i in self.core_engines]
        self._engine_status = {rank: encode_ft_status_value(rank, "healthy") for rank in ranks}

    def set_engine_status(self, rank: int, status: str, fault_info: str | None = None) -> None:
        """Rank ``rank``'s sentinel pushed ``status``: vLLM stores the payload as it came."""
        self._engine_status[rank] = encode_ft_status_value(rank, status, fault_info)

    def start_coordinator(
        self,
        counts_of: Callable[[int], tuple[int, int]],
        interval_s: float = COORDINATOR_INTERVAL_S,
    ) -> None:
        """Subscribe to a simulated DP coordinator: every ``interval_s`` the table takes each
        managed rank's ``(running, waiting)`` from ``counts_of(rank)``, as vLLM's stats task
        takes the coordinator's publication (``lb_engines``)."""

        async def publish() -> None:
            while True:
                self.lb_engines = [
                    [waiting, running, 0.0]
                    for running, waiting in map(counts_of, self.engine_ranks_managed)
                ]
                await asyncio.sleep(interval_s)

        self.resources.stats_update_task = asyncio.ensure_future(publish())

    async def _call_utility_async(self, method: str, *args: Any, engine: bytes) -> Any:
        """vLLM's ``_call_utility_async``: a future under a new call id in
        ``utility_results``, the request encoded and written to the engine's socket, and no
        timeout: the output reader resolves the future when the reply comes."""
        if self.resources.engine_dead:
            raise EngineDeadError()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.utility_results[call_id] = future
        try:
            self._wire.send_call(call_id, int.from_bytes(engine, "little"), method, args)
        except EngineUnavailable:  # vLLM's client finds the engine gone: dead as a whole
            del self.utility_results[call_id]
            self.resources.engine_dead = True
            raise EngineDeadError() from None
        return await future

    def _on_reply(self, call_id: int, failure: str | None, value: Any) -> None:
        """vLLM's output handler: the future popped without a default (an unknown id raises
        there), then resolved, unless its caller gave up on it."""
        future = self.utility_results.pop(call_id)
        if future.done():
            return
        if failure is None:
            future.set_result(value)
        else:
            future.set_exception(Exception(failure))

    def _on_engine_gone(self, call_ids: list[int]) -> None:
        """An engine with calls in flight went away: vLLM's client marks itself dead and
        fails every waiting call."""
        self.resources.engine_dead = True
        for call_id in call_ids:
            future = self.utility_results.pop(call_id, None)
            if future is not None and not future.done():
                future.set_exception(EngineDeadError())

    def get_kv_event_sources(self) -> dict[int, Any]:
        """vLLM's ``MPClient.get_kv_event_sources``: a copy of each engine's registered
        publisher config (an object with ``KVEventsConfig``'s attributes), keyed by DP rank,
        for the engines whose registration carried one (``_on_engine_up`` records it, as
        vLLM records it when the engine registers)."""
        return dict(self._kv_event_sources)

    def _on_engine_up(self, engine_index: int, kv: KvEventsSource | None) -> None:
        if kv is None:
            self._kv_event_sources.pop(engine_index, None)
            return
        self._kv_event_sources[engine_index] = SimpleNamespace(
            enable_kv_cache_events=True,
            publisher=kv.publisher,
            endpoint=kv.endpoint,
            replay_endpoint=kv.replay_endpoint,
            topic=kv.topic,
        )

    async def wait_connected(self, timeout_s: float) -> None:
        """Until every engine has handshaken (as vLLM's start-up waits), at most ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while connected_count(self._wire) < len(self.core_engines):
            if loop.time() > deadline:
                raise TimeoutError(f"the engines did not handshake within {timeout_s:g}s")
            await asyncio.sleep(0.02)

    async def close(self) -> None:
        stats = self.resources.stats_update_task
        if stats is not None:
            stats.cancel()
        for future in self.utility_results.values():
            future.cancel()
        self.utility_results.clear()
        await self._wire.close()


class SimLoggerManager:
    """vLLM's ``StatLoggerManager`` as far as ``AsyncLLM.sleep``/``wake_up`` use it: the sleep
    state behind ``vllm:engine_sleep_state``."""

    def __init__(self) -> None:
        self.sleep_states: list[tuple[int, int]] = []

    def record_sleep_state(self, sleep: int, level: int) -> None:
        self.sleep_states.append((sleep, level))


class SimRenderer:
    """vLLM's renderer as far as ``AsyncLLM.sleep``/``pause_generation`` use it."""

    def __init__(self) -> None:
        self.mm_cache_clears = 0

    async def clear_mm_cache_async(self) -> None:
        self.mm_cache_clears += 1


@dataclass
class SimAsyncLLM:
    """What in-process mode reads of vLLM's ``AsyncLLM``: ``engine_core``, ``vllm_config`` and
    the front-end bookkeeping of sleep and pause (``logger_manager``, ``renderer``)."""

    engine_core: SimEngineCore
    vllm_config: Any = field(default_factory=SimpleNamespace)
    logger_manager: SimLoggerManager = field(default_factory=SimLoggerManager)
    renderer: SimRenderer = field(default_factory=SimRenderer)

    async def shutdown(self) -> None:
        await self.engine_core.close()


async def start_sim_vllm(
    handshake_address: str,
    engine_count: int,
    *,
    enable_sleep_mode: bool = True,
    api_server_index: int = 0,
    api_server_count: int = 1,
    context: zmq.asyncio.Context | None = None,
    enable_fault_tolerance: bool = False,
) -> SimAsyncLLM:
    """A simulated ``AsyncLLM`` whose engines (``SimEngine``s dialing ``handshake_address``,
    started by the caller) handshake with it as with vLLM's front end."""
    faults = ProtocolErrorTally()
    config = OwnerConfig(engine_count=engine_count, handshake_address=handshake_address)
    methods = DEFAULT_ALLOWED_METHODS | {"get_supported_tasks", "collective_rpc"}
    wire = SimWire(config, faults, context=context, allowed_methods=methods)
    await wire.start()
    core = SimEngineCore(
        wire,
        list(range(engine_count)),
        client_index=api_server_index,
        fault_tolerance=enable_fault_tolerance,
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(enable_sleep_mode=enable_sleep_mode),
        parallel_config=SimpleNamespace(
            _api_process_rank=api_server_index,
            _api_process_count=api_server_count,
            enable_fault_tolerance=enable_fault_tolerance,
        ),
    )
    return SimAsyncLLM(core, vllm_config)
