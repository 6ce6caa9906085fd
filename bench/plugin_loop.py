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

from bench.procs import engine_fleet, free_address
from bench.report_model import machine_lines, publish
from bench.sim_vllm import start_sim_vllm
from bench.steps import StepLog, timed_steps
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
    lags = await probe(seconds)
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
            without: list[Phase] = []
            with_plugin: list[Phase] = []
            render_ms: list[float] = []
            longest: list[tuple[float, str]] = []
            surface_ms: dict[str, float] = {}
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
                    steps.clear()
                    steps.recording = True
                    with_plugin.append(await phase(args.phase_seconds, runtime))
                    longest.append(steps.exporter_longest())
                    for key, seconds in (await surfaces(runtime, steps)).items():
                        surface_ms[key] = max(surface_ms.get(key, 0.0), seconds * 1000)
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
    return {
        "step_ms": step_s * 1000,
        "step_where": step_where.removeprefix("exporter:"),
        "series_step_ms": surface_ms["series"],
        "gate_step_ms": surface_ms["gate"],
        "status_ms": surface_ms["status"],
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


#: The in-process cost goals of #40 (docs/benchmarks/plugin-loop.md), checked at these sizes:
#: loop-lag p99 with the plugin at most ``P99_RATIO`` times without; each exporter step at most
#: ``STEP_MS`` of CPU; utility calls and this process's CPU per engine per poll interval at most
#: ``CALLS_PER_ENGINE`` and ``CPU_US_PER_ENGINE``.
GOAL_SIZES = (64, 256)
P99_RATIO, STEP_MS, CALLS_PER_ENGINE, CPU_US_PER_ENGINE = 1.5, 3.0, 3.0, 180.0


def goals(r: dict[str, Any]) -> list[tuple[str, bool]]:
    """Each in-process cost goal for one row: (what, holds)."""
    checks = [
        (
            f"lag p99 {r['lag_p99_with'] / r['lag_p99_without']:.2f}x of without (≤ {P99_RATIO}x)",
            r["lag_p99_with"] <= P99_RATIO * r["lag_p99_without"],
        ),
    ]
    for key, what in (
        ("step_ms", "poll"),
        ("series_step_ms", "/metrics"),
        ("gate_step_ms", "/dp/gate"),
        ("status_ms", "/dp/status"),
    ):
        checks.append(
            (f"{what} longest step {r[key]:.2f} ms (≤ {STEP_MS:g} ms)", r[key] <= STEP_MS)
        )
    checks.append(
        (
            f"utility calls per engine per poll interval {r['calls_per_engine_interval']:.2f} "
            f"({r['calls_by_method']}; ≤ {CALLS_PER_ENGINE:g})",
            r["calls_per_engine_interval"] <= CALLS_PER_ENGINE,
        )
    )
    checks.append(
        (
            f"CPU per engine per poll interval {r['cpu_us_per_engine_interval']:.0f} µs "
            f"(≤ {CPU_US_PER_ENGINE:g} µs)",
            r["cpu_us_per_engine_interval"] <= CPU_US_PER_ENGINE,
        )
    )
    return checks


def report(rows: Sequence[dict[str, Any]], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# The in-process exporter's cost on the event loop it shares with vLLM",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        "see `bench/plugin_loop.py` for the method. A simulated `AsyncLLM` (vLLM's engine-core "
        "semantics) in this process, its engines in other processes; a probe sleeps 5 ms "
        "again and again and records how late it wakes. Phases of "
        f"{args.phase_seconds:g} s alternate without and with the plugin's runtime polling every "
        f"{args.poll_interval:g} s ({_pacing(args)}), {args.repeats} of each per engine count; "
        "lags are the median "
        "over phases of each phase's quantile, the maximum over all phases. The heap is frozen "
        "after start-up, as vLLM's API server does (`freeze_gc_heap`).",
        "",
        *machine_lines(),
        "",
        "| engines | lag p50 without / with (ms) | lag p99 without / with (ms) | "
        "lag max without / with (ms) | CPU per poll (ms) | per engine (µs) | polls | "
        "calls per engine per interval | "
        "longest exporter step (ms CPU, where) | `/metrics` / `/dp/gate` / `/dp/status` "
        "longest step (ms CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engines']:.0f} | {r['lag_p50_without']:.2f} / {r['lag_p50_with']:.2f} | "
            f"{r['lag_p99_without']:.2f} / {r['lag_p99_with']:.2f} | "
            f"{r['lag_max_without']:.1f} / {r['lag_max_with']:.1f} | "
            f"{r['cpu_ms_per_poll']:.2f} | {r['cpu_us_per_engine']:.0f} | {r['polls']:.0f} | "
            f"{r['calls_per_engine_interval']:.2f} | "
            f"{r['step_ms']:.2f} (`{r['step_where']}`) | "
            f"{r['series_step_ms']:.2f} / {r['gate_step_ms']:.2f} / {r['status_ms']:.2f} |"
        )
    lines += ["", "## Goals", ""]
    for r in rows:
        if int(r["engines"]) not in GOAL_SIZES:
            continue
        for what, holds in goals(r):
            lines.append(
                f"- {r['engines']:.0f} engines: {what}: **{'holds' if holds else 'fails'}**"
            )
    lines += [
        "",
        "CPU per poll is this process's CPU time with the runtime minus without it, per "
        "completed poll (the read methods on every engine: is_sleeping, is_scheduler_paused, "
        "get_weight_version, and has_work where no count tells it (docs/activity.md, a "
        "listening poll); the snapshot, the history); calls per engine per poll are counted "
        "by the exporter's own call counter over the phases; it includes the simulated "
        "vLLM client's own work on the wire (encoding each call, one socket write, its output "
        "reader resolving the future), which vLLM's client does in the real process. A step is "
        "one uninterrupted run of one task on the loop, timed with the thread's CPU clock "
        "(`bench/steps.py`: the simulated engines share this machine's cores, so wall-clock "
        "stretches would count their time too); the exporter's steps are those of its own "
        "coroutines. The lag maximum is wall-clock and includes the machine's own spread.",
        "",
        "How the simulated client differs from vLLM's: it is the exporter's owner-mode "
        "transport under vLLM's per-call path (`bench/sim_vllm.py`, `SimWire`): the same "
        "msgpack encoding, one ZMQ write per call, futures kept in `utility_results` until the "
        "reply and popped by the output reader; vLLM's client adds its own request "
        "bookkeeping and runs its output reader on the same loop.",
        "",
    ]
    return "\n".join(lines)


def _pacing(args: argparse.Namespace) -> str:
    """How the runtime's polls read the engines (``--engines-per-burst``)."""
    if args.engines_per_burst is None:
        return "paced polls at the exporter's default engines per burst"
    if args.engines_per_burst == 0:
        return "every engine at once"
    return f"paced polls, {args.engines_per_burst} engines per burst"


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
