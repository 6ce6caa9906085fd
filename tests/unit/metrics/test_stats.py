"""``exporter/metrics/stats.py``: the counters and plain-data histograms the collector renders,
the generation every change bumps (the render cache's key), the series forgotten with the
engines that left, and the last admin action as its answer said."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from exporter.client.fleet import EngineOutcome, Outcome
from exporter.metrics.catalog import ADMIN_ACTIONS, RESET_FAILURE_REASONS, RESET_OUTCOMES
from exporter.metrics.stats import Histogram, LastAction, Stats


def test_a_value_lands_in_the_first_bucket_that_holds_it_and_rows_are_cumulative() -> None:
    hist = Histogram(("method",), (1.0, 0.1))  # bounds are sorted
    child = hist.labels("b")
    for value in (0.1, 0.5, 1.0, 7.0):
        child.observe(value)
    hist.labels("a").observe(0.05)
    assert hist.rows() == [
        (("a",), [("0.1", 1.0), ("1.0", 1.0), ("+Inf", 1.0)], 0.05),
        (("b",), [("0.1", 1.0), ("1.0", 3.0), ("+Inf", 4.0)], 8.6),
    ]
    with pytest.raises(ValueError, match="expected labels"):
        hist.labels("a", "b")


def test_a_value_in_no_bucket_counts_in_inf_only() -> None:
    """NaN holds in no bucket (as prometheus_client's histogram counts it: in +Inf)."""
    hist = Histogram(("method",), (0.1, 1.0))
    hist.labels("a").observe(float("nan"))
    hist.labels("a").observe(float("inf"))
    ((_, buckets, _),) = hist.rows()
    assert buckets == [("0.1", 0.0), ("1.0", 0.0), ("+Inf", 2.0)]


def test_an_unlabelled_histogram_is_published_at_zero_from_the_start() -> None:
    stats = Stats()
    ((labels, buckets, total),) = stats.reset_durations.rows()
    assert labels == () and total == 0.0 and buckets[-1] == ("+Inf", 0.0)
    assert stats.call_durations.rows() == []  # labelled: a row per method once called


def test_only_real_round_trips_are_timed_and_every_outcome_is_counted() -> None:
    stats = Stats()
    stats.record_calls(
        "is_sleeping",
        [
            EngineOutcome("0", Outcome.OK, True, duration_s=0.002),
            EngineOutcome("1", Outcome.FAILED, error="boom", duration_s=0.003),
            EngineOutcome("2", Outcome.TIMEOUT, duration_s=1.0),
            EngineOutcome("3", Outcome.DISCONNECTED),
            EngineOutcome("4", Outcome.OK, True),  # no duration measured
        ],
    )
    assert stats.utility_calls == {
        ("is_sleeping", "0", "ok"): 1,
        ("is_sleeping", "1", "failed"): 1,
        ("is_sleeping", "2", "timeout"): 1,
        ("is_sleeping", "3", "disconnected"): 1,
        ("is_sleeping", "4", "ok"): 1,
    }
    ((labels, buckets, total),) = stats.call_durations.rows()
    assert labels == ("is_sleeping",) and buckets[-1] == ("+Inf", 2.0)
    assert total == pytest.approx(0.005)


def test_preset_starts_every_outcome_series_at_zero() -> None:
    stats = Stats()
    stats.preset(["0", "1"])
    assert set(stats.inconsistent_results) == {
        "is_sleeping",
        "is_scheduler_paused",
        "get_weight_version",
    }
    assert set(stats.resets) == set(RESET_OUTCOMES)
    assert set(stats.admin_actions) == {(a, o) for a in ADMIN_ACTIONS for o in RESET_OUTCOMES}
    assert set(stats.reset_engine_failures) == {
        (e, r) for e in ("0", "1") for r in RESET_FAILURE_REASONS
    }
    assert dict(stats.confirmed_resets) == {"0": 0, "1": 0}
    assert not any(stats.resets.values()) and not any(stats.admin_actions.values())


def test_the_series_of_engines_that_left_are_forgotten_and_the_others_kept() -> None:
    stats = Stats()
    stats.preset(["0", "1"])
    stats.record_calls("is_sleeping", [EngineOutcome(e, Outcome.OK, True) for e in ("0", "1")])
    stats.record_action("sleep", "partial_failure", [("1", "timeout")])
    stats.record_confirmed_resets(["0", "1"], "pause", 5.0)
    stats.record_weight_verification({"0": 0, "1": 3})
    stats.keep_engines(["0"])
    assert {engine for _, engine, _ in stats.utility_calls} == {"0"}
    assert stats.admin_action_failures == {}
    assert {engine for engine, _ in stats.reset_engine_failures} == {"0"}
    assert dict(stats.confirmed_resets) == {"0": 1} and set(stats.last_resets) == {"0"}
    assert stats.weight_checksum_mismatches == {"0": 0}
    # Fleet-wide series stay.
    assert stats.admin_actions[("sleep", "partial_failure")] == 1


CHANGES: list[Callable[[Stats], None]] = [
    lambda s: s.preset(["0"]),
    lambda s: s.keep_engines([]),
    lambda s: s.record_calls("is_sleeping", []),
    lambda s: s.record_poll([]),
    lambda s: s.record_reset("success"),
    lambda s: s.record_confirmed_resets([], "pause", 1.0),
    lambda s: s.record_action("sleep", "success"),
    lambda s: s.record_weight_verification({}),
    lambda s: s.record_admin_request("sleep", 200),
    lambda s: s.record_last_action("sleep", 200, {}, 1.0),
]


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_bumps_the_generation(change: Callable[[Stats], None]) -> None:
    stats = Stats()
    before = stats.generation
    change(stats)
    assert stats.generation == before + 1


def test_a_reset_records_its_outcome_failures_duration_and_success_time() -> None:
    stats = Stats()
    stats.record_reset("partial_failure", [("1", "refused")], duration_s=0.2, success_unix=None)
    stats.record_reset("success", duration_s=0.3, success_unix=42.0)
    assert stats.resets == {"partial_failure": 1, "success": 1}
    assert stats.reset_engine_failures == {("1", "refused"): 1}
    assert stats.last_reset_success_unix == 42.0
    ((_, buckets, total),) = stats.reset_durations.rows()
    assert buckets[-1] == ("+Inf", 2.0) and total == pytest.approx(0.5)
    stats.record_poll(["is_sleeping", "is_sleeping"])
    assert stats.polls == 1 and stats.inconsistent_results["is_sleeping"] == 2


def test_the_last_action_reads_either_answer_shape_and_ignores_junk() -> None:
    reset = LastAction.from_body(
        "reset_prefix_cache",
        502,
        {
            "outcome": "partial_failure",
            "flags": {"reset_running_requests": False},
            "engines": [
                {"engine": 0, "ok": True, "reason": None, "error": None},
                "not an entry",
                {"engine": "node-a/1", "ok": False, "reason": "refused", "error": "no"},
            ],
            "duration_s": 0.5,
        },
        unix=10.0,
    )
    assert reset.params == {"reset_running_requests": False}
    assert reset.engines == (("0", True, None, None), ("node-a/1", False, "refused", "no"))
    assert (reset.status, reset.outcome, reset.duration_s, reset.error) == (
        502,
        "partial_failure",
        0.5,
        None,
    )
    odd = LastAction.from_body("sleep", 503, {"params": [1], "duration_s": "soon", "error": 7}, 1.0)
    assert odd.outcome == "failure" and odd.params == {} and odd.duration_s is None
    assert odd.error == "7" and odd.engines == ()
