"""The conformance kinds over simulated engines speaking the engine-core protocol: owner and
relay mode over real ZMQ, and in-process mode over the simulated ``AsyncLLM``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import zmq.asyncio

from exporter.base.faults import ProtocolErrorTally
from exporter.client.enginecore.client import EngineCoreClient
from exporter.client.fleet import (
    Capabilities,
    connected_count,
)
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore, is_engine_dead_error
from exporter.control.attach import build_fleet
from exporter.inprocess.trainer import inprocess_config
from exporter.sim.options import SimOptions, SimReply
from exporter.sim.state import EngineState
from tests.harness.fleet_kind_base import (
    ENGINES,
    WAIT_S,
    FleetKind,
    engine_fault,
    has_work_fault,
)
from tests.harness.inprocess import SimVllm, start_sim_vllm_fleet
from tests.harness.relay import RelayHarness
from tests.harness.service import RecordingSimEngine, make_config
from tests.harness.waiting import eventually


class SimEngineKind(FleetKind):
    """Faults of simulated engines on real ZMQ (owner, relay and in-process mode)."""

    engines: list[RecordingSimEngine]
    tasks: list[asyncio.Task[str]]

    def _state(self, i: int) -> EngineState:
        return self.engines[i].state

    def work_state(self, i: int) -> EngineState:
        return self.engines[i].state

    async def answer_has_work(self, i: int, value: Any) -> None:
        has_work_fault(self.engines[i], SimReply(value=value))

    async def fail_has_work(self, i: int, text: str) -> None:
        has_work_fault(self.engines[i], SimReply(failure=text))

    async def hang(self, i: int) -> None:
        self.engines[i].options.hang = True

    async def slow(self, i: int, delay_s: float) -> None:
        self.engines[i].options.reply_delay_s = delay_s

    async def recover(self, i: int) -> None:
        self.engines[i].options.hang = False

    async def freeze(self, i: int) -> None:
        self.engines[i].options.frozen = True

    async def thaw(self, i: int) -> None:
        self.engines[i].options.frozen = False

    async def fail(self, i: int, text: str) -> None:
        engine_fault(self.engines[i], SimReply(failure=text))

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
            lambda: connected_count(self.client) == ENGINES - 1,
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

    def answered(self, i: int) -> int:
        return self.engines[i].replies

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
        frozenset({"vllm_dp_state_file_writes_total", "vllm_dp_late_replies_total"}),
    )
    context = zmq.asyncio.Context()

    async def stop_context() -> None:
        await kind.stop_engines()
        context.term()

    kind._cleanups.append(stop_context)
    try:
        await client.start()
        kind.engines, kind.tasks = _recording_engines(config.handshake_address, context)
        await eventually(lambda: connected_count(client) == ENGINES, WAIT_S, "3 handshakes")
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
        frozenset(
            {
                "vllm_dp_relay_handshakes_total",
                "vllm_dp_state_file_writes_total",
                "vllm_dp_late_replies_total",
            }
        ),
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
