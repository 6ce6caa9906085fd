"""``python -m bench.plugin_loop``: what the in-process exporter costs vLLM's event loop.

The ``dp_exporter`` plugin polls in vLLM's own event loop. This benchmark stands in for that
loop: a simulated ``AsyncLLM`` (``bench.sim_vllm``, vLLM's engine-core semantics)
whose engines run in other processes, and a probe task that sleeps 5 ms again and again and
records how late it wakes (the loop's lag: any callback that blocks the loop shows in it).
Phases alternate without and with the plugin's runtime (``InProcessRuntime``, polling every
``--poll-interval`` seconds, as ``VLLM_DP_EXPORTER_POLL_INTERVAL`` sets it), several times per
engine count, and the report compares the lag and this process's CPU time per poll; it also
times one ``/metrics`` render of the ``vllm_dp_*`` series on the loop.

Options: ``--sizes 2,8,64``, ``--phase-seconds 8``, ``--repeats 3``, ``--poll-interval 1``,
``--engines-per-burst N`` (the exporter's paced polls, ``VLLM_DP_EXPORTER_ENGINES_PER_BURST``;
default: its own default; ``0``: every engine at once), ``--out docs/benchmarks/plugin-loop.md``
(``-`` for stdout only), ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench.plugin_loop_report import report
from bench.procs import engine_fleet, free_address
from bench.report_model import publish
from bench.sim_vllm import start_sim_vllm
from bench.steps import StepLog, Window, timed_steps
from bench.wire_floor import client_cpu_per_call
from exporter.base import eventloop
from exporter.base.steps import Steps, run_steps
from exporter.inprocess.runtime import InProcessRuntime
from exporter.metrics.exposition import text_steps
from exporter.web.answers import gate_answer, status_document_steps
from exporter.web.statusdoc import json_steps

PROBE_S = 0.005
T = TypeVar("T")


@dataclass
class Phase:
    lags_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    seconds: float = 0.0
    polls: int = 0
    #: Utility calls the exporter sent during the phase, by method (counted, not timed).
    calls: Counter[str] = field(default_factory=Counter)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.lags_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    @property
    def lag_p99(self) -> float:
        return self.quantile(0.99)


def window_medians(windows: Sequence[Window]) -> dict[str, float]:
    """Per poll, the exporter's longest step and the probe's (a trivial step: the machine's
    floor), by CPU and wall clock: the medians over the polls, in ms."""
    if not windows:
        return dict.fromkeys(("poll_step_cpu", "poll_step_wall", "floor_cpu", "floor_wall"), 0.0)
    return {
        "poll_step_cpu": statistics.median(w.exporter_cpu for w in windows) * 1000,
        "poll_step_wall": statistics.median(w.exporter_wall for w in windows) * 1000,
        "floor_cpu": statistics.median(w.probe_cpu for w in windows) * 1000,
        "floor_wall": statistics.median(w.probe_wall for w in windows) * 1000,
        "windows": len(windows),
    }


async def probe(seconds: float) -> list[float]:
    lags = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        before = time.perf_counter()
        await asyncio.sleep(PROBE_S)
        lags.append((time.perf_counter() - before - PROBE_S) * 1000)
    return lags


def calls_by_method(runtime: InProcessRuntime | None) -> Counter[str]:
    """Every utility call the runtime's exporter has sent so far, by method."""
    found: Counter[str] = Counter()
    if runtime is not None and runtime.exporter is not None:
        for (method, _, _), count in runtime.exporter.stats.utility_calls.items():
            found[method] += count
    return found


async def phase(seconds: float, runtime: InProcessRuntime | None) -> Phase:
    polls_before = (
        runtime.exporter.poller.snapshot.poll_number if runtime and runtime.exporter else 0
    )
    calls_before = calls_by_method(runtime)
    cpu, wall = time.process_time(), time.perf_counter()
    lags = await asyncio.ensure_future(probe(seconds))  # a task: its steps are timed too
    result = Phase(lags, time.process_time() - cpu, time.perf_counter() - wall)
    if runtime is not None and runtime.exporter is not None:
        result.polls = runtime.exporter.poller.snapshot.poll_number - polls_before
        result.calls = calls_by_method(runtime) - calls_before
    return result


async def surfaces(runtime: InProcessRuntime, steps: StepLog) -> dict[str, float]:
    """The longest step (ms of CPU) of a fresh ``/metrics`` series render, of a ``/dp/status``
    document with its JSON, and of a ``/dp/gate`` fan-out, each run as vLLM's route would."""
    exporter = runtime.exporter
    assert exporter is not None
    exporter.renderer.forget()  # a fresh render, as after every poll
    found = {}
    for key, work in (
        ("series", lambda: runtime.series()),
        ("gate", lambda: gate_answer(exporter, {})),
    ):
        steps.clear()
        await asyncio.ensure_future(work())
        found[key] = steps.exporter_longest()[0]
    # What the plugin's /dp/status route does on the loop, a step per turn.
    doc, building = longest_step(status_document_steps(exporter))
    _, writing = longest_step(json_steps(doc))
    found["status"] = max(building, writing)
    return found


def longest_step(steps: Steps[T]) -> tuple[T, float]:
    """``steps`` run to completion, and its longest step (s of this thread's CPU)."""
    longest = 0.0
    while True:
        started = time.thread_time()
        try:
            next(steps)
        except StopIteration as done:
            return done.value, max(longest, time.thread_time() - started)
        longest = max(longest, time.thread_time() - started)


