"""``vllm-dp-exporter serve``: run ``create_app(config)`` until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import signal
import sys

from exporter.base import eventloop
from exporter.base.logs import configure_logging
from exporter.client.enginecore import SOCKET_ERRORS
from exporter.config.settings import ServeConfig, env_warnings, resolve_config, secret_file_warnings
from exporter.control.runtime import freeze_startup_heap
from exporter.error import ConfigError, ExporterError, StartupError
from exporter.web.app import start_service

log = logging.getLogger("exporter")


async def serve(
    config: ServeConfig, stop: asyncio.Event | None = None, *, freeze_heap: bool = False
) -> None:
    """Serve until ``stop`` is set (or SIGTERM/SIGINT arrives). A failure to start (a port in
    use, a host that cannot be bound) raises ``StartupError`` with a one-line message.
    ``freeze_heap``: ``freeze_startup_heap`` once listening (the ``serve`` command's process)."""
    stop = stop or asyncio.Event()
    log.debug("configuration: %r", config)  # secrets are repr=False: never logged
    for warning in secret_file_warnings(config):  # names the file and its mode, never the token
        log.warning("%s", warning)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    stacks_on_usr1(loop)
    try:
        service = await start_service(config)
    except BaseException:
        _remove_handlers(loop)
        raise
    try:
        tls = config.web is not None and config.web.ssl_context is not None
        # Logged once everything is bound: a failed start prints its one error line only.
        if freeze_heap:
            log.debug("heap frozen after start-up: %d objects", freeze_startup_heap())
        log.info(
            "serving /metrics on %s (attach=%s, event loop %s)",
            service.url,
            config.attach,
            eventloop.running_loop_name(),
        )
        if config.web is not None:
            log.info(
                "web config %s: TLS %s (client certificates: %s), basic auth %s",
                config.web.path,
                "on" if tls else "off",
                config.web.client_auth_type,
                "on" if config.web.users else "off",
            )
        if service.admin_url is not None:
            log.info("admin endpoint on %s", service.admin_url)
        await stop.wait()
        log.info("stopping")
    finally:
        await service.stop()
        _remove_handlers(loop)


def _remove_handlers(loop: asyncio.AbstractEventLoop) -> None:
    faulthandler.unregister(signal.SIGUSR1)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        loop.remove_signal_handler(sig)


def stacks_on_usr1(loop: asyncio.AbstractEventLoop) -> None:
    """``kill -USR1 PID``: every thread's Python stack on stderr, at once even while the loop
    is blocked (``faulthandler``), then every task of the loop with where it waits (a process
    that does not stop or answer says where it is, docs/runbooks.md). It keeps running."""

    def tasks() -> None:
        for task in asyncio.all_tasks(loop):
            print(f"Task {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
            task.print_stack(limit=12, file=sys.stderr)
        sys.stderr.flush()

    loop.add_signal_handler(signal.SIGUSR1, tasks)
    # Installed after the loop's handler, which it then calls (chain): threads first.
    try:
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    except (OSError, ValueError, AttributeError):  # a stderr without a file (embedded, tests)
        log.debug("no thread stacks on SIGUSR1: stderr has no file descriptor")


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
    # The config file and environment may set the log level and format too.
    configure_logging(config.log_level, config.log_format)
    try:
        eventloop.run(serve(config, freeze_heap=True), config.event_loop)
    except (ConfigError, StartupError) as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 2
    except SOCKET_ERRORS as exc:  # an engine-facing socket, outside start-up
        print(f"vllm-dp-exporter serve: ZMQ: {exc}", file=sys.stderr)
        return 1
    except (ExporterError, OSError) as exc:
        print(f"vllm-dp-exporter serve: {exc}", file=sys.stderr)
        return 1
    return 0
