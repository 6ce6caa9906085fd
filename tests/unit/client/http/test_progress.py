"""HTTP mode's progress reads (``exporter.client.http.progress``): a dev-routes target's tokens
from the ``/metrics`` answer its ``has_work`` read fetched, when they last grew, unknown after a
failed or unreadable read, and nothing for a plugin-enabled target."""

from __future__ import annotations

from exporter.client.http.progress import METRICS, ProgressReads
from exporter.client.http.target import HttpTarget, PluginTargetState, TargetState


def metrics(*tokens: str) -> bytes:
    return "".join(
        f'vllm:generation_tokens_total{{engine="{rank}"}} {value}\n'
        for rank, value in enumerate(tokens)
    ).encode()


def test_a_target_s_tokens_are_the_sum_over_its_ranks_and_unknown_after_a_bad_read() -> None:
    reads, state = ProgressReads(), TargetState(HttpTarget("a", "http://127.0.0.1:1"))
    reads.read(state, metrics("3.0", "4.0"))
    assert state.progress is not None and (state.progress.tokens, state.progress.source) == (
        7,
        METRICS,
    )
    first = state.progress.last_progress_unix
    reads.read(state, metrics("3.0", "4.0"))
    assert state.progress.last_progress_unix == first  # unchanged: the clock stays
    reads.read(state, metrics("3.0", "lots"))
    assert state.progress is None  # one rank unreadable: the sum is unknown
    reads.read(state, None)  # the read failed
    assert state.progress is None
    reads.read(state, metrics("3.0", "4.0"))
    assert state.progress is not None and state.progress.last_progress_unix >= first


def test_only_dev_routes_targets_are_observed() -> None:
    reads = ProgressReads()
    plain = TargetState(HttpTarget("a", "http://127.0.0.1:1"))
    plugin = PluginTargetState(HttpTarget("b", "http://127.0.0.1:2/dp"))
    for state in (plain, plugin):
        reads.read(state, metrics("5.0"))
    seen = ProgressReads.observations([plain, plugin, TargetState(HttpTarget("c", "x"))])
    assert [(o.engine, o.value.tokens) for o in seen] == [("a", 5)]
