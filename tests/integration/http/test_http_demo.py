"""The HTTP demo: simulated API servers per node, the exporter with attach=http, a moving story."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from exporter.base.ports import free_listen_port
from exporter.commands.demo.common import DemoOptions
from exporter.commands.demo.http import node_sizes, run_http_demo
from tests.harness.apiservers import HOST


def test_node_sizes() -> None:
    assert node_sizes(1) == [1]
    assert node_sizes(2) == [1, 1]
    assert node_sizes(4) == [2, 1, 1]
    assert node_sizes(9) == [3, 3, 3]


async def test_http_demo_metrics_move() -> None:
    listen = f"{HOST}:{free_listen_port()}"
    stop = asyncio.Event()
    options = DemoOptions(
        engines=4,
        attach="http",
        listen=listen,
        admin_listen=f"{HOST}:{free_listen_port()}",
        poll_interval=0.1,
        call_timeout=0.5,
        story_period=2.0,
        reset_every=0.3,
    )
    demo = asyncio.create_task(run_http_demo(options, stop))
    seen: set[str] = set()
    engines: set[str] = set()
    resets = False
    deadline = time.monotonic() + 7
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while time.monotonic() < deadline and not (
                {"consistent", "inconsistent"} <= seen and resets
            ):
                await asyncio.sleep(0.1)
                assert not demo.done(), demo
                try:
                    async with session.get(f"http://{listen}/status") as resp:
                        status = await resp.json()
                    async with session.get(f"http://{listen}/metrics") as resp:
                        text = await resp.text()
                except aiohttp.ClientConnectionError:
                    continue
                seen.add(status["aggregate"]["is_sleeping"]["state"])
                engines.update(e["engine"] for e in status["engines"])
                resets = resets or "vllm_dp_prefix_cache_resets_total{" in text
    finally:
        stop.set()
        assert await asyncio.wait_for(demo, 5) == 0
    assert engines == {"node0", "node1", "node2"}
    assert {"consistent", "inconsistent"} <= seen
    assert resets
