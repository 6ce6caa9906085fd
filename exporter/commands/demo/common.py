"""What every attach mode of the demo shares: its options, the command line, the simulated
engine processes, the demo's reset loop and serving the exporter with the "where to look" lines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import aiohttp

from exporter.config.settings import ServeConfig, resolve_config

log = logging.getLogger("exporter.demo")

ATTACH_MODES = ("owner", "http", "relay")


@dataclass(frozen=True)
class DemoOptions:
    """``vllm-dp-exporter demo`` flags (the defaults are the flags' defaults)."""

    engines: int = 4
    attach: str = "owner"
    listen: str = "127.0.0.1:19400"
    admin_listen: str = "127.0.0.1:19401"
    handshake_address: str | None = None  # owner mode; None: a free loopback port
    poll_interval: float = 1.0
    call_timeout: float = 1.0
    story_period: float = 40.0  # seconds per story cycle
    reset_every: float = 5.0  # seconds between demo resets; 0: none
    model_name: str | None = None

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be at least 1")
        if self.attach not in ATTACH_MODES:
            raise ValueError(f"attach must be one of {', '.join(ATTACH_MODES)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DemoOptions:
        """From the flags of :func:`add_demo_arguments` (raises ValueError like the constructor)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


_DEFAULTS = DemoOptions()


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("--engines", type=int, default=d.engines, help="number of simulated engines")
    p.add_argument(
        "--attach",
        choices=ATTACH_MODES,
        default=d.attach,
        help="owner: engines handshake with the exporter; http: simulated vLLM API servers; "
        "relay: a simulated vLLM front end with the exporter relaying its handshake",
    )
    p.add_argument("--listen", default=d.listen)
    p.add_argument("--admin-listen", default=d.admin_listen)
    p.add_argument("--handshake-address", default=None, help="default: a free loopback port")
    p.add_argument("--poll-interval", type=float, default=d.poll_interval)
    p.add_argument("--call-timeout", type=float, default=d.call_timeout)
    p.add_argument(
        "--story-period", type=float, default=d.story_period, help="seconds per story cycle"
    )
    p.add_argument(
        "--reset-every", type=float, default=d.reset_every, help="seconds between demo resets"
    )
    p.add_argument("--model-name", default=None)


def engine_groups(count: int, max_processes: int = 8) -> list[tuple[int, int]]:
    """(first index, engines) per child process: one engine per process up to 8, then groups."""
    size = max(1, math.ceil(count / max_processes))
    return [(start, min(size, count - start)) for start in range(0, count, size)]


def spawn_engines(handshake: str, count: int, story_period: float) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` simulated engines (``sim-engine`` child processes) dialing ``handshake``,
    all running the demo story as one fleet."""
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


#: Every this many demo resets the demo's trainer also publishes a new weight version and
#: verifies the weights across ranks, so the weight-version and admin-action panels move.
WEIGHT_UPDATE_EVERY = 4


async def _post(session: aiohttp.ClientSession, url: str, **kwargs: Any) -> int | None:
    """POST, read the answer, and its status (None when the exporter did not answer)."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.post(url, **kwargs) as resp:
            await resp.read()
            return resp.status
    return None


async def reset_loop(admin_url: str, every_s: float) -> None:
    """The demo's trainer: a prefix-cache reset every few seconds, and after the first reset
    that reached the engines and then every ``WEIGHT_UPDATE_EVERY``-th, a new weight version
    and a verification of the weights across ranks, so the reset, weight-version and action
    metrics move. Relay mode refuses the weight version (403: a state change beside the front
    end); the loop stops asking then."""
    timeout = aiohttp.ClientTimeout(total=10)
    set_versions = True
    updates = 0
    since_update = WEIGHT_UPDATE_EVERY
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            await asyncio.sleep(every_s)
            status = await _post(session, f"{admin_url}/admin/reset_prefix_cache")
            since_update += 1
            if status not in (200, 502) or since_update < WEIGHT_UPDATE_EVERY:
                continue  # 503: no engine connected yet
            since_update = 0
            updates += 1
            if set_versions:
                version = {"weight_version": f"demo-{updates}"}
                status = await _post(session, f"{admin_url}/admin/weight_version", json=version)
                set_versions = status != 403
            await _post(session, f"{admin_url}/admin/verify_weights")


async def serve_demo(
    config: ServeConfig,
    headline: list[str],
    reset_every: float,
    stop: asyncio.Event | None = None,
) -> None:
    """Print where to look, run the demo's reset loop, serve until stopped (every attach mode)."""
    from exporter.commands.service import serve

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


def demo_config(options: DemoOptions, **attach: Any) -> ServeConfig:
    """The exporter's config for a demo: the options' listeners and timings, resets as often
    as the demo asks, and the attach mode's own settings (``attach``)."""
    return resolve_config(
        None,
        listen=options.listen,
        admin_listen=options.admin_listen,
        poll_interval=options.poll_interval,
        call_timeout=options.call_timeout,
        reset_min_interval=0.0,
        model_name=options.model_name,
        **attach,
    )
