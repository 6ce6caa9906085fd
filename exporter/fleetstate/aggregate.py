"""Pure aggregation of per-engine outcomes, with vLLM's Rust-client semantics.

No sockets and no clocks here: the poller and the probe feed these functions the outcomes of
one fan-out and publish what they return (the admin actions' verdicts, the reset's AND among
them, are ``exporter.control.verdicts``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.error import InconsistentUtilityResults


class FleetState(str, enum.Enum):
    CONSISTENT = "consistent"
    INCONSISTENT = "inconsistent"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class ConsensusVerdict:
    """The aggregate of a consensus call (``is_sleeping``, ``is_scheduler_paused``)."""

    method: str
    state: FleetState
    value: Any = None  # only meaningful when CONSISTENT
    error: InconsistentUtilityResults | None = None
    #: Engines whose value is unknown (failed, timed out, disconnected).
    missing: tuple[str, ...] = ()


def fleet_outcome(engines: int, failed: int, unsupported: int = 0) -> str:
    """An all-engines action: success (none failed), unsupported (every engine lacks the
    method: an older vLLM, not a fault), failure (none confirmed; also for zero engines), or
    partial_failure (some confirmed; the engines that lack the method are among its failures)."""
    if engines and not failed:
        return "success"
    if engines and unsupported == engines:
        return "unsupported"
    if failed == engines:
        return "failure"
    return "partial_failure"


def consensus(method: str, values: Sequence[Any]) -> Any:
    """vLLM Rust client's consensus: all equal → that value; otherwise (or empty) an error."""
    if not values or any(v != values[0] for v in values[1:]):
        raise InconsistentUtilityResults(method, values)
    return values[0]


def aggregate_consensus(method: str, outcomes: Sequence[EngineOutcome]) -> ConsensusVerdict:
    """Strict DP aggregation that keeps *unknown* apart from *inconsistent*.

    Answers that already disagree prove an inconsistency even while other engines are silent;
    answers that agree while some engine is silent give UNKNOWN (not their value). No outcomes
    at all is UNKNOWN carrying ``InconsistentUtilityResults(method, [])``.
    """
    if not outcomes:
        return ConsensusVerdict(
            method, FleetState.UNKNOWN, error=InconsistentUtilityResults(method, [])
        )
    engines: list[str] = []
    values: list[Any] = []
    distinct: list[Any] = []
    inconsistent_target = False
    for o in outcomes:
        if o.outcome is Outcome.OK:
            engines.append(o.engine)
            values.append(o.value)
            if o.value not in distinct:
                distinct.append(o.value)
        elif o.outcome is Outcome.INCONSISTENT:
            engines.append(o.engine)
            values.append(list(o.values))
            inconsistent_target = True
    missing = tuple(
        o.engine for o in outcomes if o.outcome not in (Outcome.OK, Outcome.INCONSISTENT)
    )
    if inconsistent_target or len(distinct) > 1:
        error = InconsistentUtilityResults(method, values, engines=engines)
        return ConsensusVerdict(method, FleetState.INCONSISTENT, error=error, missing=missing)
    if missing:
        return ConsensusVerdict(method, FleetState.UNKNOWN, missing=missing)
    return ConsensusVerdict(method, FleetState.CONSISTENT, value=distinct[0])
