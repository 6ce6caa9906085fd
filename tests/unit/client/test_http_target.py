"""A plugin target's ranks follow its gate answers, socket-free (``follow_ranks``,
``TargetState.follow``; over real HTTP: tests/integration/http/test_plugin_target_ranks.py)."""

from __future__ import annotations

from exporter.client.http.plugin import (
    MAX_ENGINES,
    RANK_ABSENT_ANSWERS,
    GateAnswer,
    follow_ranks,
)
from exporter.client.http.target import HttpTarget, PluginTargetState, target_state


def test_a_rank_missing_from_three_answers_in_a_row_is_dropped() -> None:
    ranks = follow_ranks({}, ["0", "1", "2"])
    assert ranks == {"0": 0, "1": 0, "2": 0}
    for missed in range(1, RANK_ABSENT_ANSWERS):
        ranks = follow_ranks(ranks, ["0", "1"])
        assert ranks == {"0": 0, "1": 0, "2": missed}
    assert follow_ranks(ranks, ["0", "1"]) == {"0": 0, "1": 0}
    # Named again before that: counted from zero again.
    ranks = follow_ranks(follow_ranks({"0": 0, "2": 0}, ["0"]), ["0", "2"])
    assert ranks == {"0": 0, "2": 0}


def test_a_target_never_holds_more_than_1024_ranks_the_named_ones_first() -> None:
    old = [str(r) for r in range(MAX_ENGINES)]
    ranks = follow_ranks({}, old)
    new = [str(r) for r in range(MAX_ENGINES, MAX_ENGINES + 10)]
    ranks = follow_ranks(ranks, new)
    assert len(ranks) == MAX_ENGINES
    assert all(ranks[r] == 0 for r in new)
    assert sum(1 for r in old if r in ranks) == MAX_ENGINES - 10
    huge = [str(r) for r in range(5000)]
    assert list(follow_ranks(ranks, huge)) == huge[:MAX_ENGINES]


def test_one_answer_moves_the_ranks_once_whichever_read_method_reads_it() -> None:
    state = target_state(HttpTarget("a", "http://127.0.0.1:9/dp"))
    assert isinstance(state, PluginTargetState)
    assert state.labels() == ["a"]
    first = GateAnswer(200, b"", 0.0)
    assert state.follow(first, ["0", "1"]) == ["a"]  # the target stood for its engines
    assert state.labels() == ["a/0", "a/1"]
    for _ in range(RANK_ABSENT_ANSWERS - 1):
        answer = GateAnswer(200, b"", 0.0)
        for _read_method in range(3):
            assert state.follow(answer, ["0"]) == []
    assert state.labels() == ["a/0", "a/1"]
    assert state.follow(GateAnswer(200, b"", 0.0), ["0"]) == ["a/1"]
    assert state.labels() == ["a/0"]


def test_a_dev_routes_url_is_one_engine_and_a_plugin_url_its_ranks() -> None:
    plain = target_state(HttpTarget("b", "http://127.0.0.1:9"))
    assert not isinstance(plain, PluginTargetState) and plain.labels() == ["b"]
    assert plain.fault_read.server_url == "http://127.0.0.1:9" and not plain.fault_read.per_rank
    plugin = target_state(HttpTarget("a", "http://127.0.0.1:9/dp"))
    assert plugin.fault_read.server_url == "http://127.0.0.1:9" and plugin.fault_read.per_rank
