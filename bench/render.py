"""``python -m bench.render``: cost of one /metrics render, lean encoder vs prometheus_client,
and with garbage collection running vs paused.

The exporter renders /metrics once per state change (the render cache) with
``exporter.metrics.exposition.text_steps``, kept byte-identical to ``generate_latest`` by a test,
with garbage collection paused (``exporter.control.runtime.gc_paused``). This prints the costs per
render over a ``FakeFleet`` of 64, 256 and 1,024 engines after one poll, beside a heap of ~300k live
objects as a long-running process has: the measurements behind both decisions
(docs/architecture.md).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from prometheus_client.exposition import generate_latest

from bench.fleet import polled_exporter
from exporter.base.steps import run_steps
from exporter.control.runtime import gc_paused
from exporter.metrics.exposition import text_steps

SIZES = (64, 256, 1024)
ROUNDS = 20


def per_call_ms(fn: Callable[[], object], rounds: int = ROUNDS) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - started) / rounds * 1000


async def measure(sizes: tuple[int, ...] = SIZES) -> list[tuple[int, float, float, float]]:
    """(engines, text_steps ms, text_steps ms with gc paused, generate_latest ms) per size."""
    ballast = [{"i": i, "l": [i]} for i in range(300_000)]  # a long-running process's heap
    rows = []
    for n in sizes:
        exporter = await polled_exporter(n, lambda engine, method, args: False)
        lean = per_call_ms(lambda e=exporter: run_steps(text_steps(e.collector.families())))  # type: ignore[misc]
        with gc_paused():
            paused = per_call_ms(lambda e=exporter: run_steps(text_steps(e.collector.families())))  # type: ignore[misc]
        library = per_call_ms(lambda e=exporter: generate_latest(e.registry))  # type: ignore[misc]
        rows.append((n, lean, paused, library))
    del ballast
    return rows


def main() -> int:
    sizes = tuple(int(a) for a in sys.argv[1:]) or SIZES
    print("| engines | text_steps ms | same, gc paused | generate_latest ms | library / lean |")
    print("|---:|---:|---:|---:|---:|")
    for n, lean, paused, library in asyncio.run(measure(sizes)):
        print(f"| {n} | {lean:.2f} | {paused:.2f} | {library:.2f} | {library / lean:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
