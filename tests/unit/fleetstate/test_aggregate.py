"""Pure aggregation semantics (no sockets), including the three vLLM Rust-client behaviours."""

from __future__ import annotations

import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.parsing import parse_reset
from exporter.control.verdicts import ActionVerdict, classify
from exporter.error import InconsistentUtilityResults
from exporter.fleetstate.aggregate import (
    FleetState,
    aggregate_consensus,
    consensus,
)
from exporter.fleetstate.invariants import SLEEPING, require_type


def ok(engine: str, value: object) -> EngineOutcome:
    return EngineOutcome(engine, Outcome.OK, value)


def reset_verdict(outcomes: list[EngineOutcome]) -> ActionVerdict:
    """The prefix-cache reset's AND, as the admin action judges it."""
    return classify(parse_reset({}, b""), outcomes)


def test_engines_disagree_names_method_and_all_values() -> None:
    with pytest.raises(InconsistentUtilityResults) as err:
        consensus("is_sleeping", [True, False])
    assert err.value.method == "is_sleeping"
    assert err.value.values == [True, False]
    assert "is_sleeping" in str(err.value) and "True" in str(err.value)


def test_engines_agree_give_the_value() -> None:
    assert consensus("is_sleeping", [False, False, False]) is False
    verdict = aggregate_consensus("is_sleeping", [ok("0", True), ok("1", True)])
    assert verdict.state is FleetState.CONSISTENT and verdict.value is True


def test_empty_is_an_error_not_an_index_error() -> None:
    with pytest.raises(InconsistentUtilityResults) as err:
        consensus("is_sleeping", [])
    assert err.value.values == []
    verdict = aggregate_consensus("is_sleeping", [])
    assert verdict.state is FleetState.UNKNOWN
    assert isinstance(verdict.error, InconsistentUtilityResults) and verdict.error.values == []


def test_disagreement_names_every_engine() -> None:
    verdict = aggregate_consensus("is_sleeping", [ok("0", False), ok("1", True), ok("2", False)])
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.error is not None
    assert verdict.error.values == [False, True, False]
    assert verdict.error.engines == ["0", "1", "2"]
    assert "engine 1: True" in str(verdict.error)


def test_partial_answers_that_disagree_still_prove_inconsistency() -> None:
    outcomes = [ok("0", True), EngineOutcome("1", Outcome.TIMEOUT), ok("2", False)]
    verdict = aggregate_consensus("is_sleeping", outcomes)
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.missing == ("1",)


@pytest.mark.parametrize("missing", [Outcome.TIMEOUT, Outcome.FAILED, Outcome.DISCONNECTED])
def test_partial_answers_that_agree_are_unknown_not_their_value(missing: Outcome) -> None:
    verdict = aggregate_consensus("is_sleeping", [ok("0", True), EngineOutcome("1", missing)])
    assert verdict.state is FleetState.UNKNOWN
    assert verdict.value is None and verdict.error is None
    assert verdict.missing == ("1",)


def test_http_target_that_is_itself_inconsistent() -> None:
    target = EngineOutcome("node-a", Outcome.INCONSISTENT, values=(False, True))
    verdict = aggregate_consensus("is_sleeping", [target, ok("node-b", False)])
    assert verdict.state is FleetState.INCONSISTENT
    assert verdict.error is not None and [False, True] in verdict.error.values


def test_reset_all_true() -> None:
    verdict = reset_verdict([ok("0", True), ok("1", True)])
    assert verdict.success and verdict.outcome == "success" and verdict.failures == ()


def test_reset_one_false_names_that_engine() -> None:
    verdict = reset_verdict([ok("0", True), ok("1", False)])
    assert not verdict.success and verdict.outcome == "partial_failure"
    assert [(f.engine, f.reason) for f in verdict.failures] == [("1", "refused")]


def test_reset_reasons_told_apart() -> None:
    outcomes = [
        ok("0", False),
        EngineOutcome("1", Outcome.FAILED, error="Call to reset_prefix_cache method failed: x"),
        EngineOutcome("2", Outcome.TIMEOUT),
        EngineOutcome("3", Outcome.DISCONNECTED),
        ok("4", "yes"),
    ]
    verdict = reset_verdict(outcomes)
    reasons = {f.engine: f.reason for f in verdict.failures}
    assert reasons == {
        "0": "refused",
        "1": "failed",
        "2": "timeout",
        "3": "disconnected",
        "4": "failed",
    }
    assert verdict.outcome == "failure"
    assert verdict.failures[1].error == "Call to reset_prefix_cache method failed: x"


def test_reset_with_zero_engines_is_a_failure() -> None:
    verdict = reset_verdict([])
    assert not verdict.success and verdict.outcome == "failure"


def test_require_type_turns_odd_values_into_failures() -> None:
    checked = require_type(
        SLEEPING, [ok("0", True), ok("1", None), EngineOutcome("2", Outcome.TIMEOUT)]
    )
    assert [o.outcome for o in checked] == [Outcome.OK, Outcome.FAILED, Outcome.TIMEOUT]
