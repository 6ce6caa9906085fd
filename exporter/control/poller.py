"""Every poll interval: every fleet invariant (``is_sleeping``, ``is_scheduler_paused``,
``get_weight_version``) and the activity read (``has_work``) on every engine, published as one
immutable ``FleetSnapshot``. Polls never overlap; a slow or dead engine delays a poll by at most
the call timeout, because all calls of a poll share one deadline.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping

from exporter.base.steps import Steps, every, run_steps_async
from exporter.client.fleet import (
    EngineDetail,
    EngineOutcome,
    FleetClient,
    Outcome,
    late_answers_allowed,
)
from exporter.client.observe import elastic_ep_reads
from exporter.control.build import (
    CONSENSUS_METHODS,
    PollInputs,
    SnapshotRules,
    answers_by_engine,
    snapshot_steps,
)
from exporter.control.fleetread import ALL_METHODS, FleetRead, FleetReading
from exporter.control.pacing import PaceCounts, bursts, paced_read
from exporter.control.sources import ReadingSource, asks_engines
from exporter.fleetstate.activity import hung_after_s, marked_stale, stale_after_s
from exporter.fleetstate.aggregate import ConsensusVerdict, FleetState
from exporter.fleetstate.history import FleetHistory
from exporter.fleetstate.invariants import SLEEPING, is_unsupported
from exporter.fleetstate.snapshot import FleetSnapshot, empty_snapshot
from exporter.metrics.stats import Stats

log = logging.getLogger("exporter.poller")

#: Outcomes that are an answer from the engine (or HTTP target): they reset its hung clock.
ANSWERED = frozenset({Outcome.OK, Outcome.FAILED, Outcome.INCONSISTENT})


#: The inconsistency warning (every engine's value) is logged at most once per method this
#: often; the polls in between are counted in the next line (and always in the metrics).
INCONSISTENCY_LOG_INTERVAL_S = 60.0


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
        log_interval_s: float = INCONSISTENCY_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        hung_after: float = 0.0,
        stall_after: float = 0.0,
        engines_per_burst: int = 0,
    ) -> None:
        self._client = client
        self._stats = stats
        self.interval_s = interval_s
        self.call_timeout_s = call_timeout_s
        self.jitter = jitter
        self._wall = wall_clock
        self._clock = clock
        self.log_interval_s = log_interval_s
        #: method → when its inconsistency was last logged, and the polls not logged since.
        self._warned_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}
        self._last_success: dict[str, float] = {}
        #: ``--hung-after`` in effect (0: three poll intervals, at least the call timeout).
        self.hung_after_s = hung_after_s(hung_after, interval_s, call_timeout_s)
        #: ``--stall-after`` (0: a rank is never stalled).
        self.stall_after_s = stall_after
        #: How old the last snapshot grows while polls run; older, ``mark_if_stale`` marks it.
        self.stale_after_s = stale_after_s(interval_s, call_timeout_s)
        #: ``--engines-per-burst`` (0: every engine at once; ``exporter.control.pacing``).
        self.engines_per_burst = engines_per_burst
        self.pace = PaceCounts()
        #: Seconds the last poll's bursts were spread over (the wait before the next is less).
        self._spread_s = 0.0
        #: Engine → when it last answered any call while connected (or was first seen so).
        self._last_answer: dict[str, float] = {}
        #: The engines of the last poll (``_forget_gone``).
        self._engine_set: set[str] = set()
        #: The one read of the fleet, with its memory of unsupported methods (the gate's too).
        self.reader = FleetRead(client)
        #: Where each poll's answers come from: ``reader``, or a deployment's one reader
        #: (``exporter.control.sources``: several API server processes).
        self.source: ReadingSource = self.reader
        self._snapshot: FleetSnapshot | None = None
        #: Snapshots republished between polls (``republish``): part of the render cache key.
        self.republished = 0
        self._republish_pending = False
        #: The fleet's state over the last hour (the status page's timeline).
        self.history = FleetHistory()
        #: Called with every snapshot published (a poll, or a push republished): the feeds
        #: (``exporter.feed``). A listener that raises is logged, never stops the poller.
        self.listeners: list[Callable[[FleetSnapshot], None]] = []
        self._wake = asyncio.Event()
        self._polled = asyncio.Condition()

    @property
    def snapshot(self) -> FleetSnapshot:
        if self._snapshot is None:
            client = self._client
            details = client.engine_details()
            return empty_snapshot(
                details,
                len(client.engine_labels),
                sum(1 for d in details if d.connected),
                client.capabilities.fault_status,
                client.capabilities.request_counts,
                elastic_ep_reads(client.observations),
            )
        return self._snapshot

    def republish_soon(self) -> None:
        """``republish`` once for every push read in one go: a flood of status changes from
        one engine costs one copy of the engines' details per loop turn, not one per push."""
        if self._republish_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.republish()
            return
        self._republish_pending = True
        loop.call_soon(self._republish_now)

    def _republish_now(self) -> None:
        self._republish_pending = False
        self.republish()

    def republish(self) -> None:
        """Publish the last poll again with every engine's details read afresh (what engines
        pushed: a fault-tolerance status, an elastic-EP event), asking no engine anything: a
        push from one engine must not make every engine answer a poll."""
        snap = self._snapshot
        if snap is None:
            return  # before the first poll, the snapshot reads the details afresh anyway
        details = {d.engine: d for d in self._client.engine_details()}
        engines = tuple(
            dataclasses.replace(e, detail=details.get(e.engine, e.detail)) for e in snap.engines
        )
        self._snapshot = dataclasses.replace(snap, engines=engines)
        self.republished += 1
        self._announce(self._snapshot)

    def mark_if_stale(self) -> bool:
        """Republish the last snapshot with every rank stale (not routable) once no poll
        completed for ``stale_after_s``: a poll held up, or the poller stopped, must not leave
        the routes answering its old "routable". True when it republished."""
        snap, now = self._snapshot, self._wall()
        marked = None if snap is None else marked_stale(snap, now, self.stale_after_s)
        if snap is None or marked is None:
            return False
        if snap.engines and not snap.engines[0].stale_s:
            log.warning(
                "no poll completed for %.0f s (a running poller takes at most %.0f s): every "
                "rank reads stale, not routable, until one does",
                now - snap.taken_at_unix,
                self.stale_after_s,
            )
        self._snapshot = marked
        self.republished += 1
        self._announce(marked)
        return True

    async def watch_freshness(self) -> None:
        """``mark_if_stale`` every second (every interval, if shorter), beside ``run``."""
        while True:
            await asyncio.sleep(min(1.0, self.interval_s))
            self.mark_if_stale()

    def _announce(self, snap: FleetSnapshot) -> None:
        for listener in self.listeners:
            try:
                listener(snap)
            except Exception:
                log.exception("a snapshot listener failed")

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
        """Run one poll of every invariant the attach mode supports and publish its snapshot.

        All calls share one deadline (they run concurrently). An engine that answers that it
        has no such method is unsupported for it from then on (until it handshakes again) and
        is not asked again (``FleetRead``, shared with the gate).
        """
        started = time.perf_counter()
        # Beside the reads, never on their path: shown once it came (this poll or the next).
        self._client.observations.refresh(self.call_timeout_s)
        paced = self._client.capabilities.calls_per_engine and asks_engines(self.source)
        per_burst = self.engines_per_burst if paced else 0
        groups = bursts(self._client.engine_labels, per_burst)
        self._spread_s = self.interval_s * (len(groups) - 1) / len(groups)
        reading = await self._read(groups)
        duration = time.perf_counter() - started
        if len(groups) > 1:  # the time its bursts took, not the waits between them
            duration = max(0.0, duration - self.pace.last_wait_s)
        # Each step below is its own turn of the event loop: in-process mode shares vLLM's.
        await asyncio.sleep(0)
        results = {
            method: [o for o in outcomes if not is_unsupported(o)]
            for method, outcomes in reading.outcomes.items()
        }
        await asyncio.sleep(0)
        self._forget_gone(reading.known_after)  # the fan-out may have learnt other engines
        now = self._wall()
        by_engine = answers_by_engine(results, reading.details)
        # What the poller keeps across polls, moved once here; the snapshot is then built
        # from values alone (``snapshot_steps``: pure).
        clocks = await run_steps_async(self._clock_steps(by_engine, reading.details, now))
        previous = self._snapshot.poll_number if self._snapshot else 0
        inputs = PollInputs(
            results,
            by_engine,
            reading.details,
            reading.progress,
            clocks,
            {e: self.source.unsupported_by(e) for e in reading.details},
            {m: self.source.unsupported_everywhere(m, reading.details) for m in results},
            duration,
            now,
            previous + 1,
        )
        rules = SnapshotRules(
            self.hung_after_s,
            self.stall_after_s,
            self._client.capabilities.fault_status,
            self._client.capabilities.request_counts,
            elastic_ep_reads(self._client.observations),
        )
        snap = await run_steps_async(snapshot_steps(inputs, rules))
        self._publish(snap, results)
        return snap

    async def _read(self, groups: list[tuple[str, ...]]) -> FleetReading:
        """This poll's reading: every engine at once, or paced a burst at a time; what a
        source tells is not asked (``FleetRead.read``'s ``listen``). A stall candidate is a
        rank within one interval and one call timeout of ``--stall-after``: a paced poll judges
        stalls with its last burst, up to that much later than an earlier burst asked."""
        listen = self.stall_after_s
        if listen > 0:  # a rank that may reach --stall-after before the poll is judged: asked
            listen = max(listen - self.interval_s - self.call_timeout_s, 1e-6)
        with late_answers_allowed():  # the poll's reads, never the gate's
            if len(groups) == 1:
                return await self.source.read(
                    ALL_METHODS, self.call_timeout_s, progress=True, listen=listen
                )
            return await paced_read(
                self.source,
                groups,
                self.interval_s,
                self.call_timeout_s,
                self.pace,
                listen=listen,
            )

    def _clock_steps(
        self,
        by_engine: Mapping[str, Mapping[str, EngineOutcome]],
        details: Mapping[str, EngineDetail],
        now: float,
    ) -> Steps[dict[str, tuple[float | None, float]]]:
        """Each engine's last successful answer and seconds without any answer, the poller's
        records of both moved by this poll's answers, in steps of ``ENGINES_PER_STEP``."""
        clocks = {}
        for position, (engine, detail) in enumerate(details.items(), 1):
            if every(position):
                yield
            answers = by_engine.get(engine, {})
            sleeping = answers.get(SLEEPING.method)
            if sleeping is not None and sleeping.ok:
                self._last_success[engine] = now
            silent = self._unresponsive(engine, detail, answers, now)
            clocks[engine] = (self._last_success.get(engine), silent)
        return clocks

    def _unresponsive(
        self,
        engine: str,
        detail: EngineDetail,
        answers: Mapping[str, EngineOutcome],
        now: float,
    ) -> float:
        """Seconds ``engine`` has been connected without answering any call (0 when it
        answered this poll, or is not connected: then it is disconnected or dead, not hung)."""
        if not detail.connected:
            self._last_answer.pop(engine, None)
            return 0.0
        # The invariants only: HTTP mode reads has_work from the API server's /metrics, which
        # answers while the engine behind it hangs. A target whose own ranks disagreed
        # (``inconsistent``) answered too: that is a state, not silence.
        if any(o.outcome in ANSWERED for m, o in answers.items() if m in CONSENSUS_METHODS):
            self._last_answer[engine] = now
            return 0.0
        since = self._last_answer.setdefault(engine, now)
        return max(0.0, now - since)

    def _forget_gone(self, engines: Iterable[str]) -> None:
        """Engines no longer in the fleet (HTTP mode: ranks a plugin-enabled server stopped
        naming): forget what this poller and the counters keep of them (bounded series)."""
        current = set(engines)
        if self._engine_set == current:
            return
        self._engine_set = current
        for engine in [e for e in self._last_success if e not in current]:
            del self._last_success[engine]
        for engine in [e for e in self._last_answer if e not in current]:
            del self._last_answer[engine]
        self._stats.keep_engines(current)

    def _publish(self, snap: FleetSnapshot, results: dict[str, list[EngineOutcome]]) -> None:
        stats = self._stats  # the calls themselves are counted by the client (CountedFleet)
        inconsistent = [v for v in snap.verdicts.values() if v.state is FleetState.INCONSISTENT]
        stats.record_poll(v.method for v in inconsistent)
        for verdict in inconsistent:
            self._warn_inconsistent(verdict)
        self.history.record(
            snap.taken_at_unix,
            {m: v.state.value for m, v in snap.verdicts.items()},
            sum(1 for e in snap.engines if e.up),
            snap.expected,
        )
        self._snapshot = snap
        self._announce(snap)

    def _warn_inconsistent(self, verdict: ConsensusVerdict) -> None:
        """One warning per method per ``log_interval_s``: a disagreement lasting for hours
        would otherwise log every engine's value every poll."""
        method, now = verdict.method, self._clock()
        last = self._warned_at.get(method)
        if last is not None and now - last < self.log_interval_s:
            self._unlogged[method] = self._unlogged.get(method, 0) + 1
            return
        self._warned_at[method] = now
        unlogged = self._unlogged.pop(method, 0)
        more = f" ({unlogged} more inconsistent polls since last report)" if unlogged else ""
        log.warning("%s%s", verdict.error, more)

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
            # A paced poll took most of the interval already: the next starts an interval
            # after this one started, so each engine is read once per interval.
            delay = max(0.0, self.interval_s + random.uniform(-spread, spread) - self._spread_s)
            await self._sleep_or_wake(delay)
            await asyncio.sleep(min_gap)  # a flapping engine cannot make polls back to back
