"""``snapshot_steps`` (``exporter.control.build``): a poll's snapshot from its values alone.
Built twice from the same values it is the same snapshot and the values are unchanged; hung and
stalled come from the values and the rules; a method every engine lacks reads unknown."""

from __future__ import annotations

import copy
from typing import Any

from exporter.base.steps import run_steps
from exporter.client.fleet import EngineDetail, EngineOutcome, Outcome
from exporter.control.build import (
    PollInputs,
    SnapshotRules,
    answers_by_engine,
    fleet_verdicts,
    snapshot_steps,
)
from exporter.fleetstate.aggregate import FleetState
from exporter.protocol.activity import RequestCounts
from exporter.protocol.progress import RankProgress

RULES = SnapshotRules(10.0, 60.0, True, True, None)


def ok(engine: str, value: Any) -> EngineOutcome:
    return EngineOutcome(engine, Outcome.OK, value)


def inputs(**changes: Any) -> PollInputs:
    details = {
        "0": EngineDetail("0", True, "a"),
        "1": EngineDetail("1", True, "b", requests=RequestCounts(2, 0)),
    }
    results = {
        "is_sleeping": [ok("0", False), ok("1", False)],
        "is_scheduler_paused": [ok("0", False), ok("1", False)],
        "has_work": [ok("0", False), ok("1", True)],
    }
    values: dict[str, Any] = {
        "results": results,
        "by_engine": answers_by_engine(results, details),
        "details": details,
        "progress": {
            "0": RankProgress(10, 900.0, "stat_logger", 0),
            "1": RankProgress(50, 900.0, "stat_logger", 2),
        },
        "clocks": {"0": (1000.0, 0.0), "1": (1000.0, 0.0)},
        "unsupported": {},
        "unsupported_everywhere": {},
        "duration_s": 0.1,
        "now": 1000.0,
        "poll_number": 7,
    }
    values.update(changes)
    return PollInputs(**values)


def test_the_same_values_build_the_same_snapshot_and_stay_unchanged() -> None:
    given = inputs()
    kept = copy.deepcopy(given)
    first, second = run_steps(snapshot_steps(given, RULES)), run_steps(snapshot_steps(given, RULES))
    assert first == second and given == kept
    assert (first.poll_number, first.expected, first.connected) == (7, 2, 2)
    assert [e.state for e in first.engines] == ["awake", "stalled"]  # 100 s without a token
    assert first.engines[1].progress_age_s == 100.0 and first.progress_known


def test_hung_comes_from_the_clocks_and_the_rules() -> None:
    snap = run_steps(snapshot_steps(inputs(clocks={"0": (990.0, 12.0), "1": (None, 0.0)}), RULES))
    assert [e.hung for e in snap.engines] == [True, False]
    assert snap.engines[0].state == "hung" and snap.engines[1].last_success_unix is None


def test_no_progress_source_is_never_stalled() -> None:
    snap = run_steps(snapshot_steps(inputs(progress=None), RULES))
    assert [e.state for e in snap.engines] == ["awake", "awake"] and not snap.progress_known


def test_a_method_every_engine_lacks_is_unknown_not_an_empty_fleet() -> None:
    verdicts = fleet_verdicts({"get_weight_version": []}, {"get_weight_version": True})
    assert verdicts["get_weight_version"].state is FleetState.UNKNOWN
    assert fleet_verdicts({"has_work": []}, {}) == {}  # per rank only: no fleet verdict
