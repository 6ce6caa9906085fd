"""``python -m bench.loops``: the exporter's CPU per aggregated call on uvloop against the stdlib
loop, the floor beside each (table 1 of ``make bench``, repeated, alternating the loops).

One ``make bench`` run cannot tell the loops apart: a shared machine moves the exporter/floor
ratio by more than the loops differ. This runs the latency measurement of ``bench.inprocess``
``--repeats`` times per loop, alternating them (asyncio, uvloop, uvloop, asyncio, ...), each
against fresh engine processes, and reports the median ratio per loop.

Options: ``--engines 64`` (fleet size), ``--repeats 3``, ``--calls 300``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.inprocess import Plan, measure_size
from bench.procs import engine_processes_for
from exporter.base import eventloop

LOOPS = ("asyncio", "uvloop")


def order(repeats: int) -> list[str]:
    """asyncio, uvloop, uvloop, asyncio, asyncio, uvloop, ...: neither loop always goes first."""
    out: list[str] = []
    for r in range(repeats):
        out += list(LOOPS if r % 2 == 0 else reversed(LOOPS))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.loops", description=__doc__)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=300)
    args = p.parse_args(argv)
    n = args.engines
    plan = Plan(latency_calls=lambda _: args.calls, scrape_sizes=frozenset(), profile_size=None)
    ratios: dict[str, list[float]] = {kind: [] for kind in LOOPS}
    cpu: dict[str, list[float]] = {kind: [] for kind in LOOPS}
    print(f"| run | loop | exporter CPU/call | floor CPU/call | ratio |  (N={n})")
    print("|---:|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-loops-") as logs:
        for run, kind in enumerate(order(args.repeats), 1):
            result = eventloop.run(measure_size(n, engine_processes_for(n), plan, Path(logs)), kind)
            lat = result.latency
            ratio = lat.exporter_cpu_per_call / lat.floor_cpu_per_call
            ratios[kind].append(ratio)
            cpu[kind].append(lat.exporter_cpu_per_call)
            print(
                f"| {run} | {kind} | {lat.exporter_cpu_per_call * 1e6:,.0f} µs "
                f"| {lat.floor_cpu_per_call * 1e6:,.0f} µs | {ratio:.2f}x |",
                flush=True,
            )
    print()
    print("| loop | median exporter/floor CPU ratio | median exporter CPU/call |")
    print("|---|---:|---:|")
    for kind in LOOPS:
        print(
            f"| {kind} | {statistics.median(ratios[kind]):.2f}x "
            f"| {statistics.median(cpu[kind]) * 1e6:,.0f} µs |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
