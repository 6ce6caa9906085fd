"""``vllm-dp-exporter demo``: the embedded default. Simulated engines (real protocol, real
sockets), the exporter serving against them, and a scripted story so every metric moves within a
minute: the fleet pauses, sleeps and wakes, one engine lags behind (an inconsistency window), one
engine refuses prefix-cache resets half of the time.

``common`` holds the options and what every attach mode shares; ``owner``, ``relay`` and
``http`` run one attach mode each (imported only when that mode runs).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from exporter.base import eventloop
from exporter.commands.demo.common import DemoOptions, add_demo_arguments
from exporter.error import ExporterError

__all__ = ["add_demo_arguments", "run_demo", "run_demo_async"]


async def run_demo_async(options: DemoOptions, stop: asyncio.Event | None = None) -> int:
    """Run the demo in ``options.attach`` mode until ``stop`` is set (or cancelled)."""
    if options.attach == "http":
        from exporter.commands.demo.http import run_http_demo

        return await run_http_demo(options, stop)
    if options.attach == "relay":
        from exporter.commands.demo.relay import run_relay_demo

        return await run_relay_demo(options, stop)
    from exporter.commands.demo.owner import run_owner_demo

    return await run_owner_demo(options, stop)


def run_demo(args: argparse.Namespace) -> int:
    """``vllm-dp-exporter demo``: exit code 2 for a bad fleet size or a setting that cannot
    be used (a web config or token file, as ``serve`` says it), else 0 once stopped."""
    if args.engines < 1:
        print("vllm-dp-exporter demo: --engines must be at least 1", file=sys.stderr)
        return 2
    try:
        return eventloop.run(run_demo_async(DemoOptions.from_args(args)))
    except ExporterError as exc:  # ConfigError, StartupError: one line, no traceback
        print(f"vllm-dp-exporter demo: {exc}", file=sys.stderr)
        return 2
