"""``exporter/control/verdicts.py``: one verdict per action from its calls and read-back, and
the answer's body (pure). Every reason told apart, the reset's shape and the checksum verdicts
are in tests/unit/control/test_rl_semantics.py, tests/unit/web/test_admin.py and
tests/unit/fleetstate/test_checksums.py."""

from __future__ import annotations

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.control.parsing import parse_pause, parse_reset, parse_sleep, plain
from exporter.control.verdicts import (
    ActionVerdict,
    EngineVerdict,
    call_reason,
    classify,
    classify_checksums,
    drain_failure,
    engine_id,
    verdict_body,
)
from exporter.protocol.activity import RequestCounts
from exporter.protocol.strings import MAX_ENGINE_STRING, is_cut

SLEEP = parse_sleep({}, b"")


def ok(engine: str, value: object = None) -> EngineOutcome:
    return EngineOutcome(engine, Outcome.OK, value)


def test_an_unexpected_result_where_true_was_expected_is_a_bounded_failure() -> None:
    reason, error = call_reason(ok("0", list(range(10_000))), expect_true=True)
    assert reason == "failed"
    assert error is not None and is_cut(error) and len(error.encode()) <= MAX_ENGINE_STRING
    assert error.startswith("unexpected result [0, 1, 2")
    assert call_reason(ok("0", list(range(10_000))), expect_true=False) == (None, None)


