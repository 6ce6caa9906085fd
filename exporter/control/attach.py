"""Construction of every attach mode from the validated configuration, in one place.

``build_fleet(config, ...)`` returns the ``FleetClient`` the layers above use: owner and relay
mode are an ``EngineCoreClient`` that builds its ZMQ transport (the client is the transport's
listener, wired one way), HTTP mode is an ``HttpFleetClient``. This module also parses what only
one mode needs (HTTP targets, target files, the targets' token); the transports below it know
nothing of ``ServeConfig``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from yarl import URL

from exporter.base.faults import ProtocolErrorTally
from exporter.client.fleet import ChangeCallback, FleetClient
from exporter.client.http.client import HttpFleetClient, HttpTarget
from exporter.client.inprocess.client import InProcessFleetClient
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.client.owner import OwnerConfig, owner_client
from exporter.client.relay import RelayConfig, relay_client
from exporter.config.settings import ServeConfig
from exporter.error import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


def build_fleet(
    config: ServeConfig,
    faults: ProtocolErrorTally,
    *,
    on_change: ChangeCallback | None = None,
    on_status: ChangeCallback | None = None,
    vllm: VllmCore | None = None,
) -> FleetClient:
    """The ``FleetClient`` of ``config.attach``. ``on_change`` is called when an engine comes
    up or goes down, ``on_status`` when what an engine pushed changed (owner mode: publish it,
    no engine needs asking). In-process mode runs over ``vllm``, vLLM's own engine-core client
    (the plugin and ``start_exporter`` find it). The client keeps its own counters
    (``FleetClient.counters``)."""
    if config.attach == "owner":
        return owner_client(owner_config(config), faults, on_change=on_change, on_status=on_status)
    if config.attach == "relay":
        return relay_client(relay_config(config), faults, on_change=on_change)
    if config.attach == "http":
        return http_client(config, faults)
    if config.attach == "inprocess":
        if vllm is not None:
            return InProcessFleetClient(vllm, faults=faults)
        raise ConfigError(
            "attach mode inprocess runs inside vLLM's API server (VLLM_PLUGINS=dp_exporter) or "
            "in the process that owns an AsyncLLM (exporter.inprocess.start_exporter); serve "
            "attaches as owner, relay or http"
        )
    raise ConfigError(f"unknown attach mode {config.attach!r}")


def owner_config(config: ServeConfig) -> OwnerConfig:
    return OwnerConfig(handshake_address=config.handshake_address, **config.fleet_shape())


def relay_config(config: ServeConfig) -> RelayConfig:
    if not config.upstream_handshake_address:
        raise ConfigError("relay mode needs upstream_handshake_address")
    return RelayConfig(
        handshake_address=config.handshake_address,
        upstream_handshake_address=config.upstream_handshake_address,
        upstream_timeout_s=config.relay_upstream_timeout,
        **config.fleet_shape(),
    )


def http_client(config: ServeConfig, faults: ProtocolErrorTally | None = None) -> HttpFleetClient:
    """The ``--attach http`` client from ``--http-target``, ``--http-targets-file`` and token."""
    entries = [*config.http_target, *config.http_file_targets]  # the file read at resolution
    token = config.http_token
    return HttpFleetClient(
        parse_targets(entries), token=token, faults=faults or ProtocolErrorTally()
    )


def parse_target(text: str, index: int) -> HttpTarget:
    """``URL`` or ``NAME=URL``; the label defaults to the target's position."""
    entry = text.strip()
    name: str | None = None
    head, sep, rest = entry.partition("=")
    if sep and "://" not in head:
        name, entry = head.strip(), rest.strip()
        if not name or not _NAME.match(name):
            raise ConfigError(
                f"--http-target {text!r}: a target name may only use letters, digits and _.:-"
            )
    url = URL(entry)
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigError(f"--http-target {text!r}: expected http://HOST:PORT or NAME=URL")
    if url.user or url.password:
        raise ConfigError(
            f"--http-target {name or index}: credentials in the URL are not allowed "
            "(use --http-token-file)"
        )
    if url.query_string or url.fragment:
        raise ConfigError(f"--http-target {text!r}: a target URL takes no query or fragment")
    return HttpTarget(name if name is not None else str(index), entry.rstrip("/"))


def parse_targets(entries: Iterable[str]) -> list[HttpTarget]:
    targets = [parse_target(text, i) for i, text in enumerate(entries)]
    if not targets:
        raise ConfigError("--attach http needs at least one --http-target")
    seen: set[str] = set()
    for t in targets:
        if t.label in seen:
            raise ConfigError(f"--http-target: engine label {t.label!r} is used twice")
        seen.add(t.label)
    return targets
