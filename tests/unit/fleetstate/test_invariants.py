"""``exporter/fleetstate/invariants.py``: the polled invariants as data, *unsupported* told
apart from failed, and answers of the wrong type turned into failures (pure)."""

from __future__ import annotations

import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.fleetstate.invariants import (
    BY_KEY,
    BY_METHOD,
    CHECKPOINT,
    INFERENCE_READY,
    INVARIANTS,
    ON_DEMAND,
    PAUSED,
    READS,
    SLEEPING,
    WEIGHT_VERSION,
    is_unsupported,
    require_type,
)
from exporter.protocol.strings import MAX_ENGINE_STRING, is_cut


def test_each_invariant_is_found_by_its_method_and_its_key() -> None:
    assert [inv.method for inv in INVARIANTS] == [
        "is_sleeping",
        "is_scheduler_paused",
        "get_weight_version",
        "checkpoint_state",
    ]
    assert BY_KEY == {
        "sleeping": SLEEPING,
        "paused": PAUSED,
        "weight_version": WEIGHT_VERSION,
        "checkpoint": CHECKPOINT,
        "inference_ready": INFERENCE_READY,  # a gate condition, asked on demand only
    }
    assert all(BY_METHOD[inv.method] is inv for inv in (*INVARIANTS, INFERENCE_READY))
    assert INFERENCE_READY not in READS and ON_DEMAND == (INFERENCE_READY,)


@pytest.mark.parametrize(
    ("outcome", "error", "unsupported"),
    [
        (
            Outcome.FAILED,
            "Call to x method failed: 'EngineCoreProc' object has no attribute 'x'",
            True,
        ),
        (Outcome.FAILED, "GET /is_paused: route not found on this server", True),
        (Outcome.FAILED, "unsupported by this engine (it said so before)", True),
        (Outcome.FAILED, "Call to x method failed: boom", False),
        (Outcome.FAILED, None, False),
        (Outcome.TIMEOUT, "object has no attribute", False),  # only a failed call can say so
        (Outcome.DISCONNECTED, "route not found on this server", False),
    ],
)
def test_unsupported_is_a_failed_call_that_says_the_method_is_missing(
    outcome: Outcome, error: str | None, unsupported: bool
) -> None:
    assert is_unsupported(EngineOutcome("0", outcome, error=error)) is unsupported


def test_booleans_are_booleans_and_a_weight_version_is_text_or_null() -> None:
    assert SLEEPING.valid(True) and not SLEEPING.valid(1) and not SLEEPING.valid(None)
    assert PAUSED.valid(False) and not PAUSED.valid("false")
    assert WEIGHT_VERSION.valid(None) and WEIGHT_VERSION.valid("v1")
    assert not WEIGHT_VERSION.valid(3) and not WEIGHT_VERSION.valid(["v1"])


def test_a_wrong_type_fails_with_a_bounded_message_and_keeps_its_round_trip() -> None:
    odd = EngineOutcome("0", Outcome.OK, ["x" * 1000], duration_s=0.004)
    (checked,) = require_type(WEIGHT_VERSION, [odd])
    assert checked.outcome is Outcome.FAILED and checked.duration_s == 0.004
    assert checked.error is not None and checked.error.startswith(
        "expected a string or null, got ["
    )
    assert is_cut(checked.error) and len(checked.error.encode()) <= MAX_ENGINE_STRING
    fine = EngineOutcome("1", Outcome.OK, None)
    assert require_type(WEIGHT_VERSION, [fine]) == [fine]
