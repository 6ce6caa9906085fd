"""Immutable fleet snapshots: what one poll learned, published whole for scrapes and /status."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineDetail, EngineOutcome
from exporter.fleetstate.aggregate import ConsensusVerdict, FleetState
from exporter.fleetstate.invariants import (
    HAS_WORK,
    INVARIANTS,
    PAUSED,
    SLEEPING,
    WEIGHT_VERSION,
    Invariant,
)
from exporter.protocol.activity import RequestCounts
from exporter.protocol.elastic_ep import ElasticEpRead
from exporter.protocol.progress import RankProgress


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    engine: str
    detail: EngineDetail
    #: method → this engine's outcome in the poll (absent: not asked, or unsupported).
    outcomes: Mapping[str, EngineOutcome]
    last_success_unix: float | None
    #: Invariant methods this engine's vLLM does not have.
    unsupported: frozenset[str] = frozenset()
    #: Seconds since its last answer to any call while its connection is alive (0 while it
    #: answers or is not connected), and whether that is past ``--hung-after``.
    unresponsive_s: float = 0.0
    hung: bool = False
    #: The tokens it computed and when that last grew (None: no source tells, or not yet),
    #: and how long before this poll that was.
    progress: RankProgress | None = None
    progress_age_s: float | None = None
    #: It holds requests and says it has work, but computed no token for ``--stall-after``
    #: (``exporter.fleetstate.activity.is_stalled``).
    stalled: bool = False
    #: Seconds since the poll these answers come from, once that is longer than a running
    #: poller ever leaves a snapshot (``Poller.mark_if_stale``; 0: fresh): too old to route on.
    stale_s: float = 0.0

    @property
    def sleeping_outcome(self) -> EngineOutcome | None:
        return self.outcomes.get(SLEEPING.method)

    @property
    def paused_outcome(self) -> EngineOutcome | None:
        return self.outcomes.get(PAUSED.method)

    @property
    def up(self) -> bool:
        o = self.sleeping_outcome
        return o is not None and o.ok

    def value(self, invariant: Invariant) -> Any:
        """This engine's answer for ``invariant`` (None while unknown; see ``known``)."""
        o = self.outcomes.get(invariant.method)
        return o.value if o is not None and o.ok and invariant.valid(o.value) else None

    def known(self, invariant: Invariant) -> bool:
        o = self.outcomes.get(invariant.method)
        return o is not None and o.ok and invariant.valid(o.value)

    @property
    def sleeping(self) -> bool | None:
        return self.value(SLEEPING) if self.known(SLEEPING) else None

    @property
    def paused(self) -> bool | None:
        if not self.up or not self.known(PAUSED):
            return None
        return bool(self.value(PAUSED))

    @property
    def weight_version(self) -> str | None:
        return self.value(WEIGHT_VERSION) if self.up else None

    @property
    def has_work(self) -> bool | None:
        """Whether vLLM says this rank should be stepped (None: not known this poll, or the
        rank did not answer ``is_sleeping`` or is hung: HTTP mode reads ``has_work`` from the
        API server's ``/metrics``, whose last values stay while the engine hangs)."""
        if self.hung or not self.up or not self.known(HAS_WORK):
            return None
        return bool(self.value(HAS_WORK))

    @property
    def requests(self) -> RequestCounts | None:
        """Its running and waiting requests as vLLM last published them (None: unknown)."""
        return self.detail.requests

    @property
    def drained(self) -> bool:
        """Known to hold no work: it answered ``has_work`` false (and no published count
        says otherwise)."""
        counts = self.requests
        return self.has_work is False and (counts is None or counts.total == 0)

    @property
    def state(self) -> str:
        """awake | asleep | paused | stalled | hung | unknown (vLLM's is_sleeping is also true
        while paused; hung: connected, but no answer for ``--hung-after``; stalled: awake,
        answering, holding requests, but no token computed for ``--stall-after``)."""
        if self.hung:
            return "hung"
        if self.sleeping is None:
            return "unknown"
        if self.paused:
            return "paused"
        if self.sleeping:
            return "asleep"
        return "stalled" if self.stalled else "awake"


def _unknown(method: str) -> ConsensusVerdict:
    return ConsensusVerdict(method, FleetState.UNKNOWN)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    taken_at_unix: float
    poll_duration_s: float
    engines: tuple[EngineSnapshot, ...]
    #: method → the fleet's verdict for that invariant.
    verdicts: Mapping[str, ConsensusVerdict]
    expected: int
    connected: int
    poll_number: int
    #: Whether this attach mode learns fault-tolerance statuses (relay mode cannot: the
    #: engines push them to the front end).
    fault_tolerance_known: bool = True
    #: Whether this attach mode learns each rank's request counts (owner mode cannot: no
    #: request flows through it, no coordinator publishes to it).
    request_counts_known: bool = True
    #: Each API server's elastic-EP operation as last read, in target order (HTTP and
    #: in-process mode); None where the attach mode has no API server to ask.
    elastic_ep: tuple[ElasticEpRead, ...] | None = None
    #: Whether this attach mode has a source of each rank's progress (owner and relay mode
    #: have none: no request flows through them).
    progress_known: bool = False

    def verdict(self, invariant: Invariant) -> ConsensusVerdict:
        return self.verdicts.get(invariant.method) or _unknown(invariant.method)

    @property
    def sleeping(self) -> ConsensusVerdict:
        return self.verdict(SLEEPING)

    @property
    def paused(self) -> ConsensusVerdict:
        return self.verdict(PAUSED)

    @property
    def weight_version(self) -> ConsensusVerdict:
        return self.verdict(WEIGHT_VERSION)

    @property
    def fault_reported(self) -> tuple[str, ...]:
        """Engines that reported a fault-tolerance status (``EngineDetail.fault_status``)."""
        return tuple(e.engine for e in self.engines if e.detail.fault_status is not None)

    @property
    def faulty(self) -> tuple[str, ...]:
        """Engines whose last fault-tolerance status is anything but healthy; the fleet
        is healthy without any (an engine that never reported counts as healthy: vLLM pushes
        changes)."""
        return tuple(
            e.engine for e in self.engines if e.detail.fault_status and e.detail.fault_status.faulty
        )

    @property
    def ready(self) -> bool:
        """Every expected engine finished its handshake and answered the last poll, and that
        poll is not stale (``EngineSnapshot.stale_s``)."""
        return (
            bool(self.engines)
            and self.connected == self.expected
            and all(e.up and not e.stale_s for e in self.engines)
        )


def empty_snapshot(
    details: list[EngineDetail],
    expected: int,
    connected: int,
    fault_tolerance_known: bool = True,
    request_counts_known: bool = True,
    elastic_ep: tuple[ElasticEpRead, ...] | None = None,
) -> FleetSnapshot:
    """The snapshot before the first poll: every engine unknown."""
    return FleetSnapshot(
        taken_at_unix=0.0,
        poll_duration_s=0.0,
        engines=tuple(EngineSnapshot(d.engine, d, {}, None) for d in details),
        verdicts={inv.method: _unknown(inv.method) for inv in INVARIANTS},
        expected=expected,
        connected=connected,
        poll_number=0,
        fault_tolerance_known=fault_tolerance_known,
        request_counts_known=request_counts_known,
        elastic_ep=elastic_ep,
    )
