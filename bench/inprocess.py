"""In-process measurements against live engine processes: aggregated-call latency (exporter
client vs the floor, interleaved), poller CPU per poll, /metrics render time, and profiles.

The exporter side is the real ``Exporter`` (``EngineCoreClient`` + ``OwnerTransport``, poller,
collector, registry) in this process; the engines run in separate sim-engine processes. The
floor gets its own, separate engine processes of the same shape, so neither side ever shares an
engine with the other; the two sides run in alternating batches to spread machine noise evenly.
"""

from __future__ import annotations

import gzip
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.exposition import generate_latest

from bench.floor import FloorClient, consensus
from bench.procs import engine_fleet, free_address
from bench.profiling import Profile, profile_async, profile_sync
from bench.tail import CallSample, GcClock, Tail, percentile, tail_of
from exporter.base.steps import run_steps
from exporter.client.enginecore.client import EngineCoreClient
from exporter.config.settings import resolve_config
from exporter.control.runtime import Exporter, freeze_startup_heap, gc_paused
from exporter.fleetstate.aggregate import FleetState, aggregate_consensus
from exporter.metrics.exposition import text_steps


@dataclass
class LatencyResult:
    n: int
    calls: int
    exporter_p50: float
    exporter_p99: float
    floor_p50: float
    floor_p99: float
    exporter_cpu_per_call: float
    floor_cpu_per_call: float
    #: Of the CPU per call, the main thread's (``time.thread_time``); the rest is libzmq's I/O
    #: thread.
    exporter_main_cpu_per_call: float = 0.0
    floor_main_cpu_per_call: float = 0.0
    exporter_tail: Tail | None = None
    floor_tail: Tail | None = None

    @property
    def ratio_p50(self) -> float:
        return self.exporter_p50 / self.floor_p50

    @property
    def ratio_p99(self) -> float:
        return self.exporter_p99 / self.floor_p99


@dataclass
class ScrapeResult:
    n: int
    iterations: int
    render_p50: float
    render_mean: float
    body_bytes: int
    gzip_bytes: int
    series: int


@dataclass
class PollCpuResult:
    n: int
    polls: int
    cpu_per_poll: float
    cpu_per_poll_engine: float
    wall_per_poll: float


@dataclass
class SizeResult:
    n: int
    processes: int
    latency: LatencyResult
    poll_cpu: PollCpuResult | None = None
    scrape: ScrapeResult | None = None
    profiles: list[Profile] = field(default_factory=list)


@dataclass
class Plan:
    latency_calls: Callable[[int], int]
    warmup: int = 20
    rounds: int = 6
    poll_count: Callable[[int], int] = lambda n: 200 if n <= 64 else 50
    scrape_iterations: Callable[[int], int] = lambda n: 500 if n <= 64 else 200
    scrape_sizes: frozenset[int] = frozenset({8, 64, 256})
    profile_size: int | None = 64
    connect_timeout_s: float = 120.0
    call_timeout_s: float = 10.0


def make_exporter(handshake_address: str, n: int, call_timeout_s: float) -> Exporter:
    config = resolve_config(
        None,
        environ={},
        attach="owner",
        engine_count=n,
        handshake_address=handshake_address,
        listen="127.0.0.1:0",
        admin_listen="off",
        poll_interval=3600.0,
        call_timeout=call_timeout_s,
        reset_min_interval=0,
    )
    return Exporter(config)


async def aggregated_call(client: EngineCoreClient, timeout_s: float) -> Any:
    outcomes = await client.call_utility("is_sleeping", timeout_s=timeout_s)
    verdict = aggregate_consensus("is_sleeping", outcomes)
    if verdict.state is not FleetState.CONSISTENT:
        raise RuntimeError(f"exporter: fleet not consistent: {verdict}")
    return verdict.value


async def measure_size(n: int, processes: int, plan: Plan, log_dir: Path) -> SizeResult:
    """Everything in-process for one fleet size."""
    exp_address, floor_address = free_address(), free_address()
    with (
        engine_fleet(exp_address, n, log_dir, processes=processes),
        engine_fleet(floor_address, n, log_dir, processes=processes, start=0),
    ):
        exporter = make_exporter(exp_address, n, plan.call_timeout_s)
        client = exporter.client
        assert isinstance(client, EngineCoreClient)
        await client.start()
        floor: FloorClient | None = None
        try:
            transport = client.transport
            await transport.wait_connected(plan.connect_timeout_s)  # type: ignore[attr-defined]
            floor = FloorClient(floor_address, n)
            floor.connect(plan.connect_timeout_s)
            freeze_startup_heap()  # as `serve` does once it listens
            result = SizeResult(n, processes, await _latency(client, floor, n, plan))
            if n in plan.scrape_sizes:
                result.poll_cpu = await _poll_cpu(exporter, n, plan.poll_count(n))
                result.scrape = _scrape(exporter, n, plan.scrape_iterations(n))
            if plan.profile_size == n:
                result.profiles = await _profiles(exporter, client, floor, n, plan)
            return result
        finally:
            if floor is not None:
                floor.close()
            await client.close()


