"""Wiring: one ``Exporter`` per running service holds the client, poller, counters and collector.

The attach layer is pluggable: ``exporter.control.attach.build_fleet`` picks owner, relay or HTTP
from the config and everything above it only sees a ``FleetClient``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator

from prometheus_client.registry import CollectorRegistry

from exporter.base.faults import ProtocolErrorTally
from exporter.base.steps import run_steps
from exporter.base.tasks import cancel_and_wait, supervise
from exporter.client.fleet import FleetClient
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.client.observe import counters_of
from exporter.config.settings import ServeConfig
from exporter.control.attach import build_fleet
from exporter.control.counted import CountedFleet
from exporter.control.gate import Gate
from exporter.control.poller import Poller
from exporter.control.runner import ActionParts
from exporter.feed.hub import WatchHub
from exporter.feed.publisher import LoadPublisher
from exporter.metrics.families import ExporterCollector, build_registry, self_collectors
from exporter.metrics.negotiation import metrics_format
from exporter.metrics.renderer import Form, Renderer
from exporter.metrics.stats import Stats

log = logging.getLogger("exporter")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection during a render: collections that a render's short-lived rows
    trigger scan whatever else the process holds, so their cost grows with the fleet. What
    the pause saves, and that it costs nothing where it does not help: ``python -m
    bench.render`` and ``make bench`` (docs/benchmarks/). It lasts one synchronous render."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive now (modules, configuration, the links of
    every engine) out of the collector's reach (``gc.freeze``), as vLLM's engine core does after
    start-up: a full collection later scans only what was created since (without it, full
    collections were the tail of a large fleet's calls: ``make bench``, table 1b of
    docs/benchmarks/README.md, and docs/scale.md). Returns the number of objects frozen. Called once
    by the ``serve`` command and by the benchmark, never by in-process tests (a test process
    would pin what later tests drop while it is alive then)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def poller_of(config: ServeConfig, fleet: FleetClient, stats: Stats) -> Poller:
    """The poller of ``config`` over ``fleet`` (the counted client)."""
    return Poller(
        fleet,
        stats,
        interval_s=config.poll_interval,
        call_timeout_s=config.call_timeout,
        jitter=config.poll_jitter,
        hung_after=config.hung_after,
        stall_after=config.stall_after,
        engines_per_burst=config.engines_per_burst,
    )


class Exporter:
    """Everything one running exporter owns; ``start``/``stop`` bracket its background work."""

    def __init__(
        self,
        config: ServeConfig,
        client: FleetClient | None = None,
        *,
        vllm: VllmCore | None = None,
    ) -> None:
        """The client of ``config.attach`` is built here, the one place (``build_fleet``),
        after the tally it counts into; in-process mode needs ``vllm``, vLLM's engine-core
        client as ``exporter.inprocess`` found it. ``client``: a ready one (tests, benchmarks)."""
        self.config = config
        self.faults = ProtocolErrorTally()
        self.stats = Stats()
        self.client = (
            client
            if client is not None
            else build_fleet(
                config,
                self.faults,
                on_change=self._on_fleet_change,
                on_status=self._on_status_change,
                vllm=vllm,
            )
        )
        #: ``client`` as every caller uses it: each call's outcomes are counted on the way back.
        self.fleet = CountedFleet(self.client, self.stats)
        self.poller = poller_of(config, self.fleet, self.stats)
        #: ``GET /watch``'s rows, changes and watchers (``exporter.feed``).
        self.feed = WatchHub(lambda: self.poller.snapshot, max_watchers=config.max_watchers)
        self.poller.listeners.append(self.feed.publish)
        where = config.load_publisher_host_port
        #: ``--load-publisher``: each rank's load on ZMQ in SGLang's framing (None: off).
        self.load_publisher = LoadPublisher(*where) if where is not None else None
        if self.load_publisher is not None:
            self.poller.listeners.append(self.load_publisher.publish)
        self._build_registries()
        self.gate = Gate(
            self.fleet,
            timeout_s=config.call_timeout,
            min_interval_s=config.gate_min_interval,
            reader=self.poller.reader,  # one memory of what each engine does not have
            hung=lambda: {
                e.engine: e.unresponsive_s for e in self.poller.snapshot.engines if e.hung
            },
        )
        self.stats.preset(self.client.engine_labels)
        # Start the failure series of the loops every exporter runs at 0 (increase() sees 1).
        handshakes = self.client.capabilities.handshakes
        for task in ("poller", "handshake") if handshakes else ("poller",):
            self.faults.task_failures.setdefault(task, 0)
        self._poll_task: asyncio.Task[None] | None = None
        self._fresh_task: asyncio.Task[None] | None = None
        self._load_task: asyncio.Task[None] | None = None

    def _build_registries(self) -> None:
        """The collector over the poller's snapshot, and the three registries rendered from it
        (this exporter's series; the process's own; both, for OpenMetrics)."""
        self.collector = ExporterCollector(
            lambda: self.poller.snapshot,
            self.stats,
            self.faults,
            model_name=self.config.model_name,
            client_counters=lambda: counters_of(self.client.observations),
            feed=self.feed_figures,
        )
        #: This exporter's series only (what the lean text encoder renders too).
        self.registry: CollectorRegistry = build_registry(self.collector)
        own = self_collectors()
        #: The process's own process_* / python_* series, appended to every text body.
        self.self_registry = build_registry(*own)
        self.openmetrics_registry = build_registry(self.collector, *own)
        #: Every form of the series, each rendered once per ``state_version``.
        self.renderer = Renderer(
            self.collector, self.self_registry, self.openmetrics_registry, self.state_version
        )

    def state_version(self) -> tuple[int, ...]:
        """The renderer's cache key: every change a scrape could show bumps one of these (a
        published poll, a counter in ``Stats`` or the fault tally, a handshake before the
        first poll, a relayed handshake, a state-file write), so a cached body is never older
        than the state."""
        return (
            self.poller.snapshot.poll_number,
            self.poller.republished,
            self.poller.snapshot.connected,
            self.stats.generation,
            self.faults.generation,
            *(sum(counts.values()) for counts in counters_of(self.client.observations).values()),
            *self.feed.counts.version(len(self.feed.watchers)),
            *(self.load_publisher.version() if self.load_publisher is not None else ()),
        )

    def feed_figures(self) -> dict[str, dict[tuple[str, ...], float]]:
        """The feeds' series (``vllm_dp_watch*``)."""
        counts = self.feed.counts
        figures: dict[str, dict[tuple[str, ...], float]] = {
            "vllm_dp_watchers": {(): float(len(self.feed.watchers))},
            "vllm_dp_watch_events_total": {(): float(counts.events)},
            "vllm_dp_watch_dropped_total": {(): float(counts.dropped)},
            "vllm_dp_watch_refused_total": {(): float(counts.refused)},
        }
        if self.load_publisher is not None:
            figures.update(self.load_publisher.figures())
        return figures

    def feeds_json(self) -> dict[str, object]:
        """The feeds in ``/status``: ``GET /watch`` and the ZMQ load publisher (null: off)."""
        publisher = self.load_publisher
        return {
            "watch": self.feed.status_json(),
            "load_publisher": publisher.status_json() if publisher is not None else None,
        }

    def render_metrics(self, accept: str, use_gzip: bool) -> tuple[bytes, str]:
        """The /metrics body for this Accept header (``renderer``: rendered once per state
        change; keyed on the negotiated format and gzip, never on the client's text)."""
        form = Form(metrics_format(accept), use_gzip)
        with gc_paused():
            body = run_steps(self.renderer.steps(form))
        return body, form.content_type

    def action_parts(self) -> ActionParts:
        """What the admin actions take of this exporter (``ActionRunner``, the admin
        controller): never the whole of it."""
        return ActionParts(
            self.fleet, self.stats, self.config, self.gate.invalidate, self.poller.poll_soon
        )

    def _on_fleet_change(self) -> None:
        """An engine came up or went down: poll now, so the change is published at once."""
        self.poller.poll_soon()

    def _on_status_change(self) -> None:
        """What an engine pushed changed: publish it at once, asking no engine anything."""
        self.poller.republish_soon()

    async def start(self) -> None:
        await self.client.start()
        self._poll_task = supervise("poller", self.poller.run, self.faults)
        self._fresh_task = supervise("freshness", self.poller.watch_freshness, self.faults)
        if self.load_publisher is not None:
            self._load_task = supervise("load_publisher", self.load_publisher.run, self.faults)

    async def stop(self) -> None:
        task, self._poll_task = self._poll_task, None
        self.feed.close()
        await cancel_and_wait(task)
        fresh, self._fresh_task = self._fresh_task, None
        await cancel_and_wait(fresh)
        await cancel_and_wait(self._load_task)
        if self.load_publisher is not None:
            self.load_publisher.close()
        await self.client.close()
