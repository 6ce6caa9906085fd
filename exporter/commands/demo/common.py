"""What every attach mode of the demo shares: its options, the command line, the simulated
engine processes, the demo's reset loop and serving the exporter with the "where to look" lines.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import re
import subprocess
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from exporter.base.ports import url_host
from exporter.config.settings import ServeConfig, resolve_config
from exporter.remote import ActionResult, Client, Credentials, RemoteError, Secret

log = logging.getLogger("exporter.demo")

ATTACH_MODES = ("owner", "http", "relay")
#: The release the simulated engines (and API servers) imitate by default: the simulation's
#: own (``SimOptions.vllm_version``). From 0.34 on they have the process-checkpoint lifecycle.
DEFAULT_VLLM_VERSION = "0.33.0"
_VERSION = re.compile(r"\d+\.\d+(\.\d+)?([.+\-]?[0-9A-Za-z.+\-]{0,32})?")


def release_arg(raw: str) -> str:
    """``--vllm-version``: a release as vLLM names one (``0.34.0``, ``0.34.0rc1``), else
    argparse's error (exit 2), not a fleet that silently imitates no release."""
    if not _VERSION.fullmatch(raw):
        raise argparse.ArgumentTypeError(f"not a vLLM release: {raw[:64]!r} (e.g. 0.34.0)")
    return raw


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
    #: ``serve --web-config-file``: TLS and basic auth on both listeners (docs/security.md).
    web_config_file: str | None = None
    #: ``serve --admin-token-file``: the admin listener's bearer token.
    admin_token_file: str | None = None
    #: The vLLM release the engines imitate (0.34: the checkpoint lifecycle and its routes).
    vllm_version: str = DEFAULT_VLLM_VERSION

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError("engines must be at least 1")
        if self.attach not in ATTACH_MODES:
            raise ValueError(f"attach must be one of {', '.join(ATTACH_MODES)}")
        if not _VERSION.fullmatch(self.vllm_version):
            raise ValueError(f"vllm_version is not a vLLM release: {self.vllm_version[:64]!r}")

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
        "--story-period",
        type=float,
        default=d.story_period,
        help="seconds per story cycle (0: no story; the engines change only when asked)",
    )
    p.add_argument(
        "--reset-every",
        type=float,
        default=d.reset_every,
        help="seconds between the demo's own resets (0: none)",
    )
    p.add_argument("--model-name", default=None)
    p.add_argument(
        "--web-config-file",
        default=None,
        metavar="FILE",
        help="serve TLS and basic auth from this exporter-toolkit web config (docs/security.md)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        metavar="FILE",
        help="the admin listener's bearer token (the demo's own resets use it too)",
    )
    p.add_argument(
        "--vllm-version",
        type=release_arg,
        default=d.vllm_version,
        metavar="VERSION",
        help="the vLLM release the simulated engines imitate (default %(default)s; 0.34.0: "
        "the process-checkpoint lifecycle, ctl checkpoint and the CHECKPOINT column)",
    )


def engine_groups(count: int, max_processes: int = 8) -> list[tuple[int, int]]:
    """(first index, engines) per child process: one engine per process up to 8, then groups."""
    size = max(1, math.ceil(count / max_processes))
    return [(start, min(size, count - start)) for start in range(0, count, size)]


def spawn_engines(
    handshake: str,
    count: int,
    story_period: float,
    vllm_version: str = DEFAULT_VLLM_VERSION,
) -> list[subprocess.Popen[bytes]]:
    """Start ``count`` simulated engines (``sim-engine`` child processes) of ``vllm_version``
    dialing ``handshake``, all running the demo story as one fleet."""
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
            "--vllm-version",
            vllm_version,
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


async def _status_of(call: Awaitable[ActionResult]) -> int | None:
    """The HTTP status an action was answered with (None when the exporter did not answer, or
    the client failed: the demo's trainer logs it and goes on, its panels must not go flat)."""
    try:
        return (await call).status
    except RemoteError as exc:
        return exc.status
    except Exception as exc:  # the loop outlives any one failed call
        log.warning("demo trainer: %s: %s", type(exc).__name__, exc)
        return None