def test_a_failed_call_keeps_its_reason_whatever_the_read_back_says() -> None:
    calls = [EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s")]
    verdict = classify(SLEEP, calls, {"0": ok("0", True)})
    assert verdict.engines == (EngineVerdict("0", "timeout", "no reply within 1s", True),)


def test_an_accepted_call_whose_state_cannot_be_read_back_is_unverified() -> None:
    calls = [ok("0"), ok("1"), ok("2")]
    readback = {
        "1": EngineOutcome("1", Outcome.TIMEOUT, error="no reply within 1s"),
        "2": ok("2", "yes"),  # not a boolean
    }
    results = classify(SLEEP, calls, readback).engines
    assert [(e.reason, e.state) for e in results] == [("unverified", None)] * 3
    assert results[0].error == "could not read is_sleeping: not read back"
    assert results[1].error == "could not read is_sleeping: no reply within 1s"
    assert (results[2].error or "").startswith("could not read is_sleeping")


def test_without_a_read_back_the_answer_carries_no_state() -> None:
    request = plain("reset_mm_cache", "reset_mm_cache")({}, b"")
    verdict = classify(request, [ok("0"), ok("1", False)])
    assert verdict.verified is False and verdict.success
    body = verdict_body(verdict, request.params, 0.1)
    assert body["verified"] is False
    assert all("state" not in entry for entry in body["engines"])
    read_back = classify(SLEEP, [ok("0")], {"0": ok("0", True)})
    assert verdict_body(read_back, SLEEP.params, 0.1)["engines"][0]["state"] is True


def test_engine_indices_are_numbers_and_target_names_stay_strings() -> None:
    assert engine_id("3") == 3 and engine_id("node-a/0") == "node-a/0"
    assert engine_id("-1") == "-1" and engine_id("") == ""
    # ASCII digits only: "²" made int() raise, U+0661 (Arabic-Indic one) read as engine 1.
    assert engine_id("\u00b2") == "\u00b2" and engine_id("\u0661") == "\u0661"
    verdict = ActionVerdict(
        "sleep",
        (
            EngineVerdict("3", "timeout"),
            EngineVerdict("node-a/0", "refused"),
            EngineVerdict("4", None),
        ),
        verified=False,
    )
    body = verdict_body(verdict, {}, 0.123456789)
    assert body["failed_engines"] == [3, "node-a/0"]
    assert [e["engine"] for e in body["engines"]] == [3, "node-a/0", 4]
    assert body["duration_s"] == 0.123457


def test_no_engine_at_all_is_a_failure_never_a_success() -> None:
    verdict = classify(parse_reset({}, b""), [])
    assert not verdict.success and verdict.outcome == "failure" and verdict.status == 502


def test_checksums_of_an_unreadable_shape_fail_that_engine_only() -> None:
    good = [{"dp0/pp0/tp0/w": "aa11"}]
    calls = [
        ok("0", good),
        ok("1", good),
        ok("2", "not a list of maps"),
        ok("3", [{7: "aa11"}]),
        EngineOutcome("4", Outcome.DISCONNECTED, error="engine is not connected"),
    ]
    verdict, comparisons = classify_checksums("verify_weights", calls)
    reasons = [(e.engine, e.reason) for e in verdict.engines]
    assert reasons == [
        ("0", None),
        ("1", None),
        ("2", "failed"),
        ("3", "failed"),
        ("4", "disconnected"),
    ]
    assert verdict.engines[2].error == "expected a list of {parameter: checksum} maps"
    assert verdict.engines[3].error == "parameter names must be strings"
    assert set(comparisons) == {"0", "1"}
    assert verdict.outcome == "partial_failure"


# -- an action that must leave every engine drained -------------------------------------------

PAUSE_WAIT = parse_pause({"mode": ["wait"]}, b"")


def test_a_drained_engine_has_has_work_false_and_no_published_request() -> None:
    assert drain_failure((ok("0", False), None)) is None
    assert drain_failure((ok("0", False), RequestCounts(0, 0))) is None
    assert drain_failure((ok("0", True), RequestCounts(0, 2))) == (
        "paused, but it still has work (running 0, waiting 2)"
    )
    assert drain_failure((ok("0", True), None)) == "paused, but it still has work"
    assert drain_failure((ok("0", False), RequestCounts(1, 0))) == (
        "paused, has_work is false but vLLM publishes requests (running 1, waiting 0)"
    )


def test_work_that_cannot_be_read_is_never_drained() -> None:
    assert drain_failure(None) == "could not read has_work: not read back"
    timeout = EngineOutcome("0", Outcome.TIMEOUT, error="no reply within 1s")
    assert drain_failure((timeout, RequestCounts(0, 0))) == (
        "could not read has_work: no reply within 1s"
    )
    assert drain_failure((EngineOutcome("0", Outcome.DISCONNECTED), None)) == (
        "could not read has_work: disconnected"
    )
    for hostile in ("yes", 1, None, [False]):  # not type-checked: not False, so not drained
        assert drain_failure((ok("0", hostile), None)) == "paused, but it still has work"


def test_a_paused_engine_still_holding_work_is_unverified_naming_its_counts() -> None:
    calls = [ok("0"), ok("1"), ok("2"), EngineOutcome("3", Outcome.TIMEOUT, error="late")]
    readback = {e: ok(e, True) for e in "0123"}
    drain = {
        "0": (ok("0", False), RequestCounts(0, 0)),
        "1": (ok("1", True), RequestCounts(0, 1)),
        # engine 2: its has_work was not read back
        "3": (ok("3", True), None),
    }
    verdict = classify(PAUSE_WAIT, calls, readback, drain)
    assert [(e.engine, e.reason, e.state) for e in verdict.engines] == [
        ("0", None, True),
        ("1", "unverified", True),
        ("2", "unverified", True),
        ("3", "timeout", True),  # its own call's failure comes first
    ]
    assert verdict.engines[1].error == "paused, but it still has work (running 0, waiting 1)"
    assert verdict.engines[2].error == "could not read has_work: not read back"
    assert verdict.status == 502 and verdict.outcome == "partial_failure"
    body = verdict_body(verdict, PAUSE_WAIT.params, 0.1)
    assert body["failed_engines"] == [1, 2, 3]


def test_a_state_that_is_not_the_expected_one_is_named_before_the_work() -> None:
    verdict = classify(PAUSE_WAIT, [ok("0")], {"0": ok("0", False)}, {"0": (ok("0", True), None)})
    assert verdict.engines[0].reason == "unverified"
    assert verdict.engines[0].error == "accepted, but is_scheduler_paused is False, not True"


def test_an_action_that_does_not_wait_for_the_work_ignores_it() -> None:
    pause = parse_pause({}, b"")
    busy = {"0": (ok("0", True), RequestCounts(3, 3))}
    assert classify(pause, [ok("0")], {"0": ok("0", True)}, busy).success
    assert classify(PAUSE_WAIT, [ok("0")], {"0": ok("0", True)}, None).success
