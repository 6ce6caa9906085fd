"""``has_work`` of a dev-routes target, socket-free: vLLM's ``GET /metrics`` → the outcome and
the target's running and waiting requests (``read_activity``; over real HTTP:
tests/integration/http/test_http_activity.py). Fails closed: no count is ever guessed zero."""

from __future__ import annotations

import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.replies import NOT_PUBLISHED, interpret, read_activity
from exporter.fleetstate.invariants import is_unsupported
from exporter.protocol.activity import MAX_METRICS_LINE, MAX_RANKS, RequestCounts
from exporter.sim.api_wire import metrics_text

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"


def series(name: str, rank: int | str, value: str, model: str = "m") -> str:
    return f'{name}{{engine="{rank}",model_name="{model}"}} {value}\n'


def body(*lines: str) -> bytes:
    """A vLLM-like exposition: unrelated families around the given lines."""
    return (
        "# HELP python_gc_objects_collected_total Objects collected during gc\n"
        "# TYPE python_gc_objects_collected_total counter\n"
        'python_gc_objects_collected_total{generation="0"} 12.0\n'
        f"# HELP {RUNNING} Number of requests in model execution batches.\n"
        f"# TYPE {RUNNING} gauge\n"
        + "".join(lines)
        + 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    ).encode()


def pair(rank: int, running: str, waiting: str) -> tuple[str, str]:
    return series(RUNNING, rank, running), series(WAITING, rank, waiting)


def test_the_targets_counts_are_the_sum_over_its_ranks() -> None:
    outcome, counts = read_activity(
        "t", 200, body(*pair(0, "2.0", "1.0"), *pair(1, "3.0", "0.0")), 0.01
    )
    assert (outcome.engine, outcome.outcome, outcome.value) == ("t", Outcome.OK, True)
    assert outcome.duration_s == 0.01
    assert counts == RequestCounts(5, 1)


def test_no_request_running_or_waiting_is_no_work() -> None:
    outcome, counts = read_activity(
        "t", 200, body(*pair(0, "0.0", "0.0"), *pair(1, "0", "0")), 0.01
    )
    assert (outcome.outcome, outcome.value, counts) == (Outcome.OK, False, RequestCounts(0, 0))


def test_waiting_alone_is_work() -> None:
    """A paused scheduler's queue: nothing runs, yet the rank is not drained."""
    outcome, counts = read_activity("t", 200, body(*pair(0, "0.0", "4.0")), None)
    assert (outcome.value, counts) == (True, RequestCounts(0, 4))


def test_a_series_published_twice_is_summed() -> None:
    """Two API-server processes each publish a rank's series: the rank's is their sum."""
    text = body(*pair(0, "1.0", "0.0"), *pair(0, "2.0", "1.0"), *pair(1, "0.0", "0.0"))
    assert read_activity("t", 200, text, None)[1] == RequestCounts(3, 1)


def test_a_timestamp_after_the_value_is_read_past() -> None:
    text = body(series(RUNNING, 0, "1.0 1700000000000"), series(WAITING, 0, "0.0 1700000000000"))
    assert read_activity("t", 200, text, None)[1] == RequestCounts(1, 0)


def test_the_simulated_servers_exposition_reads_back() -> None:
    text = metrics_text({4: (1, 2), 5: (0, 0)}).encode()
    assert read_activity("t", 200, text, None)[1] == RequestCounts(1, 2)


@pytest.mark.parametrize(
    "text",
    [
        b"",
        body(),  # the family's HELP and TYPE, no sample: nothing published
        metrics_text({0: (3, 3)}, log_stats=False).encode(),
        b"# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n",
        b'vllm:num_requests_running_total 3\nvllm:num_requests_swapped{engine="0"} 1\n',
    ],
    ids=["empty", "help_only", "disable_log_stats", "comments_only", "other_families"],
)
def test_a_server_without_the_families_is_unsupported_never_idle(text: bytes) -> None:
    outcome, counts = read_activity("t", 200, text, 0.01)
    assert outcome.outcome is Outcome.FAILED and counts is None
    assert outcome.error is not None and NOT_PUBLISHED in outcome.error
    assert is_unsupported(outcome)


