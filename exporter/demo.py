"""``vllm-dp-exporter demo``: the embedded default. Simulated engines in child processes (real
protocol, real sockets), the exporter serving against them, and a scripted story so every
metric moves within a minute: the fleet pauses, sleeps and wakes, one engine lags behind (an
inconsistency window), one engine refuses prefix-cache resets half of the time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import subprocess
import sys

import aiohttp

from exporter.config import ServeConfig, resolve_config
from exporter.ports import free_listen_port

log = logging.getLogger("exporter.demo")


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=int, default=4, help="number of simulated engines")
    p.add_argument(
        "--attach",
        choices=("owner", "http", "relay"),
        default="owner",
        help="owner: engines handshake with the exporter; http: simulated vLLM API servers; "
        "relay: a simulated vLLM front end with the exporter relaying its handshake",
    )
    p.add_argument("--listen", default="127.0.0.1:9400")
    p.add_argument("--admin-listen", default="127.0.0.1:9401")
    p.add_argument("--handshake-address", default=None, help="default: a free loopback port")
    p.add_argument("--poll-interval", type=float, default=1.0)
    p.add_argument("--call-timeout", type=float, default=1.0)
    p.add_argument("--story-period", type=float, default=40.0, help="seconds per story cycle")
    p.add_argument("--reset-every", type=float, default=5.0, help="seconds between demo resets")
    p.add_argument("--model-name", default=None)


def engine_groups(count: int, max_processes: int = 8) -> list[tuple[int, int]]:
    """(first index, engines) per child process: one engine per process up to 8, then groups."""
    size = max(1, math.ceil(count / max_processes))
    return [(start, min(size, count - start)) for start in range(0, count, size)]


def spawn_engines(handshake: str, count: int, story_period: float) -> list[subprocess.Popen[bytes]]:
    procs = []
    for first, n in engine_groups(count):
        cmd = [
            sys.executable,
            "-m",
            "exporter",
            "--log-level",
            "warning",
            "sim-engine",
            "--handshake-address",
            handshake,
            "--engine-index",
            str(first),
            "--engine-count",
            str(n),
            "--story-period",
            str(story_period),
            "--fleet-start",
            "0",
            "--fleet-size",
            str(count),
        ]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    return procs


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 3.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


async def reset_loop(admin_url: str, every_s: float) -> None:
    """The demo's trainer: a prefix-cache reset every few seconds, so reset metrics move."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            await asyncio.sleep(every_s)
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with session.post(f"{admin_url}/admin/reset_prefix_cache") as resp:
                    await resp.read()


async def run_demo_async(args: argparse.Namespace) -> int:
    handshake = args.handshake_address or f"tcp://127.0.0.1:{free_listen_port()}"
    config = resolve_config(
        None,
        attach="owner",
        engine_count=args.engines,
        handshake_address=handshake,
        listen=args.listen,
        admin_listen=args.admin_listen,
        poll_interval=args.poll_interval,
        call_timeout=args.call_timeout,
        reset_min_interval=0.0,
        model_name=args.model_name,
    )
    procs = spawn_engines(handshake, args.engines, args.story_period)
    headline = [f"vllm-dp-exporter demo: {args.engines} simulated engines on {handshake}"]
    try:
        await serve_demo(config, headline, args.reset_every)
    finally:
        await asyncio.to_thread(stop_processes, procs)
    return 0


async def serve_demo(
    config: ServeConfig,
    headline: list[str],
    reset_every: float,
    stop: asyncio.Event | None = None,
) -> None:
    """Print where to look, run the demo's reset loop, serve until stopped (every attach mode)."""
    from exporter.service import serve

    host, port = config.listen_host_port
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    lines = [
        *headline,
        f"  dashboard page  http://{shown}:{port}/",
        f"  metrics         http://{shown}:{port}/metrics",
        f"  status (JSON)   http://{shown}:{port}/status",
    ]
    tasks = []
    admin = config.admin_host_port
    if admin is not None:
        admin_url = f"http://{admin[0]}:{admin[1]}"
        lines.append(f"  admin reset     curl -X POST {admin_url}/admin/reset_prefix_cache")
        if reset_every > 0:
            tasks.append(asyncio.create_task(reset_loop(admin_url, reset_every)))
    print("\n".join(lines), flush=True)
    try:
        await serve(config, stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_demo(args: argparse.Namespace) -> int:
    if args.engines < 1:
        print("vllm-dp-exporter demo: --engines must be at least 1", file=sys.stderr)
        return 2
    common = (
        args.engines,
        args.listen,
        args.admin_listen,
        args.poll_interval,
        args.call_timeout,
        args.story_period,
    )
    if args.attach == "http":
        from exporter.sim.http_demo import run_http_demo

        return asyncio.run(
            run_http_demo(*common, reset_every=args.reset_every, model_name=args.model_name)
        )
    if args.attach == "relay":
        from exporter.sim.relay_demo import run_relay_demo

        return asyncio.run(
            run_relay_demo(*common, reset_every=args.reset_every, model_name=args.model_name)
        )
    return asyncio.run(run_demo_async(args))