async def _latency(
    client: EngineCoreClient, floor: FloorClient, n: int, plan: Plan
) -> LatencyResult:
    timeout = plan.call_timeout_s
    for _ in range(plan.warmup):
        await aggregated_call(client, timeout)
        consensus(floor.call("is_sleeping", timeout))
    total = plan.latency_calls(n)
    per_round = max(1, total // plan.rounds)
    exp: list[CallSample] = []
    flo: list[CallSample] = []
    exp_cpu = flo_cpu = exp_main = flo_main = 0.0
    perf, cpu, main_cpu = time.perf_counter, time.process_time, time.thread_time

    async def exporter_call() -> None:
        await aggregated_call(client, timeout)

    async def floor_call() -> None:
        consensus(floor.call("is_sleeping", timeout))

    with GcClock() as gc_clock:

        async def batch(
            call: Callable[[], Awaitable[None]], samples: list[CallSample]
        ) -> tuple[float, float]:
            """(process CPU, main-thread CPU) of ``per_round`` calls."""
            c_batch, m_batch = cpu(), main_cpu()
            for _ in range(per_round):
                t0, c0, g0 = perf(), cpu(), gc_clock.total_s
                await call()
                samples.append(CallSample(perf() - t0, cpu() - c0, gc_clock.total_s - g0))
            return cpu() - c_batch, main_cpu() - m_batch

        for r in range(plan.rounds):
            sides = [(exporter_call, exp), (floor_call, flo)]
            for call, samples in sides if r % 2 == 0 else reversed(sides):
                spent, main = await batch(call, samples)
                if samples is exp:
                    exp_cpu, exp_main = exp_cpu + spent, exp_main + main
                else:
                    flo_cpu, flo_main = flo_cpu + spent, flo_main + main
    exp_wall, flo_wall = [s.wall_s for s in exp], [s.wall_s for s in flo]
    return LatencyResult(
        n=n,
        calls=len(exp),
        exporter_p50=percentile(exp_wall, 50),
        exporter_p99=percentile(exp_wall, 99),
        floor_p50=percentile(flo_wall, 50),
        floor_p99=percentile(flo_wall, 99),
        exporter_cpu_per_call=exp_cpu / len(exp),
        floor_cpu_per_call=flo_cpu / len(flo),
        exporter_main_cpu_per_call=exp_main / len(exp),
        floor_main_cpu_per_call=flo_main / len(flo),
        exporter_tail=tail_of(exp),
        floor_tail=tail_of(flo),
    )


async def _poll_cpu(exporter: Exporter, n: int, polls: int) -> PollCpuResult:
    poller = exporter.poller
    for _ in range(5):
        await poller.poll_once()
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(polls):
        snap = await poller.poll_once()
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    if snap.sleeping.state is not FleetState.CONSISTENT:
        raise RuntimeError(f"poll not consistent at n={n}: {snap.sleeping}")
    return PollCpuResult(n, polls, cpu / polls, cpu / polls / n, wall / polls)


def _scrape(exporter: Exporter, n: int, iterations: int) -> ScrapeResult:
    """A /metrics render that misses the cache (collector + text encoder with garbage
    collection paused, what the handler runs once per poll) on the snapshot of a real poll."""
    collector = exporter.collector
    body = run_steps(text_steps(collector.families()))
    if body != generate_latest(exporter.registry):
        raise RuntimeError("text_steps differs from prometheus_client's generate_latest")
    for _ in range(10):
        run_steps(text_steps(collector.families()))
    samples = []
    perf = time.perf_counter
    for _ in range(iterations):
        t0 = perf()
        with gc_paused():
            run_steps(text_steps(collector.families()))
        samples.append(perf() - t0)
    series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
    return ScrapeResult(
        n=n,
        iterations=iterations,
        render_p50=statistics.median(samples),
        render_mean=statistics.fmean(samples),
        body_bytes=len(body),
        gzip_bytes=len(gzip.compress(body, compresslevel=5)),
        series=series,
    )


async def _profiles(
    exporter: Exporter, client: EngineCoreClient, floor: FloorClient, n: int, plan: Plan
) -> list[Profile]:
    calls = max(100, plan.latency_calls(n))
    timeout = plan.call_timeout_s

    async def exporter_calls() -> None:
        for _ in range(calls):
            await aggregated_call(client, timeout)

    def floor_calls() -> None:
        for _ in range(calls):
            consensus(floor.call("is_sleeping", timeout))

    collector = exporter.collector
    iterations = plan.scrape_iterations(n)

    def scrapes() -> None:
        for _ in range(iterations):
            run_steps(text_steps(collector.families()))

    out = [
        await profile_async(
            f"aggregated is_sleeping, exporter client, N={n}", calls, exporter_calls
        ),
        profile_sync(f"aggregated is_sleeping, floor, N={n}", calls, floor_calls),
        profile_sync(f"/metrics render (text_steps), N={n}", iterations, scrapes),
    ]
    return out
