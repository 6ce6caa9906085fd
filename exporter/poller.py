"""Every poll interval: aggregated ``is_sleeping`` and ``is_scheduler_paused`` on every engine,
published as one immutable ``FleetSnapshot``. Polls never overlap; a slow or dead engine delays
a poll by at most the call timeout, because both calls share one deadline.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

from exporter.aggregate import ConsensusVerdict, FleetState, aggregate_consensus, require_bool
from exporter.fleet import EngineOutcome, FleetClient
from exporter.snapshot import EngineSnapshot, FleetSnapshot, empty_snapshot
from exporter.stats import Stats

log = logging.getLogger("exporter.poller")


class Poller:
    """Owns the latest snapshot; ``snapshot`` is what scrapes and /status read."""

    def __init__(
        self,
        client: FleetClient,
        stats: Stats,
        *,
        interval_s: float,
        call_timeout_s: float,
        jitter: float = 0.1,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._stats = stats
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.jitter = jitter
        self._wall = wall_clock
        self._last_success: dict[str, float] = {}
        self._snapshot: FleetSnapshot | None = None
        self._wake = asyncio.Event()
        self._polled = asyncio.Condition()

    @property
    def snapshot(self) -> FleetSnapshot:
        if self._snapshot is None:
            client = self._client
            return empty_snapshot(
                client.engine_details(), len(client.engine_labels), client.connected_count()
            )
        return self._snapshot

    def poll_soon(self) -> None:
        """Cut the current wait short (an engine connected, a test wants a fresh poll)."""
        self._wake.set()

    async def wait_for_poll(self, after: int, timeout_s: float) -> FleetSnapshot:
        """Wait until a poll numbered above ``after`` has been published."""
        async with self._polled:
            await asyncio.wait_for(
                self._polled.wait_for(lambda: self.snapshot.poll_number > after), timeout_s
            )
        return self.snapshot

    async def poll_once(self) -> FleetSnapshot:
        """Run one poll and publish its snapshot."""
        started = time.perf_counter()
        client = self._client
        if client.supports("is_scheduler_paused"):
            sleeping, paused = await asyncio.gather(
                client.call_utility("is_sleeping", timeout_s=self.call_timeout_s),
                client.call_utility("is_scheduler_paused", timeout_s=self.call_timeout_s),
            )
        else:
            sleeping = await client.call_utility("is_sleeping", timeout_s=self.call_timeout_s)
            paused = []
        sleeping = require_bool(sleeping)
        paused = require_bool(paused)
        duration = time.perf_counter() - started
        now = self._wall()
        snap = self._build(sleeping, paused, duration, now)
        self._publish(snap, sleeping, paused)
        return snap

    def _build(
        self,
        sleeping: list[EngineOutcome],
        paused: list[EngineOutcome],
        duration: float,
        now: float,
    ) -> FleetSnapshot:
        details = {d.engine: d for d in self._client.engine_details()}
        paused_by_engine = {o.engine: o for o in paused}
        engines = []
        for o in sleeping:
            if o.ok:
                self._last_success[o.engine] = now
            engines.append(
                EngineSnapshot(
                    engine=o.engine,
                    detail=details[o.engine],
                    sleeping_outcome=o,
                    paused_outcome=paused_by_engine.get(o.engine),
                    last_success_unix=self._last_success.get(o.engine),
                )
            )
        previous = self._snapshot.poll_number if self._snapshot else 0
        return FleetSnapshot(
            taken_at_unix=now,
            poll_duration_s=duration,
            engines=tuple(engines),
            sleeping=aggregate_consensus("is_sleeping", sleeping),
            # Not asked at all (HTTP attach): unknown, without a "no results" error.
            paused=aggregate_consensus("is_scheduler_paused", paused)
            if paused
            else ConsensusVerdict("is_scheduler_paused", FleetState.UNKNOWN),
            expected=len(details),
            connected=self._client.connected_count(),
            poll_number=previous + 1,
        )

    def _publish(
        self, snap: FleetSnapshot, sleeping: list[EngineOutcome], paused: list[EngineOutcome]
    ) -> None:
        stats = self._stats
        stats.polls += 1
        stats.record_calls("is_sleeping", sleeping)
        if paused:
            stats.record_calls("is_scheduler_paused", paused)
        for verdict in (snap.sleeping, snap.paused):
            if verdict.state is FleetState.INCONSISTENT:
                stats.inconsistent_results[verdict.method] += 1
        if snap.sleeping.state is FleetState.INCONSISTENT:
            log.warning("%s", snap.sleeping.error)
        self._snapshot = snap

    async def _sleep_or_wake(self, delay: float) -> None:
        """Wait ``delay`` seconds or until ``poll_soon``. Not ``asyncio.wait_for``: before
        Python 3.12 it swallows a cancellation that races with the wake-up, and ``stop()``
        then waited forever for a poller that kept running."""
        waiter = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait((waiter,), timeout=delay)
        finally:
            waiter.cancel()

    async def run(self) -> None:
        """Poll forever; each poll starts ``interval`` (± jitter) after the previous one ended,
        or sooner when ``poll_soon`` is called (an engine came up or went down)."""
        min_gap = min(0.2, self.interval_s / 10)
        while True:
            self._wake.clear()  # a poll_soon() during this poll schedules the next one early
            try:
                await self.poll_once()
            except Exception:  # keep serving /metrics whatever one poll hit
                log.exception("poll failed")
            async with self._polled:
                self._polled.notify_all()
            spread = self.interval_s * self.jitter
            delay = max(0.0, self.interval_s + random.uniform(-spread, spread))
            await self._sleep_or_wake(delay)
            await asyncio.sleep(min_gap)  # a flapping engine cannot make polls back to back
