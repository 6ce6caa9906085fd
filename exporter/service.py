"""``vllm-dp-exporter serve``: run ``create_app(config)`` until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import zmq
from aiohttp import web

from exporter.config import ServeConfig, env_warnings, resolve_config
from exporter.error import ConfigError, ExporterError
from exporter.httpguard import guarded_runner
from exporter.server import ADMIN_URL_KEY, StartupError, create_app

log = logging.getLogger("exporter")


async def serve(config: ServeConfig, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT arrives). A failure to start (a port in
    use, a host that cannot be bound) raises ``StartupError`` with a one-line message."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = create_app(config)
    runner = guarded_runner(app, access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()  # binds the engine-facing sockets and the admin listener
        host, port = config.listen_host_port
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            raise StartupError(f"--listen {config.listen}: {exc.strerror or exc}") from None
        # Logged once everything is bound: a failed start prints its one error line only.
        log.info("serving /metrics on http://%s:%d (attach=%s)", host, port, config.attach)
        if ADMIN_URL_KEY in app:
            log.info("admin endpoint on %s", app[ADMIN_URL_KEY])
        await stop.wait()
        log.info("stopping")
    finally:
        await runner.cleanup()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run_serve(args: argparse.Namespace) -> int:
    """Exit 2 with one line on stderr for a configuration that cannot start (bad settings,
    unreadable files, ports in use, hosts that cannot be bound); 1 for a later failure."""
    for warning in env_warnings():
        print(f"vllm-dp-exporter serve: warning: {warning}", file=sys.stderr)
    try:
        config = resolve_config(args)
    except ConfigError as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except (ConfigError, StartupError) as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 2
    except zmq.ZMQError as exc:  # an engine-facing socket, outside start-up
        print(f"vllm-dp-exporter serve: ZMQ: {exc}", file=sys.stderr)
        return 1
    except (ExporterError, OSError) as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 1
    return 0
