"""``exporter/protocol/activity.py``: a rank's running and waiting requests from each source
vLLM publishes them in (the load-balancing table, ``/metrics``, a ``{"running", "waiting"}``
object), one rule for every count: a whole number from 0 to ``MAX_REQUESTS``, anything else
unknown (None), never a guessed zero (pure)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from exporter.error import ProtocolError
from exporter.protocol.activity import (
    MAX_COORDINATOR_MESSAGE,
    MAX_METRICS_LINE,
    MAX_RANKS,
    MAX_REQUESTS,
    RequestCounts,
    decode_coordinator_stats,
    metrics_counts,
    read_activity_json,
    read_count,
    read_counts,
    read_lb_entry,
    total_counts,
)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"


def series(name: str, rank: int | str, value: str, **labels: str) -> str:
    """One sample line as prometheus_client writes vLLM's (``engine`` then ``model_name``)."""
    more = "".join(f',{k}="{v}"' for k, v in labels.items())
    return f'{name}{{engine="{rank}",model_name="m"{more}}} {value}\n'


def exposition(counts: dict[int, tuple[str, str]]) -> str:
    """vLLM's two families, rank → (running, waiting) as the sample texts."""
    text = f"# HELP {RUNNING} Number of requests running.\n# TYPE {RUNNING} gauge\n"
    text += "".join(series(RUNNING, rank, pair[0]) for rank, pair in counts.items())
    text += f"# HELP {WAITING} Number of requests waiting.\n# TYPE {WAITING} gauge\n"
    return text + "".join(series(WAITING, rank, pair[1]) for rank, pair in counts.items())


# -- one count --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (7, 7),
        (3.0, 3),  # prometheus_client prints gauges as floats
        (MAX_REQUESTS, MAX_REQUESTS),
        (float(MAX_REQUESTS), MAX_REQUESTS),
    ],
)
def test_a_whole_number_in_range_is_a_count(value: Any, expected: int) -> None:
    got = read_count(value)
    assert got == expected and type(got) is int


@pytest.mark.parametrize(
    "value",
    [
        -1,
        -0.5,
        MAX_REQUESTS + 1,
        1e300,
        2**80,
        1.5,
        float("nan"),
        float("inf"),
        float("-inf"),
        True,  # a bool is an int in Python: never a count
        False,
        "3",
        "yes",
        None,
        [1],
        {"running": 1},
        b"1",
    ],
)
def test_anything_else_is_unknown_never_zero(value: Any) -> None:
    assert read_count(value) is None


def test_a_pair_is_known_only_when_both_counts_are() -> None:
    assert read_counts(2, 0) == RequestCounts(running=2, waiting=0)
    assert read_counts(2, -1) is None
    assert read_counts(None, 0) is None
    assert read_counts(True, 0) is None


def test_the_counts_total_and_serialise_as_the_status_document_shows_them() -> None:
    counts = RequestCounts(running=3, waiting=4)
    assert counts.total == 7
    assert counts.json() == {"running": 3, "waiting": 4}
    assert total_counts({0: counts, 5: RequestCounts(1, 0)}) == RequestCounts(4, 4)
    assert total_counts({}) == RequestCounts(0, 0)


# -- the load-balancing table -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ([5, 2], RequestCounts(running=2, waiting=5)),  # vLLM 0.30: [waiting, running]
        ([5, 2, 0.75], RequestCounts(running=2, waiting=5)),  # 0.32: + kv_cache_usage
        ((0, 0, 0.0), RequestCounts(0, 0)),
        ([1.0, 4.0, 0.1], RequestCounts(running=4, waiting=1)),
    ],
)
def test_an_lb_entry_is_waiting_then_running(entry: Any, expected: RequestCounts) -> None:
    assert read_lb_entry(entry) == expected


@pytest.mark.parametrize(
    "entry",
    [
        [-1, 0, 0.0],
        [0, MAX_REQUESTS + 1, 0.0],
        [0, 10**30],
        ["1", 0, 0.0],
        [0, "busy"],
        [0, None, 0.0],
        [True, 0],
        [float("nan"), 0],
        [0.5, 1],
        [3],  # too short
        [],
        [0] * 9,  # longer than any vLLM's entry
        {"waiting": 0, "running": 0},
        "00",
        None,
        7,
    ],
)
def test_a_hostile_lb_entry_is_unknown(entry: Any) -> None:
    assert read_lb_entry(entry) is None


# -- the DP coordinator's publication --------------------------------------------------------


def publication(counts: Any, wave: Any = 0, running: Any = False) -> bytes:
    return msgspec.msgpack.encode([counts, wave, running])


def test_a_publication_gives_each_rank_its_counts_by_position() -> None:
    payload = publication([[0, 1, 0.5], [2, 0, 0.0], [0, 0]])
    assert decode_coordinator_stats(payload) == [
        RequestCounts(running=1, waiting=0),
        RequestCounts(running=0, waiting=2),
        RequestCounts(0, 0),
    ]


