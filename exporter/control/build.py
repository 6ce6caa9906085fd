"""One poll's ``FleetSnapshot`` from the poll's values alone (pure).

The poller reads the fleet (``exporter.control.fleetread``), moves what it keeps across polls
(each engine's last answer), and hands the rest here as values: ``snapshot_steps`` builds the
snapshot a step per ``ENGINES_PER_STEP`` engines and changes nothing, so building it again
from the same values gives the same snapshot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from exporter.base.steps import Steps, every
from exporter.client.fleet import EngineDetail, EngineOutcome
from exporter.fleetstate.activity import is_stalled
from exporter.fleetstate.aggregate import ConsensusVerdict, FleetState, aggregate_consensus
from exporter.fleetstate.invariants import INVARIANTS
from exporter.fleetstate.snapshot import EngineSnapshot, FleetSnapshot
from exporter.protocol.elastic_ep import ElasticEpRead
from exporter.protocol.progress import RankProgress

#: The reads with a fleet verdict (strict consensus); ``has_work`` is per rank only.
CONSENSUS_METHODS = frozenset(inv.method for inv in INVARIANTS)


def answers_by_engine(
    results: Mapping[str, list[EngineOutcome]], details: Mapping[str, EngineDetail]
) -> dict[str, dict[str, EngineOutcome]]:
    """Engine → method → its outcome this poll (every engine of ``details``, answered or not)."""
    by_engine: dict[str, dict[str, EngineOutcome]] = {engine: {} for engine in details}
    for method, outcomes in results.items():
        for o in outcomes:
            by_engine.setdefault(o.engine, {})[method] = o
    return by_engine


@dataclass(frozen=True)
class PollInputs:
    """Everything one poll learnt, as values: what ``snapshot_steps`` builds the snapshot of."""

    results: Mapping[str, list[EngineOutcome]]
    by_engine: Mapping[str, Mapping[str, EngineOutcome]]
    #: Engine → its details as the read left them, and its progress (None: no source).
    details: Mapping[str, EngineDetail]
    progress: Mapping[str, RankProgress] | None
    #: Engine → (its last successful answer, unix; seconds without any answer).
    clocks: Mapping[str, tuple[float | None, float]]
    #: Engine → the read methods it said it lacks; method → whether every engine lacks it.
    unsupported: Mapping[str, frozenset[str]]
    unsupported_everywhere: Mapping[str, bool]
    duration_s: float
    now: float
    poll_number: int


@dataclass(frozen=True)
class SnapshotRules:
    """The settings and what the attach mode can know, as a snapshot needs them."""

    hung_after_s: float
    stall_after_s: float
    fault_tolerance_known: bool
    request_counts_known: bool
    elastic_ep: tuple[ElasticEpRead, ...] | None


def snapshot_steps(inputs: PollInputs, rules: SnapshotRules) -> Steps[FleetSnapshot]:
    """The poll's snapshot from its values alone (pure), in steps of ``ENGINES_PER_STEP``."""
    details, progress = inputs.details, inputs.progress or {}
    engines = []
    for position, (engine, detail) in enumerate(details.items(), 1):
        if every(position):
            yield
        last_success, silent = inputs.clocks[engine]
        made = progress.get(engine)
        snapshot = EngineSnapshot(
            engine,
            detail,
            inputs.by_engine.get(engine, {}),
            last_success,
            inputs.unsupported.get(engine, frozenset()),
            unresponsive_s=silent,
            hung=silent >= rules.hung_after_s,
            progress=made,
            progress_age_s=None if made is None else made.age_s(inputs.now),
        )
        if is_stalled(snapshot, made, inputs.now, rules.stall_after_s):
            snapshot = dataclasses.replace(snapshot, stalled=True)
        engines.append(snapshot)
    return FleetSnapshot(
        taken_at_unix=inputs.now,
        poll_duration_s=inputs.duration_s,
        engines=tuple(engines),
        verdicts=fleet_verdicts(inputs.results, inputs.unsupported_everywhere),
        expected=len(details),
        connected=sum(1 for d in details.values() if d.connected),
        poll_number=inputs.poll_number,
        fault_tolerance_known=rules.fault_tolerance_known,
        request_counts_known=rules.request_counts_known,
        elastic_ep=rules.elastic_ep,
        progress_known=inputs.progress is not None,
    )


def fleet_verdicts(
    results: Mapping[str, list[EngineOutcome]], unsupported_everywhere: Mapping[str, bool]
) -> dict[str, ConsensusVerdict]:
    """The fleet's verdict of each consensus method a poll read (pure)."""
    verdicts = {}
    for method, outcomes in results.items():
        if method not in CONSENSUS_METHODS:  # ranks differ in their work by design
            continue
        # Unsupported by every engine: unknown, without the "no results" error that an empty
        # fleet gets.
        verdicts[method] = (
            ConsensusVerdict(method, FleetState.UNKNOWN)
            if unsupported_everywhere.get(method) and not outcomes
            else aggregate_consensus(method, outcomes)
        )
    return verdicts
