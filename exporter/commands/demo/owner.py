"""``vllm-dp-exporter demo`` (``--attach owner``, the default): simulated headless engines in
child processes handshake with the exporter, which owns their start-up as in owner mode."""

from __future__ import annotations

import asyncio

from exporter.base.ports import free_listen_port
from exporter.commands.demo.common import (
    DemoOptions,
    demo_config,
    serve_demo,
    spawn_engines,
    stop_processes,
)


async def run_owner_demo(options: DemoOptions, stop: asyncio.Event | None = None) -> int:
    """Serve the exporter (attach=owner) against simulated engine processes until stopped."""
    handshake = options.handshake_address or f"tcp://127.0.0.1:{free_listen_port()}"
    config = demo_config(
        options, attach="owner", engine_count=options.engines, handshake_address=handshake
    )
    procs = spawn_engines(handshake, options.engines, options.story_period, options.vllm_version)
    headline = [f"vllm-dp-exporter demo: {options.engines} simulated engines on {handshake}"]
    try:
        await serve_demo(config, headline, options.reset_every, stop)
    finally:
        await asyncio.to_thread(stop_processes, procs)
    return 0
