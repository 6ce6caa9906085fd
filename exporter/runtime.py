"""Wiring: one ``Exporter`` per running service holds the client, poller, counters and collector.

The attach layer is pluggable: ``make_client`` picks owner, relay or HTTP from the config and
everything above it only sees a ``FleetClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from exporter.client import EngineCoreClient, FleetClient
from exporter.config import ServeConfig
from exporter.error import ConfigError
from exporter.exposition import render_text
from exporter.metrics import ExporterCollector, build_registry
from exporter.poller import Poller
from exporter.stats import Stats
from exporter.transport.events import ProtocolErrorTally
from exporter.transport.owner import OwnerConfig, OwnerTransport

log = logging.getLogger("exporter")


def make_client(config: ServeConfig, errors: ProtocolErrorTally, stats: Stats) -> FleetClient:
    """Build the attach-mode client named by ``config.attach``."""
    if config.attach == "owner":
        client = EngineCoreClient(errors)
        client.attach(OwnerTransport(owner_config(config), client, errors))
        return client
    if config.attach == "http":
        from exporter.transport.http import make_http_client

        return make_http_client(config)
    if config.attach == "relay":
        from exporter.transport.relay import make_relay_client

        return make_relay_client(config, errors, stats)
    raise ConfigError(f"unknown attach mode {config.attach!r}")


def owner_config(config: ServeConfig) -> OwnerConfig:
    return OwnerConfig(handshake_address=config.handshake_address, **config.fleet_shape())


class Exporter:
    """Everything one running exporter owns; ``start``/``stop`` bracket its background work."""

    def __init__(self, config: ServeConfig, client: FleetClient | None = None) -> None:
        self.config = config
        self.errors = ProtocolErrorTally()
        self.stats = Stats()
        self.client = client if client is not None else make_client(config, self.errors, self.stats)
        self.poller = Poller(
            self.client,
            self.stats,
            interval_s=config.poll_interval,
            call_timeout_s=config.call_timeout,
            jitter=config.poll_jitter,
        )
        self.collector = ExporterCollector(
            lambda: self.poller.snapshot,
            self.stats,
            self.errors,
            model_name=config.model_name,
            include_relay=config.attach == "relay",
        )
        self.registry: CollectorRegistry = build_registry(self.collector)
        if isinstance(self.client, EngineCoreClient):
            self.client.on_change = self.poller.poll_soon
        self.stats.preset(self.client.engine_labels)
        self._poll_task: asyncio.Task[None] | None = None
        self._render_cache: dict[tuple[str, bool], tuple[tuple[int, ...], bytes, str]] = {}

    def _state_version(self) -> tuple[int, ...]:
        """Changes whenever anything a scrape renders changes (a poll, an admin request, a
        protocol error, a relayed handshake): scrapes in between reuse the rendered body."""
        st = self.stats
        snap = self.poller.snapshot  # immutable once published: its number identifies it
        return (
            snap.poll_number,
            snap.connected,  # before the first poll, handshakes still change the picture
            st.polls,
            sum(st.admin_requests.values()),
            sum(self.errors.counts.values()),
            sum(st.relay_handshakes.values()),
        )

    def render_metrics(self, accept: str, use_gzip: bool) -> tuple[bytes, str]:
        """The /metrics body for this Accept header, rendered once per state change: a storm
        of concurrent scrapes costs one render, not one per scrape, and never starves polls."""
        encoder, content_type = choose_encoder(accept)
        key = (content_type, use_gzip)
        version = self._state_version()
        cached = self._render_cache.get(key)
        if cached is not None and cached[0] == version:
            return cached[1], cached[2]
        if content_type.startswith("text/plain"):
            body = render_text(self.collector.families())
        else:
            body = encoder(self.registry)
        if use_gzip:
            body = gzip.compress(body, compresslevel=5)
        self._render_cache[key] = (version, body, content_type)
        return body, content_type

    async def start(self) -> None:
        await self.client.start()
        self._poll_task = asyncio.create_task(self.poller.run(), name="poller")

    async def stop(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll_task
            self._poll_task = None
        await self.client.close()
