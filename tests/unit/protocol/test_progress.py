"""Forward progress per rank (``exporter.protocol.progress``): token counts read from vLLM's
``/metrics`` with every rank's samples checked (a hostile value is unknown, never zero), and
the clock of when a count last grew."""

from __future__ import annotations

import math

import pytest

from exporter.protocol.activity import MAX_METRICS_LINE as MAX_LINE
from exporter.protocol.progress import (
    MAX_TOKENS,
    ProgressClock,
    RankProgress,
    metrics_tokens,
    read_tokens,
    total_tokens,
)


def exposition(*samples: tuple[str, str, str]) -> str:
    """``(family, engine label, value)`` lines after a process metric, as vLLM's /metrics."""
    lines = ['python_gc_objects_collected_total{generation="0"} 12.0']
    for family, engine, value in samples:
        lines.append(f'vllm:{family}_tokens_total{{engine="{engine}",model_name="m"}} {value}')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("value", "read"),
    [
        *[(0, 0), (12, 12), (3.0, 3), (MAX_TOKENS, MAX_TOKENS), (MAX_TOKENS + 1, None)],
        *[(-1, None), (1.5, None), (math.nan, None), (math.inf, None), (True, None)],
        *[("7", None), (None, None)],
    ],
)
def test_a_token_count_is_a_whole_number_in_bounds(value: object, read: int | None) -> None:
    assert read_tokens(value) == read


def test_each_rank_sums_its_prompt_and_generated_tokens_over_every_series() -> None:
    text = exposition(
        ("prompt", "0", "10.0"),
        ("generation", "0", "90.0"),
        ("generation", "1", "5.0"),
        ("generation", "1", "5.0"),  # a second API server's series of the same rank
    )
    assert metrics_tokens(text) == {0: 100, 1: 10}
    assert total_tokens(text) == 110


def test_no_token_counter_at_all_is_unknown_not_zero() -> None:
    assert metrics_tokens('vllm:num_requests_running{engine="0"} 1.0\n') is None
    assert total_tokens("") is None


@pytest.mark.parametrize("hostile", ["-5.0", "NaN", "+Inf", "1e30", "2.5", "many", ""])
def test_a_hostile_sample_makes_its_rank_unknown_and_the_sum_too(hostile: str) -> None:
    text = exposition(("generation", "0", "5.0"), ("generation", "1", hostile))
    assert metrics_tokens(text) == {0: 5, 1: None}
    assert total_tokens(text) is None


def test_lines_past_the_bound_and_series_without_a_rank_are_not_read() -> None:
    long = 'vllm:generation_tokens_total{engine="0",pad="' + "x" * MAX_LINE + '"} 9.0'
    unnamed = 'vllm:generation_tokens_total{model_name="m"} 7.0'
    digits = 'vllm:generation_tokens_total{engine="\uff11"} 7.0'  # a fullwidth digit
    assert metrics_tokens("\n".join([long, unnamed, digits, *exposition().splitlines()])) == {}


def test_the_clock_starts_at_the_first_read_and_moves_only_when_the_count_changes() -> None:
    clock = ProgressClock("metrics")
    assert clock.observe("0", 100, 10.0) == RankProgress(100, 10.0, "metrics")
    assert clock.observe("0", 100, 15.0).last_progress_unix == 10.0
    grown = clock.observe("0", 130, 20.0)
    assert (grown.tokens, grown.last_progress_unix, grown.age_s(26.0)) == (130, 20.0, 6.0)
    restarted = clock.observe("0", 3, 30.0)  # the counter went down: a restart
    assert (restarted.tokens, restarted.last_progress_unix) == (3, 30.0)
    clock.forget("0")
    assert clock.observe("0", 3, 40.0).last_progress_unix == 40.0
    assert RankProgress(1, 50.0, "metrics").age_s(40.0) == 0.0  # never negative
    assert RankProgress(1, 50.0, "metrics").stall_age_s(60.0) == 10.0  # no work start: the token
    assert RankProgress(1, 50.0, "metrics", 1, 55.0).stall_age_s(60.0) == 5.0  # the later one
    assert RankProgress(1, 50.0, "metrics", 1, 45.0).stall_age_s(60.0) == 10.0
    assert RankProgress(1, 50.0, "metrics", 1, 70.0).stall_age_s(60.0) == 0.0