async def measure(size: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    address = free_address()
    with engine_fleet(address, size, log_dir):
        llm = await start_sim_vllm(address, size)
        steps = StepLog()
        try:
            await llm.engine_core.wait_connected(120)
            # vLLM's front end under internal load balancing follows the DP coordinator's
            # counts (idle engines here), in both kinds of phase: a poll takes each rank's
            # activity from them (docs/activity.md, a listening poll).
            llm.engine_core.start_coordinator(lambda rank: (0, 0))
            # vLLM's API server freezes its start-up heap once serving (freeze_gc_heap): the
            # oldest generation's collections then skip it. The same here.
            gc.collect()
            gc.freeze()
            client_cpu_s = await client_cpu_per_call(
                llm, engines_per_burst=args.engines_per_burst, interval_s=args.poll_interval
            )
            windows: list[Window] = []
            without: list[Phase] = []
            with_plugin: list[Phase] = []
            render_ms: list[float] = []
            longest: list[tuple[float, str]] = []
            surface_ms: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                without.append(await phase(args.phase_seconds, None))
                env = {
                    "VLLM_DP_EXPORTER_POLL_INTERVAL": str(args.poll_interval),
                    "VLLM_DP_EXPORTER_CALL_TIMEOUT": "5",
                }
                if args.engines_per_burst is not None:
                    env["VLLM_DP_EXPORTER_ENGINES_PER_BURST"] = str(args.engines_per_burst)
                runtime = InProcessRuntime(environ=env)
                with timed_steps(steps):
                    await runtime.start(llm, None)
                    assert runtime.exporter is not None, runtime.problem
                    await asyncio.sleep(args.poll_interval)  # the first poll is not steady
                    runtime.exporter.poller.listeners.append(lambda _: steps.cut())
                    steps.clear()
                    steps.recording = True
                    with_plugin.append(await phase(args.phase_seconds, runtime))
                    longest.append(steps.exporter_longest())
                    windows += steps.windows[1:]  # the first window began mid-poll
                    steps.windows.clear()
                    for key, seconds in (await surfaces(runtime, steps)).items():
                        surface_ms.setdefault(key, []).append(seconds * 1000)
                    steps.recording = False
                for _ in range(20):
                    started = time.perf_counter()
                    families = runtime.families()
                    assert families is not None
                    run_steps(text_steps(runtime.merge(families)))
                    render_ms.append((time.perf_counter() - started) * 1000)
                await runtime.stop()
        finally:
            gc.unfreeze()
            await llm.shutdown()
    polls = sum(p.polls for p in with_plugin)
    calls: Counter[str] = sum((p.calls for p in with_plugin), Counter())
    # Poll intervals the phases lasted: a paced poll spreads over its interval, so a phase
    # ends inside one; per interval counts that part too, per completed poll would not.
    intervals = sum(p.seconds for p in with_plugin) / args.poll_interval
    extra_cpu = sum(p.cpu_s for p in with_plugin) - sum(p.cpu_s for p in without)
    step_s, step_where = max(longest)
    ratios = [w.lag_p99 / wo.lag_p99 for wo, w in zip(without, with_plugin, strict=True)]
    client_us = client_cpu_s * 1e6 * sum(calls.values()) / intervals / size
    return {
        "step_ms": step_s * 1000,
        "step_where": step_where.removeprefix("exporter:"),
        **window_medians(windows),
        "p99_ratio": statistics.median(ratios),
        "p99_ratio_min": min(ratios),
        "p99_ratio_max": max(ratios),
        "pairs": len(ratios),
        "client_us_per_engine_interval": client_us,
        # Each surface is timed once a phase: the median over the phases, and the longest.
        **{f"{key}_ms": statistics.median(ms) for key, ms in surface_ms.items()},
        **{f"{key}_ms_max": max(ms) for key, ms in surface_ms.items()},
        "engines": size,
        "lag_p50_without": statistics.median(p.quantile(0.5) for p in without),
        "lag_p50_with": statistics.median(p.quantile(0.5) for p in with_plugin),
        "lag_p99_without": statistics.median(p.quantile(0.99) for p in without),
        "lag_p99_with": statistics.median(p.quantile(0.99) for p in with_plugin),
        "lag_max_without": max(max(p.lags_ms) for p in without),
        "lag_max_with": max(max(p.lags_ms) for p in with_plugin),
        "cpu_ms_per_poll": extra_cpu * 1000 / polls if polls else float("nan"),
        "cpu_us_per_engine": extra_cpu * 1e6 / polls / size if polls else float("nan"),
        "polls": polls,
        "calls_per_engine_interval": sum(calls.values()) / intervals / size,
        "calls_by_method": ", ".join(
            f"{method} {count / intervals / size:.2f}" for method, count in sorted(calls.items())
        ),
        "cpu_us_per_engine_interval": extra_cpu * 1e6 / intervals / size,
        "render_ms_p50": statistics.median(render_ms),
        "render_ms_max": max(render_ms),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plugin_loop", description=__doc__)
    p.add_argument("--sizes", default="2,8,64,256")
    p.add_argument("--phase-seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument("--engines-per-burst", type=int, default=None)
    p.add_argument("--out", default="docs/benchmarks/plugin-loop.md")
    p.add_argument("--quick", action="store_true", help="2 engines, 1 s phases, once")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.phase_seconds, args.repeats = "2", 1.0, 1
    sizes = [int(s) for s in args.sizes.split(",")]
    command = "python -m bench.plugin_loop" + (" " + " ".join(argv) if argv else "")

    async def run() -> list[dict[str, float]]:
        with tempfile.TemporaryDirectory(prefix="plugin-loop-") as tmp:
            return [await measure(size, args, Path(tmp)) for size in sizes]

    # vLLM's API server runs on uvloop (uvicorn's default where installed): the same here.
    text = report(eventloop.run(run(), "auto"), args, command)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
