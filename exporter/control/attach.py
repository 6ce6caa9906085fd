"""Construction of every attach mode from the validated configuration, in one place.

``build_fleet(config, ...)`` returns the ``FleetClient`` the layers above use: owner and relay
mode are an ``EngineCoreClient`` that builds its ZMQ transport (the client is the transport's
listener, wired one way), HTTP mode is an ``HttpFleetClient``. This module also parses what only
one mode needs (HTTP targets, target files, the targets' token); the transports below it know
nothing of ``ServeConfig``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

from yarl import URL

from exporter.base.faults import ProtocolErrorTally
from exporter.client.engine_core import EngineCoreClient
from exporter.client.fleet import ChangeCallback, FleetClient
from exporter.client.http import HttpFleetClient, HttpTarget
from exporter.client.transport.owner import OwnerConfig, OwnerTransport
from exporter.client.transport.relay import RelayConfig, RelayTransport
from exporter.config.rules import read_text_file, read_token_file
from exporter.config.settings import ServeConfig
from exporter.error import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


def build_fleet(
    config: ServeConfig,
    faults: ProtocolErrorTally,
    *,
    relay_handshakes: Counter[str] | None = None,
    state_file_writes: Counter[str] | None = None,
    on_change: ChangeCallback | None = None,
    on_status: ChangeCallback | None = None,
) -> FleetClient:
    """The ``FleetClient`` of ``config.attach``. ``on_change`` is called when an engine comes
    up or goes down, ``on_status`` when what an engine pushed changed (owner mode: publish it,
    no engine needs asking); ``relay_handshakes`` receives one result per relayed handshake and
    ``state_file_writes`` one outcome per state-file write (owner and relay mode)."""
    writes = state_file_writes
    if config.attach == "owner":
        owner = owner_config(config)
        return EngineCoreClient(
            lambda listener: OwnerTransport(owner, listener, faults, state_writes=writes),
            faults,
            on_change=on_change,
            on_status=on_status,
        )
    if config.attach == "relay":
        relay = relay_config(config)
        counter = relay_handshakes if relay_handshakes is not None else Counter()
        return EngineCoreClient(
            lambda listener: RelayTransport(relay, listener, faults, counter, state_writes=writes),
            faults,
            on_change=on_change,
            receives_pushes=False,
        )
    if config.attach == "http":
        return http_client(config, faults)
    if config.attach == "inprocess":
        raise ConfigError(
            "attach mode inprocess runs inside vLLM's API server (VLLM_PLUGINS=dp_exporter) or "
            "in the process that owns an AsyncLLM (exporter.embed.start_exporter); serve "
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
    entries = list(config.http_target)
    if config.http_targets_file:
        entries += read_targets_file(config.http_targets_file)
    token = (
        read_token_file(config.http_token_file, "--http-token-file")
        if config.http_token_file
        else None
    )
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


def read_targets_file(path: str) -> list[str]:
    """One target per line; blank lines and ``#`` comments ignored. Read as every operator
    file is (a regular file, bounded, UTF-8: ``read_text_file``)."""
    text = read_text_file(path, "--http-targets-file")
    lines = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            lines.append(line)
    return lines


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
