"""In-process mode: the ``FleetClient`` over vLLM's own engine-core client.

Inside ``vllm serve`` (the endpoint plugin) or a trainer's process (``AsyncLLM``), vLLM's
engine-core client is already connected to every DP engine. This client sends each utility call
to each engine through it (``exporter.client.inprocess.vllm_core``), so the layers above get
one outcome per engine exactly as in owner, relay and HTTP mode: the same allow-list, one shared
deadline per fan-out, the same outcomes and the same bound on engine strings. It opens no
socket of its own.

vLLM's client has no timeout and keeps a future per call until the engine answers. A call that
times out here is therefore left running (its future is vLLM's, not ours to remove: vLLM's
reply handler pops it, and a missing entry would kill vLLM's output loop), and at most
``max_in_flight`` of this client's calls per engine may wait in vLLM's table at once: beyond
that, a call to that engine times out at once without being sent, so a hung engine cannot grow
vLLM's table without bound.

Each engine's fault-tolerance status is the front end's own copy of its sentinel's pushes
(vLLM 0.33's ``_engine_status``), read on every ``engine_details()``. Its elastic-EP operation
is what vLLM's own ``POST /is_scaling_elastic_ep`` would answer, read once a poll beside the
utility calls (``exporter.client.inprocess.elastic_ep``).

When an engine dies, vLLM's front end fails as a whole (``EngineDeadError`` on every call, and
the API server exits); until then this client answers ``disconnected`` for every engine and
never raises into vLLM.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from typing import Any

from exporter.base.faults import ProtocolErrorTally
from exporter.base.memo import ShortMemo
from exporter.base.steps import every
from exporter.client.fleet import (
    DEFAULT_ALLOWED_METHODS,
    PYTHON_FRONT_END,
    STOPPING,
    Capabilities,
    EngineDetail,
    EngineOutcome,
    Outcome,
    check_allowed,
    stopping,
    timed_out,
)
from exporter.client.inprocess.elastic_ep import ElasticEpWatch
from exporter.client.inprocess.fanout import ENGINE_CORE_DEAD, PendingCalls
from exporter.client.inprocess.feed import FEED, ProgressFeed
from exporter.client.inprocess.vllm_core import VllmCore
from exporter.client.observe import (
    ELASTIC_EP_OPERATION,
    PROGRESS,
    WORK_COUNTS,
    Observation,
    Observations,
)
from exporter.client.pushes import BAD_FT_STATUS, PushBook
from exporter.protocol.activity import RequestCounts

log = logging.getLogger("exporter.inprocess")

#: This client's calls per engine that may wait in vLLM's client for a reply at once (a poll
#: asks four methods at once: two polls, the gate and an admin action fit, then a hung engine
#: is not asked more until it answers).
MAX_IN_FLIGHT = 12
#: Most engine lists whose targets are kept (a paced poll's bursts, each with its calls'
#: subsets; a gate's or an action's engines): past it, found afresh.
MAX_KEPT_TARGETS = 256
#: Actions after which vLLM's ``AsyncLLM`` records something itself (``VllmCore.after_fleet_call``).
FRONT_END_METHODS = frozenset({"sleep", "wake_up", "pause_scheduler"})
#: The front end's bookkeeping is local (a cache cleared, a gauge set): bounded all the same.
FRONT_END_TIMEOUT_S = 5.0
#: Where the elastic-EP observations come from.
ELASTIC_EP_SOURCE = "get_external_elastic_ep_status"
#: Where the progress observations come from (vLLM's stat-logger plugins).
FEED_SOURCE = "vllm.stat_logger_plugins"
#: How long one read of the request counts serves the reads of the same poll step (vLLM's
#: coordinator refreshes its table every 100 ms at most).
COUNTS_MEMO_S = 0.01
#: Where the request counts that tell a rank's activity come from.
COUNTS_SOURCE = "lb_engines+engine_inflight"
#: The method whose answer the front end's own count of unfinished requests can contradict.
HAS_WORK = "has_work"
#: Why such a rank's ``has_work`` false is not read as drained (``_fail_closed``).
OWN_COUNT_UNREADABLE = (
    "has_work false, but the front end's count of this engine's unfinished requests "
    "(vLLM's engine_inflight) cannot be read: unknown, never drained"
)


class InProcessFleetClient:
    """``FleetClient`` over vLLM's engine-core client (see the module docstring)."""

    def __init__(
        self,
        core: VllmCore,
        *,
        allowed_methods: frozenset[str] = DEFAULT_ALLOWED_METHODS,
        max_in_flight: int = MAX_IN_FLIGHT,
        faults: ProtocolErrorTally | None = None,
        feed: ProgressFeed = FEED,
    ) -> None:
        self.core = core
        #: What vLLM's stat loggers told this process (``exporter.inprocess.feed``).
        self.feed = feed
        #: The front end's fault-tolerance statuses, as recorded (``since_unix`` kept).
        self.pushes = PushBook(faults if faults is not None else ProtocolErrorTally())
        self._allowed = allowed_methods
        self._max_in_flight = max_in_flight
        #: engine label → this client's calls waiting in vLLM's client for a reply.
        self._in_flight: dict[str, int] = {}
        self._outstanding: set[asyncio.Task[Any]] = set()
        self._closed = False
        #: engine label → what its detail was made of, and the detail (``engine_details``
        #: runs twice a poll on vLLM's loop: 256 unchanged details are not built again).
        self._details: dict[str, tuple[tuple[Any, ...], EngineDetail]] = {}
        #: Everything the last details were made of, compared whole first.
        self._whole: tuple[Any, ...] | None = None
        #: The engines' identities the kept targets were found in, and engines asked →
        #: (label, identity) of the managed ones (``_targets``).
        self._targets_of: tuple[dict[str, bytes], dict[tuple[str, ...], list[tuple[str, bytes]]]]
        self._targets_of = ({}, {})
        #: This process's elastic-EP operation, read once a poll (``elastic_ep``).
        self._elastic = ElasticEpWatch(core)
        #: One read of vLLM's tables serves the reads of the same moment.
        self._memo = ShortMemo(COUNTS_MEMO_S)
        self.observations = Observations()
        self.observations.add_source(ELASTIC_EP_OPERATION, self._elastic_ep_operations)
        self.observations.add_refresher(self._refresh_elastic_ep)
        self.observations.add_source(PROGRESS, self._progress, scoped=True)
        self.observations.add_source(WORK_COUNTS, self._work_counts, scoped=True)

    # -- FleetClient -----------------------------------------------------------------------

    @property
    def engine_labels(self) -> list[str]:
        return [label for label, _ in self.core.engines()]

    def engine_details(self) -> list[EngineDetail]:
        connected = not self.core.dead()
        where = f"in-process (vLLM client {self.core.client_index})"
        kv_events = self.core.kv_event_sources()
        engines = self.core.engines()  # the same list while vLLM's is unchanged
        labels = [label for label, _ in engines]
        ranks = [int(label) for label in labels]
        self._read_fault_statuses(ranks)
        faults = self.pushes.fault_status
        counts = self._request_counts(ranks)
        # Nothing changed since the last read (the common case): the same details, compared
        # in C (dicts of the same objects), not engine by engine.
        whole = (connected, engines, kv_events, dict(faults), counts)
        last = self._whole
        if last is not None and last[1] is engines and last == whole:
            return [detail for _, detail in self._details.values()]
        self._whole = whole
        kept, self._details = self._details, {}
        details = []
        for label in labels:
            facts = (connected, kv_events.get(label), faults.get(label), counts.get(int(label)))
            previous = kept.get(label)
            if previous is not None and previous[0] == facts:
                detail = previous[1]  # unchanged since the last read: not built again
            else:
                detail = EngineDetail(
                    engine=label,
                    connected=connected,
                    address=where,
                    vllm_version=self.core.vllm_version,
                    front_end=PYTHON_FRONT_END,  # vLLM's own Python client, in its process
                    enable_sleep_mode=self.core.enable_sleep_mode,
                    handshakes=1,
                    kv_events=facts[1],
                    fault_status=facts[2],
                    requests=facts[3],
                )
            self._details[label] = (facts, detail)
            details.append(detail)
        return details

    @property
    def capabilities(self) -> Capabilities:
        """Fault-tolerance status where this vLLM's front end keeps a table of it; request
        counts from the DP coordinator's and the front end's own (``VllmCore.request_counts``)."""
        return Capabilities(
            fault_status=self.core.keeps_fault_status(),
            request_counts=True,
            methods=self._allowed,
        )

    def _refresh_elastic_ep(self, timeout_s: float) -> None:
        if not self._closed:
            self._elastic.refresh(timeout_s)

    def _elastic_ep_operations(self) -> list[Observation]:
        return [
            Observation(
                read.target, ELASTIC_EP_OPERATION, read, read.read_at_unix or 0.0, ELASTIC_EP_SOURCE
            )
            for read in self._elastic.reads()
        ]

    def _targets(self, engines: Collection[str] | None) -> list[tuple[str, bytes]]:
        """(label, identity) of the managed engines among ``engines`` (None: every one), in
        rank order: a burst's engines looked up, not every engine walked."""
        if engines is None:
            return self.core.engines()
        managed = self.core.identity_of()
        asked = tuple(engines)
        if managed is not self._targets_of[0] or len(self._targets_of[1]) >= MAX_KEPT_TARGETS:
            self._targets_of = (managed, {})  # another fleet (or too many kept): found afresh
        found = self._targets_of[1].get(asked)
        if found is None:  # a paced poll asks the same bursts every poll: found once
            labels = sorted({e for e in asked if e in managed}, key=int)
            found = self._targets_of[1][asked] = [(label, managed[label]) for label in labels]
        return found

    def _ranks(self, engines: Collection[str] | None) -> list[int]:
        """The managed ranks among ``engines`` (None: every one), in rank order."""
        return [int(label) for label, _ in self._targets(engines)]

    def _progress(self, engines: Collection[str] | None) -> list[Observation]:
        """Each managed rank's tokens (of ``engines``) as vLLM's stat loggers told this
        process (none while vLLM built no stat logger of ours here: unknown)."""
        ranks = self._ranks(engines)
        found = self.feed.progress(ranks, self._own_unfinished(ranks))
        if found is None:
            return []
        return [
            Observation(str(rank), PROGRESS, progress, progress.last_progress_unix, FEED_SOURCE)
            for rank, progress in found.items()
        ]

    def _work_counts(self, engines: Collection[str] | None) -> list[Observation]:
        """Each rank's requests (of ``engines``) where they tell its activity: the
        coordinator's live table raised to the front end's own count, or the own count alone
        above 0 (``VllmCore.request_counts``); a rank whose own count cannot be read is left
        out (the table alone misses what a keep-mode pause holds: ``has_work`` is asked)."""
        ranks = self._ranks(engines)
        own = self._own_unfinished(ranks)
        now = time.time()
        return [
            Observation(str(rank), WORK_COUNTS, counts, now, COUNTS_SOURCE)
            for rank, counts in self._request_counts(ranks).items()
            if own is None or own.get(rank) is not None
        ]

    def _request_counts(self, ranks: list[int]) -> dict[int, RequestCounts]:
        """``VllmCore.request_counts``, read at most once per ``COUNTS_MEMO_S`` for the same
        ranks and never across a fan-out (``call_utility`` clears it): the details before a
        burst and what the counts tell share one read (at 256 engines, 16 reads of 256 ranks
        a poll fewer)."""
        return self._memo.get(
            "counts",
            tuple(ranks),
            lambda: self.core.request_counts(ranks, self._own_unfinished(ranks)),
        )

    def _own_unfinished(self, ranks: list[int]) -> dict[int, int | None] | None:
        """``VllmCore.own_unfinished``, as ``_request_counts`` is read (the gate's
        ``_fail_closed`` reads it afresh)."""
        return self._memo.get("own", tuple(ranks), lambda: self.core.own_unfinished(ranks))

    def _read_fault_statuses(self, ranks: list[int]) -> None:
        """The front end's copy of the sentinels' pushes, read afresh for the ranks this
        client manages (dict lookups): a rank without an entry is forgotten, an unreadable
        entry is ``unknown`` and counted."""
        statuses = self.core.fault_statuses(ranks)
        if statuses is None or (not statuses and not self.pushes.fault_status):
            return  # no table, or nothing in it and nothing to forget
        for rank in ranks:
            found = statuses.get(rank)
            if found is None:
                self.pushes.forget(str(rank))
            else:
                self.pushes.record(str(rank), found, BAD_FT_STATUS)

    async def start(self) -> None:
        self._closed = False
        self.feed.start()

    async def close(self) -> None:
        """Cancel the calls still waiting (vLLM drops a late reply to a cancelled future)."""
        self._closed = True
        self.feed.stop()
        self._elastic.close()
        for task in list(self._outstanding):
            task.cancel()
        self._outstanding.clear()

    @property
    def in_flight(self) -> dict[str, int]:
        """This client's calls per engine waiting in vLLM's client for a reply (a copy)."""
        return {k: v for k, v in self._in_flight.items() if v}

    async def call_utility(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        *,
        timeout_s: float,
        engines: Collection[str] | None = None,
    ) -> list[EngineOutcome]:
        check_allowed(method, self._allowed)
        targets = self._targets(engines)
        if self.core.dead() or self._closed:
            error = ENGINE_CORE_DEAD if not self._closed else STOPPING
            return [EngineOutcome(label, Outcome.DISCONNECTED, error=error) for label, _ in targets]
        pending = PendingCalls()
        results: dict[str, EngineOutcome] = {}
        calls: dict[asyncio.Task[Any], str] = {}
        for position, (label, identity) in enumerate(targets, 1):
            if every(position):  # a fan-out to 256 engines is eight short stretches
                await asyncio.sleep(0)  # vLLM's loop serves its streams between the chunks
            if self._closed:  # closed meanwhile: the rest is not sent
                results[label] = stopping(label)
                continue
            waiting = self._in_flight.get(label, 0)
            if waiting >= self._max_in_flight:
                results[label] = EngineOutcome(
                    label,
                    Outcome.TIMEOUT,
                    error=f"not sent: {waiting} earlier calls to this engine are unanswered",
                    duration_s=0.0,
                )
                continue
            calls[self._send(label, identity, method, args, pending)] = label
        if calls:
            await pending.wait(timeout_s)
            for position, (task, label) in enumerate(calls.items(), 1):
                if every(position):
                    await asyncio.sleep(0)
                if task.done():
                    results[label] = pending.outcome(label, task, self._closed)
                else:  # left running: vLLM's future is removed only by the reply
                    results[label] = timed_out(label, timeout_s)
        outcomes = self._settled(method, [results[label] for label, _ in targets])
        if method in FRONT_END_METHODS and engines is None and all(o.ok for o in outcomes):
            await self._keep_front_end(method, args, outcomes)
        return outcomes

    def _settled(self, method: str, outcomes: list[EngineOutcome]) -> list[EngineOutcome]:
        """A fan-out's outcomes as answered: what is read after it is read afresh (the gate's
        verdict, an action's read-back: the memo cleared), ``has_work`` failed closed."""
        self._memo.clear()
        return self._fail_closed(outcomes) if method == HAS_WORK else outcomes

    def _fail_closed(self, outcomes: list[EngineOutcome]) -> list[EngineOutcome]:
        """``has_work`` false from a rank whose front-end count of unfinished requests
        (``VllmCore.own_unfinished``) cannot be read is no answer to call it drained on:
        failed, saying why (as HTTP mode's unreadable ``/metrics``). Any other answer stays."""
        idle = [o for o in outcomes if o.ok and o.value is False]
        if not idle:
            return outcomes
        held = self.core.own_unfinished([int(o.engine) for o in idle])
        unknown = {str(rank) for rank, count in (held or {}).items() if count is None}
        if not unknown:
            return outcomes
        return [
            EngineOutcome(
                o.engine, Outcome.FAILED, error=OWN_COUNT_UNREADABLE, duration_s=o.duration_s
            )
            if o.engine in unknown and o.ok and o.value is False
            else o
            for o in outcomes
        ]

    async def _keep_front_end(
        self, method: str, args: tuple[Any, ...], outcomes: list[EngineOutcome]
    ) -> None:
        """vLLM's own bookkeeping of the same action (never raises: the action is done)."""
        try:
            await asyncio.wait_for(
                self.core.after_fleet_call(method, args, [o.value for o in outcomes]),
                FRONT_END_TIMEOUT_S,
            )
        except (Exception, asyncio.TimeoutError) as exc:  # the engines' state is right anyway
            log.warning("vLLM's front-end bookkeeping after %s failed: %s", method, exc)

    def _send(
        self, label: str, identity: bytes, method: str, args: tuple[Any, ...], pending: PendingCalls
    ) -> asyncio.Task[Any]:
        """One call of ``pending``, counted in flight until vLLM's client resolves it (reply
        or death)."""
        self._in_flight[label] = self._in_flight.get(label, 0) + 1
        task = asyncio.ensure_future(self.core.call(method, args, identity))
        # Tracked from the start, so close() also cancels the calls of a fan-out still
        # waiting, or of one whose caller was cancelled (the poller's task at stop).
        self._outstanding.add(task)
        pending.expect()

        def resolved(done: asyncio.Task[Any]) -> None:
            pending.resolved(done)
            self._outstanding.discard(done)
            self._in_flight[label] = max(0, self._in_flight.get(label, 1) - 1)
            if not done.cancelled():
                done.exception()  # retrieved: a late failure is not an unhandled error

        task.add_done_callback(resolved)
        return task