async def reset_loop(admin_url: str, every_s: float, token: str | None = None) -> None:
    """The demo's trainer: a prefix-cache reset every few seconds, and after the first reset
    that reached the engines and then every ``WEIGHT_UPDATE_EVERY``-th, a new weight version
    and a verification of the weights across ranks, so the reset, weight-version and action
    metrics move. Relay mode refuses the weight version (403: a state change beside the front
    end); the loop stops asking then. It talks to the exporter as any client does
    (``exporter.remote``), with the admin token when the demo has one."""
    credentials = Credentials(Secret(token) if token is not None else None)
    set_versions = True
    updates = 0
    since_update = WEIGHT_UPDATE_EVERY
    async with Client(None, admin_url, credentials=credentials) as client:
        while True:
            await asyncio.sleep(every_s)
            status = await _status_of(client.reset_prefix_cache(timeout_s=10))
            since_update += 1
            if status not in (200, 502) or since_update < WEIGHT_UPDATE_EVERY:
                continue  # 503: no engine connected yet
            since_update = 0
            updates += 1
            if set_versions:
                version = f"demo-{updates}"
                status = await _status_of(client.weight_version(version, timeout_s=10))
                set_versions = status != 403
            await _status_of(client.verify_weights(timeout_s=10))


def trainer_blocked(config: ServeConfig) -> str | None:
    """Why the demo's own trainer cannot talk to its admin listener (None: it can). With a
    web config the listener asks for what the demo does not hold: a client that trusts the
    server's certificate (and presents one), or a basic-auth password (only hashes are in the
    file)."""
    web = config.web
    if web is None:
        return None
    if web.ssl_context is not None:
        return "the web config serves TLS"
    if web.users and config.admin_token is None:
        return "the web config asks for basic auth"
    return None


def _admin_lines(config: ServeConfig, admin_url: str) -> list[str]:
    auth = ""
    if config.admin_token_file:
        auth = f' -H "Authorization: Bearer $(cat {config.admin_token_file})"'
    elif config.web is not None and config.web.users:
        auth = " -u USER"  # curl asks for the password
    tls = " --cacert CA.crt" if admin_url.startswith("https:") else ""
    reset = f"{admin_url}/admin/reset_prefix_cache"
    return [f"  admin reset     curl{tls} -X POST{auth} {reset}"]


async def serve_demo(
    config: ServeConfig,
    headline: list[str],
    reset_every: float,
    stop: asyncio.Event | None = None,
) -> None:
    """Print where to look, run the demo's reset loop, serve until stopped (every attach mode)."""
    from exporter.commands.service import serve

    host, port = config.listen_host_port
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else url_host(host)
    scheme = config.web.scheme if config.web is not None else "http"
    lines = [
        *headline,
        f"  dashboard page  {scheme}://{shown}:{port}/",
        f"  metrics         {scheme}://{shown}:{port}/metrics",
        f"  status (JSON)   {scheme}://{shown}:{port}/status",
        f"  per-rank feed   {scheme}://{shown}:{port}/watch  (curl -N; or ctl watch)",
    ]
    if config.web is not None:
        lines.append(f"  web config      {config.web.path}")
    tasks = []
    admin = config.admin_host_port
    if admin is not None:
        admin_url = f"{scheme}://{url_host(admin[0])}:{admin[1]}"
        lines += _admin_lines(config, admin_url)
        blocked = trainer_blocked(config)
        if blocked is not None and reset_every > 0:
            lines.append(f"  demo resets     off: {blocked} (the demo holds no client credentials)")
        elif reset_every > 0:
            loop = reset_loop(admin_url, reset_every, config.admin_token)
            tasks.append(asyncio.create_task(loop))
    print("\n".join(lines), flush=True)
    stop = stop or asyncio.Event()
    if tasks:  # the trainer stops calling once the demo is told to stop, before it drains
        tasks.append(asyncio.create_task(_cancel_when_set(stop, list(tasks))))
    try:
        await serve(config, stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _cancel_when_set(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    await stop.wait()
    for task in tasks:
        task.cancel()


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
        web_config_file=options.web_config_file,
        admin_token_file=options.admin_token_file,
        **attach,
    )
