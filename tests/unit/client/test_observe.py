"""The one seam for what a mode learns besides its calls' answers (``exporter.client.observe``,
no sockets): a kind without a source is "cannot know", never an empty answer; sources are read
afresh; the readers above get named structs back."""

from __future__ import annotations

import pytest

from exporter.client.observe import (
    CLIENT_COUNT,
    ELASTIC_EP_OPERATION,
    PROGRESS,
    UNEXPECTED_ENGINE,
    WORK_COUNTS,
    Observation,
    Observations,
    UnexpectedEngine,
    client_counts,
    counters_of,
    elastic_ep_reads,
    progress_of,
    unexpected_engines,
    work_counts,
)
from exporter.protocol.activity import RequestCounts
from exporter.protocol.elastic_ep import ElasticEpRead


def test_a_kind_without_a_source_is_unknown_not_empty() -> None:
    board = Observations()
    assert board.of(ELASTIC_EP_OPERATION) is None and not board.knows(ELASTIC_EP_OPERATION)
    assert elastic_ep_reads(board) is None  # a mode with no API server to ask
    assert unexpected_engines(board) == {} and counters_of(board) == {}
    board.add_source(ELASTIC_EP_OPERATION, list)
    assert board.of(ELASTIC_EP_OPERATION) == () and elastic_ep_reads(board) == ()


def test_sources_are_read_afresh_and_one_per_kind() -> None:
    board = Observations()
    seen: dict[str, UnexpectedEngine] = {}
    board.add_source(
        UNEXPECTED_ENGINE,
        lambda: [
            Observation(k, UNEXPECTED_ENGINE, v, v.last_seen_unix, "t") for k, v in seen.items()
        ],
    )
    assert unexpected_engines(board) == {}
    seen["0300"] = UnexpectedEngine(3, 1, 10.0)
    seen["ab"] = UnexpectedEngine(None, 2, 11.0)
    assert list(unexpected_engines(board).items()) == list(seen.items())  # newest last
    with pytest.raises(ValueError, match=UNEXPECTED_ENGINE):
        board.add_source(UNEXPECTED_ENGINE, list)


def test_counters_round_trip_with_their_zeros() -> None:
    counters = {"vllm_dp_state_file_writes_total": {"ok": 0, "failed": 2}, "x_total": {"a": 1}}
    board = Observations()
    board.add_source(CLIENT_COUNT, lambda: client_counts(counters, "transport"))
    assert counters_of(board) == counters
    assert {o.engine for o in board.of(CLIENT_COUNT) or ()} == {None}


def test_elastic_ep_reads_keep_target_order() -> None:
    reads = [ElasticEpRead("b"), ElasticEpRead("a", problem="503")]
    board = Observations()
    board.add_source(
        ELASTIC_EP_OPERATION,
        lambda: [Observation(r.target, ELASTIC_EP_OPERATION, r, 0.0, "t") for r in reads],
    )
    assert elastic_ep_reads(board) == tuple(reads)


def test_refresh_starts_every_refresher_with_the_timeout() -> None:
    board = Observations()
    asked: list[tuple[str, float]] = []
    board.add_refresher(lambda t: asked.append(("first", t)))
    board.add_refresher(lambda t: asked.append(("second", t)))
    board.refresh(2.5)
    assert asked == [("first", 2.5), ("second", 2.5)]


def test_a_counter_family_without_samples_is_kept() -> None:
    """A relay that relayed no handshake yet still publishes the family (no sample)."""
    board = Observations()
    board.add_source(CLIENT_COUNT, lambda: client_counts({"relay_total": {}}, "transport"))
    assert counters_of(board) == {"relay_total": {}}


def test_a_scoped_source_reads_only_the_engines_asked_for() -> None:
    """A paced poll's burst asks for its own engines: a scoped source is handed them (and
    reads only them), an unscoped source's other engines are left out; None: every engine."""
    board = Observations()
    asked: list[object] = []

    def counts(engines: object) -> list[Observation]:
        asked.append(engines)
        wanted = ["0", "1", "2"] if engines is None else sorted(engines)  # type: ignore[call-overload]
        return [Observation(e, WORK_COUNTS, RequestCounts(int(e), 0), 1.0, "t") for e in wanted]

    board.add_source(WORK_COUNTS, counts, scoped=True)
    board.add_source(
        PROGRESS,
        lambda: (
            [Observation(e, PROGRESS, None, 1.0, "t") for e in ("0", "1", "2")]
            + [Observation(None, PROGRESS, None, 1.0, "t")]
        ),
    )
    assert work_counts(board, ["2"]) == {"2": RequestCounts(2, 0)}
    assert list(work_counts(board)) == ["0", "1", "2"]
    assert asked == [["2"], None]
    assert list(progress_of(board, {"1", "9"}) or {}) == ["1"]
    assert list(progress_of(board) or {}) == ["0", "1", "2"]
