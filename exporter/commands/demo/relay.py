"""``vllm-dp-exporter demo --attach relay``: a simulated stock vLLM front end, the exporter in
relay mode between it and the engines, and simulated headless engines in child processes.

The engines dial the exporter's relay port; the exporter relays each handshake to the simulated
front end, appending its own client slot. The front end then calls ``is_sleeping`` on its own
slot every second while the exporter polls on its slot, and the engines run the demo story
(``exporter.sim.story``) so every metric moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from exporter.base.ports import free_listen_port
from exporter.client.fleet import connected_count
from exporter.commands.demo.common import (
    DemoOptions,
    demo_config,
    serve_demo,
    spawn_engines,
    stop_processes,
)
from exporter.sim.frontend import SimFrontend

log = logging.getLogger("exporter.demo")


async def _report_frontend(frontend: SimFrontend, every_s: float = 30.0) -> None:
    """Log now and then that the front end's own calls keep working beside the exporter's."""
    while True:
        await asyncio.sleep(every_s)
        unknown = frontend.faults.counts.get("unknown_call_id", 0)
        log.info(
            "simulated front end: %d engines connected, %d is_sleeping answers on slot 0, "
            "%d unknown call ids",
            connected_count(frontend.client),
            frontend.ok_count(),
            unknown,
        )


async def run_relay_demo(options: DemoOptions, stop: asyncio.Event | None = None) -> int:
    """Serve the exporter (attach=relay) between a simulated front end and engines until stopped.

    ``options.handshake_address`` is not used: the relay and front end ports are free ones.
    """
    engines = options.engines
    frontend_address = f"tcp://127.0.0.1:{free_listen_port()}"
    relay_address = f"tcp://127.0.0.1:{free_listen_port()}"
    config = demo_config(
        options,
        attach="relay",
        engine_count=engines,
        handshake_address=relay_address,
        upstream_handshake_address=frontend_address,
    )
    frontend = SimFrontend(
        frontend_address, engines, call_period_s=1.0, call_timeout_s=options.call_timeout
    )
    await frontend.start()
    reporter = asyncio.create_task(_report_frontend(frontend))
    procs = spawn_engines(relay_address, engines, options.story_period, options.vllm_version)
    try:
        headline = [
            f"vllm-dp-exporter demo (attach relay): {engines} simulated engines dial the "
            f"exporter's relay port {relay_address}",
            f"  front end       simulated, handshake at {frontend_address}",
        ]
        await serve_demo(config, headline, options.reset_every, stop)
    finally:
        reporter.cancel()
        await asyncio.gather(reporter, return_exceptions=True)
        await asyncio.to_thread(stop_processes, procs)
        with contextlib.suppress(Exception):
            await frontend.close()
    return 0
