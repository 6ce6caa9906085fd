"""``vllm-dp-exporter`` entry point: serve, demo, probe, sim-engine, ctl."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from exporter import __version__
from exporter.base.logs import (
    add_logging_arguments_everywhere,
    configure_logging,
    logging_settings,
)

__all__ = ["build_parser", "main"]


def _add_probe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("probe", help="own the handshake of N engines, query them once, print JSON")
    p.add_argument("--engine-count", type=int, required=True)
    p.add_argument("--handshake-address", required=True)
    p.add_argument("--start-rank", type=int, default=0)
    p.add_argument("--advertise-host", default="127.0.0.1")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--call-timeout", type=float, default=10.0)
    p.add_argument("--reset-prefix-cache", action="store_true")
    p.add_argument("--reset-running-requests", action="store_true")
    p.add_argument("--reset-connector", action="store_true")


def _add_sim_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim-engine", help="run simulated engines, as `vllm serve --headless`")
    p.add_argument("--handshake-address", required=True)
    p.add_argument("--engine-index", type=int, default=0, help="first engine index (DP rank)")
    p.add_argument("--engine-count", type=int, default=1, help="engines in this process")
    p.add_argument("--sleeping", action="store_true", help="start asleep")
    p.add_argument("--refuse-reset", action="store_true", help="reset_prefix_cache returns false")
    p.add_argument("--reply-delay", type=float, default=0.0, metavar="S")
    p.add_argument("--hang", action="store_true", help="never answer utility calls")
    p.add_argument("--dead-after-calls", type=int, metavar="N", help="ENGINE_CORE_DEAD after N")
    p.add_argument("--exit-after-calls", type=int, metavar="N", help="exit silently after N")
    p.add_argument("--shutdown-window", type=float, default=0.0, metavar="S")
    p.add_argument("--drain", type=float, default=0.0, metavar="S")
    p.add_argument("--no-pause-query", action="store_true", help="no is_scheduler_paused")
    p.add_argument("--vllm-version", default="0.33.0")
    p.add_argument("--no-sleep-mode", action="store_true")
    p.add_argument("--handshake-timeout", type=float, default=300.0)
    p.add_argument("--story-period", type=float, metavar="S", help="run the demo story")
    p.add_argument("--fleet-start", type=int, help="story: first index of the whole fleet")
    p.add_argument("--fleet-size", type=int, help="story: engines in the whole fleet")
    p.add_argument("--weight-version", help="get_weight_version's answer until one is set")
    p.add_argument(
        "--corrupt-param", metavar="NAME", help="compute_weight_checksums: NAME's digest differs"
    )
    p.add_argument(
        "--ignore-state-changes",
        action="store_true",
        help="sleep/wake_up/pause/resume/set_weight_version succeed but change nothing",
    )
    p.add_argument(
        "--missing-method",
        action="append",
        default=[],
        metavar="METHOD",
        help="answer METHOD with vLLM's 'has no attribute' failure (repeatable)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-dp-exporter",
        description="Per-engine sleep state, consistency and prefix-cache resets for vLLM DP.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_probe(sub)
    _add_sim_engine(sub)
    from exporter.commands.ctl import add_ctl_arguments
    from exporter.commands.demo import add_demo_arguments
    from exporter.config.settings import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="attach to the engines, poll, serve HTTP"))
    add_demo_arguments(sub.add_parser("demo", help="serve against simulated engines"))
    add_ctl_arguments(sub.add_parser("ctl", help="talk to a running exporter"))
    # --log-level/--log-format before the subcommand and on every subcommand (ctl's too).
    add_logging_arguments_everywhere(parser)
    return parser


def _run_probe(args: argparse.Namespace) -> int:
    from exporter.client.owner.transport import OwnerConfig
    from exporter.commands.probe import ProbeOptions, run_probe

    options = ProbeOptions(
        owner=OwnerConfig(
            handshake_address=args.handshake_address,
            engine_count=args.engine_count,
            start_rank=args.start_rank,
            advertise_host=args.advertise_host,
        ),
        ready_timeout_s=args.ready_timeout,
        call_timeout_s=args.call_timeout,
        reset_prefix_cache=args.reset_prefix_cache,
        reset_running_requests=args.reset_running_requests,
        reset_connector=args.reset_connector,
    )
    return asyncio.run(run_probe(options))


def _run_sim_engine(args: argparse.Namespace) -> int:
    from exporter.sim.host import make_engines, serve_engines
    from exporter.sim.options import SimOptions

    options = SimOptions(
        sleeping=args.sleeping,
        refuse_reset=args.refuse_reset,
        reply_delay_s=args.reply_delay,
        hang=args.hang,
        dead_after_calls=args.dead_after_calls,
        exit_after_calls=args.exit_after_calls,
        shutdown_window_s=args.shutdown_window,
        drain_s=args.drain,
        supports_pause_query=not args.no_pause_query,
        vllm_version=args.vllm_version,
        enable_sleep_mode=not args.no_sleep_mode,
        handshake_timeout_s=args.handshake_timeout,
        story_period_s=args.story_period,
        weight_version=args.weight_version,
        corrupt_param=args.corrupt_param,
        ignore_state_changes=args.ignore_state_changes,
        missing_methods=frozenset(args.missing_method),
    )
    indices = list(range(args.engine_index, args.engine_index + args.engine_count))

    async def run() -> int:
        engines = make_engines(
            args.handshake_address,
            indices,
            options,
            fleet_start=args.fleet_start,
            fleet_size=args.fleet_size,
        )
        return await serve_engines(engines)

    return asyncio.run(run())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        level, fmt = logging_settings(args, os.environ)
    except ValueError as exc:
        print(f"vllm-dp-exporter {args.command}: {exc}", file=sys.stderr)
        return 2
    configure_logging(level, fmt)
    try:
        if args.command == "probe":
            return _run_probe(args)
        if args.command == "sim-engine":
            return _run_sim_engine(args)
        if args.command == "serve":
            from exporter.commands.service import run_serve

            return run_serve(args)
        if args.command == "demo":
            from exporter.commands.demo import run_demo

            return run_demo(args)
        if args.command == "ctl":
            from exporter.commands.ctl import run_ctl

            return run_ctl(args)
    except KeyboardInterrupt:
        return 130
    parser.error(f"unknown command {args.command}")
    return 2