def test_a_hostile_rank_of_a_publication_is_unknown_alone() -> None:
    payload = publication([[0, 1, 0.0], [-1, 0, 0.0], ["x", 0], [0], None, [0, 2**40]])
    assert decode_coordinator_stats(payload) == [RequestCounts(1, 0), None, None, None, None, None]


def test_a_publication_without_counts_carries_none() -> None:
    # The coordinator also publishes wave changes alone.
    assert decode_coordinator_stats(publication(None, wave=3, running=True)) is None
    assert decode_coordinator_stats(publication([])) == []


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # never valid msgpack
        b"\x91" * 5000 + b"\x90",  # nested deeper than anyone publishes
        msgspec.msgpack.encode([[0, 0]]),  # not (counts, wave, running)
        msgspec.msgpack.encode({"counts": [], "wave": 0, "running": False}),
        publication("counts"),
        publication({"0": [0, 0]}),
        publication([[0, 0]] * (MAX_RANKS + 1)),
        publication([[0, 0, 0.0]])[:-1],  # cut short
    ],
)
def test_a_publication_that_is_not_one_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_coordinator_stats(payload)


def test_a_publication_over_the_size_bound_is_refused_before_it_is_decoded() -> None:
    big = publication([[0, 0, 0.0]] * 10) + b"\x00" * MAX_COORDINATOR_MESSAGE
    with pytest.raises(ProtocolError, match="bytes"):
        decode_coordinator_stats(big)


# -- a {"running", "waiting"} object ----------------------------------------------------------


def test_an_activity_object_needs_both_counts() -> None:
    assert read_activity_json({"running": 1, "waiting": 2, "x": "y"}) == RequestCounts(1, 2)
    for hostile in (
        {"running": 1},
        {"running": 1, "waiting": None},
        {"running": "1", "waiting": 0},
        {"running": -3, "waiting": 0},
        [1, 2],
        None,
        "running",
    ):
        assert read_activity_json(hostile) is None, hostile


# -- vLLM's /metrics --------------------------------------------------------------------------


def test_each_rank_gets_its_own_two_series() -> None:
    text = exposition({0: ("2.0", "0.0"), 1: ("0.0", "0.0"), 7: ("1.0", "3.0")})
    assert metrics_counts(text) == {
        0: RequestCounts(2, 0),
        1: RequestCounts(0, 0),
        7: RequestCounts(1, 3),
    }


@pytest.mark.parametrize(
    "text",
    [
        "",
        "\n\n",
        "# HELP python_gc_objects_collected_total x\npython_gc_objects_collected_total 1.0\n",
        # Comments naming the families are not samples (a server with --disable-log-stats).
        f"# HELP {RUNNING} Number of requests running.\n# TYPE {RUNNING} gauge\n",
        # A family of the same prefix is another family.
        'vllm:num_requests_swapped{engine="0"} 1.0\n',
        'vllm:num_requests_running_total{engine="0"} 1.0\n',
        # A sample without labels names no rank; nothing of either family was seen.
        f"{RUNNING} 1.0\n{WAITING} 0.0\n",
    ],
)
def test_an_answer_without_either_family_is_unknown_not_idle(text: str) -> None:
    assert metrics_counts(text) is None


def test_a_rank_with_only_one_of_the_two_is_left_out() -> None:
    text = exposition({0: ("1.0", "0.0")}) + series(RUNNING, 1, "4.0") + series(WAITING, 2, "2.0")
    assert metrics_counts(text) == {0: RequestCounts(1, 0)}
    # Seen but never complete: no rank, and still not "no families" (an empty map).
    assert metrics_counts(series(RUNNING, 0, "1.0")) == {}


def test_two_series_of_one_rank_are_summed() -> None:
    # Two API-server processes (or two model names) each publish the rank's requests.
    text = (
        series(RUNNING, 0, "1.0", server="a")
        + series(RUNNING, 0, "2.0", server="b")
        + series(WAITING, 0, "0.0", server="a")
        + series(WAITING, 0, "5.0", server="b")
        + series(RUNNING, 1, "0.0")
        + series(WAITING, 1, "0.0")
    )
    assert metrics_counts(text) == {0: RequestCounts(3, 5), 1: RequestCounts(0, 0)}


@pytest.mark.parametrize(
    "value", ["-1.0", "NaN", "+Inf", "-Inf", "1.5", "1e300", "yes", "", "0x10"]
)
def test_a_rank_whose_value_is_not_a_count_is_left_out(value: str) -> None:
    text = exposition({0: ("1.0", "0.0"), 1: (value, "0.0")})
    assert metrics_counts(text) == {0: RequestCounts(1, 0)}


def test_one_bad_series_of_a_summed_rank_makes_the_rank_unknown() -> None:
    text = (
        series(RUNNING, 0, "1.0", server="a")
        + series(RUNNING, 0, "NaN", server="b")
        + series(RUNNING, 0, "1.0", server="c")
        + series(WAITING, 0, "0.0")
    )
    assert metrics_counts(text) == {}


