"""What an HTTP-mode target knows of its requests, socket-free: a dev-routes target's
(``TargetState.request_counts``, one engine) and a plugin target's per rank, forgotten with the
ranks the server stops naming (``PluginTargetState``)."""

from __future__ import annotations

from exporter.client.http.plugin import RANK_ABSENT_ANSWERS, GateAnswer
from exporter.client.http.target import HttpTarget, PluginTargetState, target_state
from exporter.protocol.activity import RequestCounts

BUSY, IDLE = RequestCounts(2, 1), RequestCounts(0, 0)


def test_a_dev_routes_targets_counts_are_its_one_engines() -> None:
    state = target_state(HttpTarget("b", "http://127.0.0.1:9"))
    assert state.counts_by_label() == {"b": None}
    state.request_counts = BUSY
    assert state.counts_by_label() == {"b": BUSY}
    assert state.requests == 0  # the HTTP requests sent: another count


def test_a_plugin_targets_counts_are_per_rank_and_forgotten_with_its_ranks() -> None:
    state = target_state(HttpTarget("a", "http://127.0.0.1:9/dp"))
    assert isinstance(state, PluginTargetState)
    assert state.counts_by_label() == {"a": None}  # no rank named yet
    state.follow(GateAnswer(200, b"", 0.0), ["0", "1"])
    state.rank_counts = {"0": BUSY, "1": IDLE}
    assert state.counts_by_label() == {"a/0": BUSY, "a/1": IDLE}
    for _ in range(RANK_ABSENT_ANSWERS - 1):
        state.follow(GateAnswer(200, b"", 0.0), ["0"])
    assert set(state.counts_by_label()) == {"a/0", "a/1"}  # still followed
    assert state.follow(GateAnswer(200, b"", 0.0), ["0"]) == ["a/1"]
    assert state.rank_counts == {"0": BUSY}
    assert state.counts_by_label() == {"a/0": BUSY}
    state.forget_counts()
    assert state.counts_by_label() == {"a/0": None}
