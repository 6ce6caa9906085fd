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
``--out docs/benchmarks/plugin-loop.md`` (``-`` for stdout only), ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import engine_fleet, free_address
from bench.report_model import machine_lines
from bench.sim_vllm import start_sim_vllm
from exporter.base import eventloop
from exporter.inprocess.runtime import InProcessRuntime
from exporter.metrics.exposition import render_text

PROBE_S = 0.005


@dataclass
class Phase:
    lags_ms: list[float] = field(default_factory=list)
    cpu_s: float = 0.0
    seconds: float = 0.0
    polls: int = 0

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


async def phase(seconds: float, runtime: InProcessRuntime | None) -> Phase:
    polls_before = (
        runtime.exporter.poller.snapshot.poll_number if runtime and runtime.exporter else 0
    )
    cpu, wall = time.process_time(), time.perf_counter()
    lags = await probe(seconds)
    result = Phase(lags, time.process_time() - cpu, time.perf_counter() - wall)
    if runtime is not None and runtime.exporter is not None:
        result.polls = runtime.exporter.poller.snapshot.poll_number - polls_before
    return result


async def measure(size: int, args: argparse.Namespace, log_dir: Path) -> dict[str, float]:
    address = free_address()
    with engine_fleet(address, size, log_dir):
        llm = await start_sim_vllm(address, size)
        try:
            await llm.engine_core.wait_connected(120)
            without: list[Phase] = []
            with_plugin: list[Phase] = []
            render_ms: list[float] = []
            for _ in range(args.repeats):
                without.append(await phase(args.phase_seconds, None))
                env = {
                    "VLLM_DP_EXPORTER_POLL_INTERVAL": str(args.poll_interval),
                    "VLLM_DP_EXPORTER_CALL_TIMEOUT": "5",
                }
                runtime = InProcessRuntime(environ=env)
                await runtime.start(llm, None)
                assert runtime.exporter is not None, runtime.problem
                await asyncio.sleep(args.poll_interval)  # the first poll is not the steady state
                with_plugin.append(await phase(args.phase_seconds, runtime))
                for _ in range(20):
                    started = time.perf_counter()
                    families = runtime.families()
                    assert families is not None
                    render_text(runtime.merge(families))
                    render_ms.append((time.perf_counter() - started) * 1000)
                await runtime.stop()
        finally:
            await llm.shutdown()
    polls = sum(p.polls for p in with_plugin)
    extra_cpu = sum(p.cpu_s for p in with_plugin) - sum(p.cpu_s for p in without)
    return {
        "engines": size,
        "lag_p50_without": statistics.median(p.quantile(0.5) for p in without),
        "lag_p50_with": statistics.median(p.quantile(0.5) for p in with_plugin),
        "lag_p99_without": statistics.median(p.quantile(0.99) for p in without),
        "lag_p99_with": statistics.median(p.quantile(0.99) for p in with_plugin),
        "lag_max_without": max(max(p.lags_ms) for p in without),
        "lag_max_with": max(max(p.lags_ms) for p in with_plugin),
        "cpu_ms_per_poll": extra_cpu * 1000 / polls if polls else float("nan"),
        "polls": polls,
        "render_ms_p50": statistics.median(render_ms),
        "render_ms_max": max(render_ms),
    }


def report(rows: Sequence[dict[str, float]], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# The in-process exporter's cost on the event loop it shares with vLLM",
        "",
        f"Generated by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        "see `bench/plugin_loop.py` for the method. A simulated `AsyncLLM` (vLLM's engine-core "
        "semantics) in this process, its engines in other processes; a probe sleeps 5 ms "
        "again and again and records how late it wakes. Phases of "
        f"{args.phase_seconds:g} s alternate without and with the plugin's runtime polling every "
        f"{args.poll_interval:g} s, {args.repeats} of each per engine count; lags are the median "
        "over phases of each phase's quantile, the maximum over all phases.",
        "",
        *machine_lines(),
        "",
        "| engines | lag p50 without / with (ms) | lag p99 without / with (ms) | "
        "lag max without / with (ms) | CPU per poll (ms) | polls | "
        "`vllm_dp_*` render p50 / max (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['engines']:.0f} | {r['lag_p50_without']:.2f} / {r['lag_p50_with']:.2f} | "
            f"{r['lag_p99_without']:.2f} / {r['lag_p99_with']:.2f} | "
            f"{r['lag_max_without']:.1f} / {r['lag_max_with']:.1f} | "
            f"{r['cpu_ms_per_poll']:.2f} | {r['polls']:.0f} | "
            f"{r['render_ms_p50']:.2f} / {r['render_ms_max']:.2f} |"
        )
    lines += [
        "",
        "CPU per poll is this process's CPU time with the runtime minus without it, per "
        "completed poll (every read method on every engine: is_sleeping, is_scheduler_paused, "
        "get_weight_version, has_work; the snapshot, the history); "
        "it includes the simulated engine-core client's own work on the wire, which vLLM's "
        "client does in the real process. The lag's maximum with the runtime is the longest "
        "synchronous stretch of a poll (building and publishing its snapshot); noisy values "
        "at small sizes are within the machine's spread.",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plugin_loop", description=__doc__)
    p.add_argument("--sizes", default="2,8,64")
    p.add_argument("--phase-seconds", type=float, default=8.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--poll-interval", type=float, default=1.0)
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
    print(text)
    if args.out != "-":
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