#: Samples of one rank's family that sum to a count although one of them is none.
CANCELLING = {
    "negative": ("3.0", "-3.0"),
    "fractions": ("1.5", "0.5"),
    "huge": ("1e30", "-1e30"),
    "over the bound": (str(MAX_REQUESTS + 1), "-1"),
    "negative first": ("-2", "2"),
}


@pytest.mark.parametrize("family", [RUNNING, WAITING])
@pytest.mark.parametrize("pair", CANCELLING.values(), ids=CANCELLING.keys())
def test_each_sample_is_checked_before_the_sum(family: str, pair: tuple[str, str]) -> None:
    """``running 3`` and ``running -3`` of one engine (two samples of one label, two
    ``model_name`` series) sum to 0: the engine is unknown, never idle."""
    other = WAITING if family == RUNNING else RUNNING
    text = (
        series(family, 0, pair[0], model="a")
        + series(family, 0, pair[1], model="b")
        + series(other, 0, "0.0")
        + exposition({1: ("0.0", "0.0")})
    )
    assert metrics_counts(text) == {1: RequestCounts(0, 0)}


def test_samples_summing_past_the_bound_are_unknown() -> None:
    half = str(MAX_REQUESTS // 2 + 1)
    text = series(RUNNING, 0, half, model="a") + series(RUNNING, 0, half, model="b")
    assert metrics_counts(text + series(WAITING, 0, "0")) == {}


def test_a_sample_with_a_timestamp_is_read() -> None:
    text = series(RUNNING, 3, "2.0 1700000000000") + series(WAITING, 3, "1 1700000000000")
    assert metrics_counts(text) == {3: RequestCounts(2, 1)}


def test_a_line_over_the_limit_is_skipped_never_parsed() -> None:
    padding = "p" * MAX_METRICS_LINE
    long_line = series(RUNNING, 1, "9.0", pad=padding)
    assert len(long_line) > MAX_METRICS_LINE
    text = exposition({0: ("1.0", "0.0")}) + long_line + series(WAITING, 1, "0.0")
    assert metrics_counts(text) == {0: RequestCounts(1, 0)}  # rank 1 lost its running series
    # A line just at the limit is read.
    fits = series(RUNNING, 2, "1.0", pad="q" * 10)
    pad = MAX_METRICS_LINE - len(fits.rstrip("\n")) + 10
    at_limit = series(RUNNING, 2, "1.0", pad="q" * pad)
    assert len(at_limit.rstrip("\n")) == MAX_METRICS_LINE
    assert metrics_counts(at_limit + series(WAITING, 2, "0.0")) == {2: RequestCounts(1, 0)}
    # Only over-long lines: nothing of the families was seen.
    assert metrics_counts(long_line) is None


def test_the_number_of_ranks_read_is_bounded() -> None:
    ranks = MAX_RANKS + 500
    text = exposition({rank: ("1.0", "0.0") for rank in range(ranks)})
    counts = metrics_counts(text)
    assert counts is not None and len(counts) == MAX_RANKS
    assert set(counts) == set(range(MAX_RANKS))  # the first ones, in the answer's order
    # A rank already read still sums past the bound.
    text += series(RUNNING, 0, "1.0") + series(WAITING, 0, "2.0")
    again = metrics_counts(text)
    assert again is not None and again[0] == RequestCounts(2, 2)


@pytest.mark.parametrize(
    "labels",
    [
        'engine="x"',
        'engine="-1"',
        'engine="1234567"',  # more digits than any rank
        'engine=""',
        "engine=3",
        'xengine="3"',
        'model_name="engine"',
        'dp_engine="3",model_name="m"',
        'engine="3',  # an unterminated value
    ],
)
def test_a_series_whose_labels_name_no_rank_is_skipped(labels: str) -> None:
    text = exposition({0: ("1.0", "0.0")}) + f"{RUNNING}{{{labels}}} 5.0\n{WAITING}{{{labels}}} 0\n"
    assert metrics_counts(text) == {0: RequestCounts(1, 0)}


def test_the_engine_label_is_found_after_other_labels() -> None:
    text = (
        f'{RUNNING}{{model_name="m", engine="4"}} 1.0\n{WAITING}{{model_name="m",engine="4"}} 2.0\n'
    )
    assert metrics_counts(text) == {4: RequestCounts(1, 2)}


def test_garbage_around_the_families_changes_nothing() -> None:
    text = (
        "\x00\xff garbage {{{ }}} \n"
        + "vllm:num_requests_\n"
        + f"{RUNNING}{{\n"
        + exposition({0: ("0.0", "1.0")})
        + f"{RUNNING}{{}} 3.0\n"
        + "\t"
        + series(RUNNING, 0, "9.0")  # not at the start of the line: not a sample
    )
    assert metrics_counts(text) == {0: RequestCounts(0, 1)}
