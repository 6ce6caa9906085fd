"""Pure aggregation of per-engine outcomes, with vLLM's Rust-client semantics.

No sockets and no clocks here: the poller, the admin endpoint and the probe feed these
functions the outcomes of one fan-out and publish what they return.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.error import InconsistentUtilityResults, NoEngines
from exporter.protocol.strings import bound_text


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


@dataclass(frozen=True, slots=True)
class EngineFailure:
    engine: str
    reason: str  # refused | failed | timeout | disconnected
    error: str | None


@dataclass(frozen=True, slots=True)
class AllTrueVerdict:
    """The AND of a call such as ``reset_prefix_cache``: true only if every engine said true."""

    method: str
    success: bool
    engines: tuple[EngineOutcome, ...]
    failures: tuple[EngineFailure, ...]

    @property
    def outcome(self) -> str:
        return fleet_outcome(len(self.engines), len(self.failures))


def fleet_outcome(engines: int, failed: int) -> str:
    """An all-engines action: success (none failed), failure (none confirmed; also for zero
    engines), or partial_failure."""
    if engines and not failed:
        return "success"
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


def reset_failure_reason(outcome: EngineOutcome) -> str | None:
    """Why an engine did not confirm an all-true call; None when it confirmed."""
    if outcome.outcome is Outcome.OK:
        if outcome.value is True:
            return None
        return "refused" if outcome.value is False else "failed"
    if outcome.outcome is Outcome.TIMEOUT:
        return "timeout"
    if outcome.outcome is Outcome.DISCONNECTED:
        return "disconnected"
    return "failed"


def aggregate_all_true(method: str, outcomes: Sequence[EngineOutcome]) -> AllTrueVerdict:
    """AND across engines; per-engine reasons kept. Zero engines is an error (NoEngines)."""
    if not outcomes:
        raise NoEngines(f"{method}: no engine to call")
    failures = []
    for o in outcomes:
        reason = reset_failure_reason(o)
        if reason is not None:
            error = o.error
            if reason == "failed" and o.outcome is Outcome.OK:
                # Strings in it are cut already; a long list of numbers is not.
                error = bound_text(f"unexpected result {o.value!r}")
            failures.append(EngineFailure(o.engine, reason, error))
    return AllTrueVerdict(method, not failures, tuple(outcomes), tuple(failures))


def require_bool(outcomes: Sequence[EngineOutcome]) -> list[EngineOutcome]:
    """Turn OK outcomes whose value is not a bool into FAILED ones (for boolean methods)."""
    checked = []
    for o in outcomes:
        if o.outcome is Outcome.OK and not isinstance(o.value, bool):
            o = EngineOutcome(
                o.engine,
                Outcome.FAILED,
                error=bound_text(f"expected a boolean, got {o.value!r}"),
                duration_s=o.duration_s,
            )
        checked.append(o)
    return checked
