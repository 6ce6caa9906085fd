"""``python -m bench.run``: run the benchmarks and write docs/benchmarks/README.md.

Options: ``--quick`` (tiny smoke configuration, seconds), ``--out PATH`` (default
docs/benchmarks/README.md), ``--sizes 1,8,64,256,1024`` (engine counts for the in-process tables),
``--log-dir DIR`` (engine/serve logs; default a temporary directory), ``--skip-service``
(in-process tables only), ``--compare PATH`` (an earlier report, which may be the ``--out`` file
itself: adds a before/after table from the results embedded at the end of that report),
``--skip-flood`` (no output-address flood section), ``--flood-seconds S`` (default 20, 2 with
``--quick``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from bench.flood import run_flood
from bench.inprocess import Plan, measure_size
from bench.procs import engine_processes_for
from bench.report import Report, machine_lines, read_baseline, render
from bench.service import flapping_memory, serve_cpu_and_admin, serve_rss
from bench.statuspage import bench_section, insert_section
from exporter.base import eventloop

DEFAULT_SIZES = (1, 8, 64, 256, 1024)
QUICK_SIZES = (1, 2)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny configuration (smoke test)")
    p.add_argument("--out", default="docs/benchmarks/README.md", help="Markdown report path")
    p.add_argument("--sizes", help="comma-separated engine counts (default 1,8,64,256,1024)")
    p.add_argument("--log-dir", help="directory for engine and serve logs")
    p.add_argument("--skip-service", action="store_true", help="only the in-process tables")
    p.add_argument(
        "--compare",
        metavar="PATH",
        help="an earlier report (may be the --out file): add a before/after table",
    )
    p.add_argument("--skip-flood", action="store_true", help="no output-address flood section")
    p.add_argument(
        "--event-loop",
        default="auto",
        type=eventloop.event_loop_value,
        help="loop of the in-process tables 1-3: auto (uvloop when installed, as `serve`), "
        "uvloop or asyncio; `serve` subprocesses keep their default",
    )
    p.add_argument(
        "--flood-seconds",
        type=float,
        metavar="S",
        help="length of the output-address flood (default 20, 2 with --quick)",
    )
    return p.parse_args(argv)


def _sizes(text: str | None, quick: bool) -> list[int]:
    if text:
        sizes = sorted({int(x) for x in text.replace(" ", "").split(",") if x})
        if not sizes or min(sizes) < 1:
            raise SystemExit("--sizes: positive integers, comma-separated")
        return sizes
    return list(QUICK_SIZES if quick else DEFAULT_SIZES)


def make_plan(sizes: list[int], quick: bool) -> Plan:
    if quick:
        return Plan(
            latency_calls=lambda n: 20,
            warmup=2,
            rounds=2,
            poll_count=lambda n: 10,
            scrape_iterations=lambda n: 20,
            scrape_sizes=frozenset(sizes),
            profile_size=sizes[-1],
            connect_timeout_s=30.0,
        )
    wanted = frozenset({8, 64, 256, 1024}) & frozenset(sizes) or frozenset(sizes)
    return Plan(
        latency_calls=lambda n: 300 if n <= 64 else 100,
        poll_count=lambda n: 200 if n <= 64 else (50 if n <= 256 else 20),
        scrape_iterations=lambda n: 500 if n <= 64 else (200 if n <= 256 else 50),
        scrape_sizes=wanted,
        profile_size=64 if 64 in sizes else sizes[-1],
    )


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, log_dir: Path) -> Report:
    started = time.monotonic()
    quick = args.quick
    sizes = _sizes(args.sizes, quick)
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    report = Report(
        command=f"{Path(sys.executable).name} -m bench.run {argv}".rstrip()
        + ("" if argv else "    # = make bench"),
        quick=quick,
        machine=machine_lines(args.event_loop),
    )
    plan = make_plan(sizes, quick)
    for n in sizes:
        processes = engine_processes_for(n)
        _log(f"in-process: N={n} ({processes} engine processes per side)")
        try:
            # By default on the loop `serve` runs on (uvloop when installed).
            measured = eventloop.run(measure_size(n, processes, plan, log_dir), args.event_loop)
            report.sizes.append(measured)
        except Exception as exc:
            report.errors.append(f"in-process N={n}: {exc!r}")
            traceback.print_exc()
    if not args.skip_service:
        big = max(sizes)
        cpu_n = big if quick else (64 if 64 in sizes else big)
        _log(f"serve: CPU share and admin resets, N={cpu_n}")
        try:
            report.serve_cpu, report.admin = serve_cpu_and_admin(
                cpu_n,
                2.0 if quick else 30.0,
                10 if quick else 200,
                log_dir,
                poll_interval=0.25 if quick else 1.0,
            )
        except Exception as exc:
            report.errors.append(f"serve CPU/admin: {exc!r}")
            traceback.print_exc()
        for n in [big] if quick else sorted({s for s in sizes if s >= 64} or {big}):
            _log(f"serve: RSS, N={n}")
            try:
                report.rss.append(
                    serve_rss(
                        n, log_dir, polls=2 if quick else 5, poll_interval=0.25 if quick else 1.0
                    )
                )
            except Exception as exc:
                report.errors.append(f"serve RSS N={n}: {exc!r}")
                traceback.print_exc()
        _log("serve: flapping engine memory")
        try:
            report.flap = flapping_memory(
                2 if quick else 8,
                [50, 150] if quick else [100, 1000, 2500, 5000, 7500, 10000],
                log_dir,
                poll_interval=0.005,
                timeout_s=30.0 if quick else 420.0,
            )
        except Exception as exc:
            report.errors.append(f"flapping memory: {exc!r}")
            traceback.print_exc()
    if not args.skip_flood:
        seconds = args.flood_seconds or (2.0 if quick else 20.0)
        _log(f"serve: output-address flood, {seconds:g} s")
        try:
            report.flood = run_flood(seconds, log_dir)
        except Exception as exc:
            report.errors.append(f"flood: {exc!r}")
            traceback.print_exc()
    report.elapsed_s = time.monotonic() - started
    report.load_end = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    baseline = read_baseline(Path(args.compare)) if args.compare else None
    if args.compare and baseline is None:
        _log(f"--compare {args.compare}: no embedded results found; no before/after table")
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as tmp:
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        report = run(args, log_dir)
        report.baseline, report.baseline_source = baseline, args.compare or ""
        out.parent.mkdir(parents=True, exist_ok=True)
        _log("status page: render time and size, N=64 and 256")
        page = bench_section(args.quick, report.errors)
        out.write_text(insert_section(render(report), page))
        _log(f"wrote {out} in {report.elapsed_s:.0f} s")
        if report.errors:
            for line in report.errors:
                _log(f"error: {line}")
            if not args.log_dir:
                _log("re-run with --log-dir DIR to keep the engine and serve logs")
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
