"""Run many simulated engines in one process (one event loop, separate sockets per engine)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal

import zmq.asyncio

from exporter.sim.engine import SimEngine, SimStartupError
from exporter.sim.options import SimOptions

log = logging.getLogger("exporter.sim")


def make_engines(
    handshake_address: str,
    indices: list[int],
    options: SimOptions,
    context: zmq.asyncio.Context | None = None,
    *,
    fleet_start: int | None = None,
    fleet_size: int | None = None,
) -> list[SimEngine]:
    """One engine per index, each with its own copy of ``options`` and its position in the
    story of the whole fleet (which may span several processes: ``fleet_start``/``fleet_size``)."""
    start = indices[0] if fleet_start is None and indices else (fleet_start or 0)
    size = len(indices) if fleet_size is None else fleet_size
    engines = []
    for index in indices:
        opts = dataclasses.replace(options, story_offset=index - start, story_count=size)
        engines.append(SimEngine(handshake_address, index, opts, context=context))
    return engines


async def serve_engines(engines: list[SimEngine], *, handle_signals: bool = True) -> int:
    """Run until every engine exits; SIGTERM/SIGINT stop them gracefully. Returns an exit code."""
    loop = asyncio.get_running_loop()

    def stop_all() -> None:
        for engine in engines:
            engine.stop()

    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop_all)
    results = await asyncio.gather(*(e.run() for e in engines), return_exceptions=True)
    code = 0
    for engine, result in zip(engines, results, strict=True):
        if isinstance(result, SimStartupError):
            log.error("engine %d: %s", engine.engine_index, result)
            code = 1
        elif isinstance(result, BaseException):
            log.error("engine %d crashed: %r", engine.engine_index, result)
            code = 1
        else:
            log.info("engine %d exited: %s", engine.engine_index, result)
    return code
