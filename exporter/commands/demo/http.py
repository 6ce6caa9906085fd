"""``vllm-dp-exporter demo --attach http``: simulated vLLM API servers (one per "node") in this
process, and the exporter serving against their dev endpoints with ``--attach http``.

The engines behind the API servers run the demo story (``exporter.sim.story``) as one fleet, so
every metric moves: the fleet pauses, sleeps and wakes, the last engine lags behind (while it
does, its API server answers HTTP 500 "Engines returned different is_sleeping results" or the
nodes disagree), and the second engine refuses prefix-cache resets half of the time.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from exporter.commands.demo.common import (
    DEFAULT_VLLM_VERSION,
    DemoOptions,
    demo_config,
    serve_demo,
)
from exporter.sim.api_server import start_api_server
from exporter.sim.options import ApiServerOptions

MAX_NODES = 3


def node_sizes(engines: int, max_nodes: int = MAX_NODES) -> list[int]:
    """Engines per simulated node: up to ``max_nodes`` nodes, sizes as even as possible."""
    nodes = max(1, min(max_nodes, engines))
    base, extra = divmod(engines, nodes)
    return [base + (1 if i < extra else 0) for i in range(nodes)]


async def start_nodes(
    engines: int,
    story_period: float | None,
    host: str = "127.0.0.1",
    *,
    vllm_version: str = DEFAULT_VLLM_VERSION,
) -> tuple[list[web.AppRunner], list[str]]:
    """Start the simulated API servers of ``vllm_version`` (0.34: with the checkpoint routes);
    returns their runners and ``nodeN=URL`` targets."""
    runners: list[web.AppRunner] = []
    targets: list[str] = []
    offset = 0
    try:
        for i, size in enumerate(node_sizes(engines)):
            options = ApiServerOptions(
                engines=size,
                story_period_s=story_period,
                story_offset=offset,
                story_count=engines,
                vllm_version=vllm_version,
            )
            runner, url = await start_api_server(host, 0, options)
            runners.append(runner)
            targets.append(f"node{i}={url}")
            offset += size
    except BaseException:
        await stop_nodes(runners)
        raise
    return runners, targets


async def stop_nodes(runners: list[web.AppRunner]) -> None:
    for runner in runners:
        with contextlib.suppress(Exception):
            await runner.cleanup()


async def run_http_demo(options: DemoOptions, stop: asyncio.Event | None = None) -> int:
    """Serve the exporter (attach=http) against in-process simulated API servers until stopped.

    ``options.handshake_address`` is not used (there is no handshake in HTTP mode).
    """
    engines = options.engines
    runners, targets = await start_nodes(
        engines, options.story_period, vllm_version=options.vllm_version
    )
    try:
        config = demo_config(options, attach="http", http_target=tuple(targets))
        headline = [
            f"vllm-dp-exporter demo (attach http): {engines} simulated engines behind "
            f"{len(targets)} simulated vLLM API servers",
            *(f"  API server      {target}" for target in targets),
        ]
        await serve_demo(config, headline, options.reset_every, stop)
    finally:
        await stop_nodes(runners)
    return 0