HOSTILE = {
    "negative": pair(0, "-1.0", "0.0"),
    "nan": pair(0, "NaN", "0.0"),
    "inf": pair(0, "+Inf", "0.0"),
    "huge": pair(0, "1e30", "0.0"),
    "fraction": pair(0, "0.5", "0.0"),
    "string": pair(0, "abc", "0.0"),
    "bool": pair(0, "True", "0.0"),
    "empty_value": pair(0, "", "0.0"),
    "no_engine_label": (f'{RUNNING}{{model_name="m"}} 0.0\n', f'{WAITING}{{model_name="m"}} 0.0\n'),
    "no_labels": (f"{RUNNING} 0.0\n", f"{WAITING} 0.0\n"),
    "engine_not_a_number": (series(RUNNING, "x", "0.0"), series(WAITING, "x", "0.0")),
    # Ranks are ASCII digits only: regex ``\d`` takes the first two, which ``int()`` reads 1.
    "engine_arabic_one": (series(RUNNING, "\u0661", "0.0"), series(WAITING, "\u0661", "0.0")),
    "engine_fullwidth_one": (series(RUNNING, "\uff11", "0.0"), series(WAITING, "\uff11", "0.0")),
    "engine_superscript": (series(RUNNING, "\u00b2", "0.0"), series(WAITING, "\u00b2", "0.0")),
    "unclosed_labels": (f'{RUNNING}{{engine="0" 0.0\n', f'{WAITING}{{engine="0" 0.0\n'),
    "running_only": (series(RUNNING, 0, "0.0"),),
    "duplicate_with_a_bad_value": (*pair(0, "0.0", "0.0"), series(RUNNING, 0, "NaN")),
    "overlong_line": pair(0, "0.0", "0.0" + " " * MAX_METRICS_LINE),
}


@pytest.mark.parametrize("lines", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("where", ["alone", "beside_good_ranks"])
def test_an_unreadable_rank_fails_the_read_closed(lines: tuple[str, ...], where: str) -> None:
    """A rank whose counts cannot be read makes the target's sum unknown: failed (not
    unsupported), no counts, even when the ranks around it read as idle."""
    before = pair(1, "0.0", "0.0") if where == "beside_good_ranks" else ()
    after = pair(2, "0.0", "0.0") if where == "beside_good_ranks" else ()
    outcome, counts = read_activity("t", 200, body(*before, *lines, *after), 0.01)
    assert outcome.outcome is Outcome.FAILED, outcome
    assert counts is None and not is_unsupported(outcome)
    assert outcome.error and "/metrics" in outcome.error


def test_more_ranks_than_are_read_fail_closed() -> None:
    lines = [line for r in range(MAX_RANKS + 1) for line in pair(r, "0.0", "0.0")]
    outcome, counts = read_activity("t", 200, body(*lines), None)
    assert outcome.outcome is Outcome.FAILED and counts is None


def test_undecodable_bytes_around_the_series_are_harmless() -> None:
    text = b"\xff\xfe garbage\n" + body(*pair(0, "1.0", "0.0")) + b"\xc3\x28\n"
    assert read_activity("t", 200, text, None)[1] == RequestCounts(1, 0)


def test_a_404_is_unsupported_and_other_statuses_fail() -> None:
    outcome, counts = read_activity("t", 404, b'{"detail":"Not Found"}', 0.01)
    assert is_unsupported(outcome) and counts is None
    assert outcome.error is not None and "has_work" in outcome.error
    outcome, counts = read_activity("t", 500, b"Internal Server Error", 0.01)
    assert outcome.outcome is Outcome.FAILED and not is_unsupported(outcome) and counts is None
    assert outcome.error is not None and "HTTP 500" in outcome.error
    outcome, counts = read_activity("t", 307, b"", 0.01)
    assert outcome.outcome is Outcome.FAILED and counts is None


CASES = {
    "work": (200, body(*pair(0, "1.0", "0.0"))),
    "idle": (200, body(*pair(0, "0.0", "0.0"))),
    "not_published": (200, b"# nothing\n"),
    "hostile": (200, body(*pair(0, "NaN", "0.0"))),
    "missing": (404, b'{"detail":"Not Found"}'),
    "error": (503, b'{"error": "overloaded"}'),
}


@pytest.mark.parametrize(("status", "text"), CASES.values(), ids=CASES.keys())
def test_interpret_gives_the_same_outcome(status: int, text: bytes) -> None:
    assert (
        interpret("t", "has_work", status, text, 0.02) == read_activity("t", status, text, 0.02)[0]
    )


def test_an_error_body_nested_past_the_decoder_is_a_failure_not_an_exception() -> None:
    """A 500 whose body is JSON nested 100,000 deep (``json.loads`` raises RecursionError, not
    ValueError): a failure shown by its first bytes, never an exception out of the read."""
    outcome = interpret("a", "is_sleeping", 500, b"[" * 100_000, 0.01)
    assert outcome.outcome is Outcome.FAILED and outcome.error is not None
    assert outcome.error.startswith("HTTP 500: [[[")
