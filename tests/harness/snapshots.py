"""Fleet snapshots from plain values, for the pure readers of one poll (the snapshot's own
properties, the metric families, the ``/status`` document)."""

from __future__ import annotations

from typing import Any

from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.fleetstate.aggregate import aggregate_consensus
from exporter.fleetstate.invariants import INVARIANTS
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot


def engine_snapshot(
    name: str,
    detail: EngineDetail | None = None,
    last_success_unix: float | None = None,
    **answers: Any,
) -> EngineSnapshot:
    """``answers``: method → value (an OK answer) or an ``EngineOutcome`` as it is."""
    outcomes = {
        method: v if isinstance(v, EngineOutcome) else EngineOutcome(name, Outcome.OK, v)
        for method, v in answers.items()
    }
    detail = detail or EngineDetail(name, True, f"fake://{name}")
    return EngineSnapshot(name, detail, outcomes, last_success_unix)


def polled(
    *engines: EngineSnapshot,
    expected: int | None = None,
    connected: int | None = None,
    taken_at_unix: float = 50.0,
    fault_tolerance_known: bool = True,
) -> FleetSnapshot:
    """Poll 1 of ``engines``: each invariant some engine answered aggregated as the poller
    does."""
    verdicts = {
        inv.method: aggregate_consensus(
            inv.method, [e.outcomes[inv.method] for e in engines if inv.method in e.outcomes]
        )
        for inv in INVARIANTS
        if any(inv.method in e.outcomes for e in engines)
    }
    count = len(engines)
    return FleetSnapshot(
        taken_at_unix=taken_at_unix,
        poll_duration_s=0.25,
        engines=engines,
        verdicts=verdicts,
        expected=count if expected is None else expected,
        connected=count if connected is None else connected,
        poll_number=1,
        fault_tolerance_known=fault_tolerance_known,
    )
