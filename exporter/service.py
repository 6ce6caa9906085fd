"""``vllm-dp-exporter serve``: run ``create_app(config)`` until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from aiohttp import web

from exporter.config import ServeConfig, resolve_config
from exporter.error import ConfigError, ExporterError
from exporter.httpguard import guarded_runner
from exporter.server import create_app

log = logging.getLogger("exporter")


async def serve(config: ServeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT arrives)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(config)
    runner = guarded_runner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    host, port = config.listen_host_port
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("serving /metrics on http://%s:%d (attach=%s)", host, port, config.attach)
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (ExporterError, OSError) as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 1
    return 0
