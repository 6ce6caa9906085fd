"""The status page's cost (docs/status.md): render time of ``GET /`` and ``GET /status`` and their
body sizes at 64 and 256 engines, in process over a ``FakeFleet`` (no sockets: the render is
what the listener pays per request; neither body is cached).

The fleet is in the heaviest state the page shows: inconsistent weight versions (every engine
named in the banner), one engine timing out, a full hour of history (120 buckets) and a last
admin action naming every engine.

``python -m bench.statuspage [--sizes 64,256]`` prints the Markdown section by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.fleet import polled_exporter
from exporter.base.steps import run_steps
from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.runtime import Exporter
from exporter.web.statusdoc import status_steps
from exporter.web.statuspage import page_steps

SIZES = (64, 256)
HEADING = "## Status page (`GET /`, `GET /status`)"


@dataclass(frozen=True)
class PageResult:
    engines: int
    status_ms: float
    page_ms: float
    status_bytes: int
    page_bytes: int


def _handler(engine: str, method: str, args: tuple[Any, ...]) -> Any:
    if engine == "1":
        return EngineOutcome(engine, Outcome.TIMEOUT, error="no answer within 1.0s")
    if method == "get_weight_version":
        return f"step-{int(engine) % 2}"
    return False


async def _exporter(n: int) -> Exporter:
    logging.getLogger("exporter.poller").setLevel(logging.ERROR)  # the inconsistency warning
    exporter = await polled_exporter(n, _handler, model_name="bench-model")
    now = time.time()
    history = exporter.poller.history
    for i in range(history.capacity, 0, -1):
        history.record(now - i * history.bucket_s, {"is_sleeping": "consistent"}, n, n)
    engines = [
        {"engine": i, "ok": i != 1, "reason": None if i != 1 else "timeout", "error": None}
        for i in range(n)
    ]
    body = {"outcome": "partial_failure", "params": {"mode": "abort"}, "engines": engines}
    exporter.stats.record_last_action("pause", 502, body)
    return exporter


def _median_ms(fn: Any, iterations: int) -> float:
    times = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def measure(n: int, iterations: int = 50) -> PageResult:
    exporter = asyncio.run(_exporter(n))
    poller, config, stats = exporter.poller, exporter.config, exporter.stats

    def status_body() -> bytes:
        # What web.json_response does: the document, then json.dumps.
        doc = run_steps(status_steps(poller.snapshot, config, stats, poller.history))
        return json.dumps(doc).encode()

    def page_body() -> bytes:
        doc = run_steps(status_steps(poller.snapshot, config, stats, poller.history))
        return run_steps(page_steps(doc)).encode()

    return PageResult(
        n,
        _median_ms(status_body, iterations),
        _median_ms(page_body, iterations),
        len(status_body()),
        len(page_body()),
    )


def run_statuspage(sizes: Sequence[int] = SIZES, iterations: int = 50) -> list[PageResult]:
    return [measure(n, iterations) for n in sizes]


def section(results: Sequence[PageResult], iterations: int = 50) -> list[str]:
    """The Markdown section of docs/benchmarks/README.md."""
    out = [
        HEADING,
        "",
        "Served from the metrics listener on every request (neither is cached). Median of "
        f"{iterations} renders in process, the fleet in its heaviest state: every engine "
        "named in an inconsistent banner, one engine timing out, a full hour of history, "
        "a last action naming every engine.",
        "",
        "| engines | `/status` render | `/status` body | `/` render | `/` body |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        out.append(
            f"| {r.engines} | {r.status_ms:.2f} ms | {r.status_bytes / 1024:.1f} KiB "
            f"| {r.page_ms:.2f} ms | {r.page_bytes / 1024:.1f} KiB |"
        )
    return [*out, ""]


def bench_section(quick: bool, errors: list[str]) -> list[str]:
    """The section for ``make bench`` (5 renders per size with ``--quick``); a failure is
    appended to ``errors`` and gives no section."""
    try:
        iterations = 5 if quick else 50
        return section(run_statuspage(SIZES, iterations), iterations)
    except Exception as exc:
        errors.append(f"status page: {exc!r}")
        return []


def insert_section(report: str, lines: Sequence[str]) -> str:
    """``report`` with the section before its embedded results (or at its end)."""
    marker = "\n<!-- bench-results: "
    at = report.rfind(marker)
    text = "\n".join(lines).rstrip() + "\n"
    if at < 0:
        return report.rstrip() + "\n\n" + text
    return report[:at].rstrip() + "\n\n" + text + report[at:]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.statuspage", description=__doc__)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--iterations", type=int, default=50)
    args = p.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    print("\n".join(section(run_statuspage(sizes, args.iterations), args.iterations)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
