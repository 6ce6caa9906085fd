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

from exporter.config import resolve_config
from exporter.demo import reset_loop, spawn_engines, stop_processes
from exporter.ports import free_listen_port
from exporter.service import serve
from exporter.sim.frontend import SimFrontend

log = logging.getLogger("exporter.demo")


async def _report_frontend(frontend: SimFrontend, every_s: float = 30.0) -> None:
    """Log now and then that the front end's own calls keep working beside the exporter's."""
    while True:
        await asyncio.sleep(every_s)
        unknown = frontend.errors.counts.get("unknown_call_id", 0)
        log.info(
            "simulated front end: %d engines connected, %d is_sleeping answers on slot 0, "
            "%d unknown call ids",
            frontend.client.connected_count(),
            frontend.ok_count(),
            unknown,
        )


async def run_relay_demo(
    engines: int,
    listen: str,
    admin_listen: str,
    poll_interval: float,
    call_timeout: float,
    story_period: float,
    *,
    reset_every: float = 5.0,
    model_name: str | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve the exporter (attach=relay) between a simulated front end and engines until stopped."""
    if engines < 1:
        raise ValueError("engines must be at least 1")
    frontend_address = f"tcp://127.0.0.1:{free_listen_port()}"
    relay_address = f"tcp://127.0.0.1:{free_listen_port()}"
    config = resolve_config(
        None,
        attach="relay",
        engine_count=engines,
        handshake_address=relay_address,
        upstream_handshake_address=frontend_address,
        listen=listen,
        admin_listen=admin_listen,
        poll_interval=poll_interval,
        call_timeout=call_timeout,
        reset_min_interval=0.0,
        model_name=model_name,
    )
    frontend = SimFrontend(
        frontend_address, engines, call_period_s=1.0, call_timeout_s=call_timeout
    )
    await frontend.start()
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(_report_frontend(frontend))]
    procs = spawn_engines(relay_address, engines, story_period)
    try:
        host, port = config.listen_host_port
        shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        print(
            f"vllm-dp-exporter demo (attach relay): {engines} simulated engines dial the "
            f"exporter's relay port {relay_address}",
            flush=True,
        )
        print(f"  front end       simulated, handshake at {frontend_address}", flush=True)
        print(f"  dashboard page  http://{shown}:{port}/", flush=True)
        print(f"  metrics         http://{shown}:{port}/metrics", flush=True)
        print(f"  status (JSON)   http://{shown}:{port}/status", flush=True)
        admin = config.admin_host_port
        if admin is not None:
            admin_url = f"http://{admin[0]}:{admin[1]}"
            print(
                f"  admin reset     curl -X POST {admin_url}/admin/reset_prefix_cache", flush=True
            )
            if reset_every > 0:
                tasks.append(asyncio.create_task(reset_loop(admin_url, reset_every)))
        await serve(config, stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(stop_processes, procs)
        with contextlib.suppress(Exception):
            await frontend.close()
    return 0
