"""``ProgressFeed`` (``exporter.client.inprocess.feed``): what vLLM's stat loggers tell the
in-process exporter. It runs on vLLM's output path: it must never raise, do nothing while no
exporter runs, keep one small record per rank, and read a hostile record as nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from exporter.client.inprocess.feed import MAX_ENGINES, SOURCE, ProgressFeed
from exporter.protocol.progress import MAX_TOKENS, RankProgress


@dataclass
class Stats:
    """The two fields of vLLM's ``IterationStats`` the feed reads."""

    num_generation_tokens: Any = 0
    num_prompt_tokens: Any = 0


class Raising:
    @property
    def num_generation_tokens(self) -> int:
        raise RuntimeError("a stats object that raises")


def running_feed(now: list[float]) -> ProgressFeed:
    feed = ProgressFeed(clock=lambda: now[0])
    feed.attach([0, 1, 2])
    feed.start()
    return feed


def test_tokens_add_up_per_rank_and_each_rank_knows_when_they_last_grew() -> None:
    now = [100.0]
    feed = running_feed(now)
    feed.record(1, Stats(5, 20))
    now[0] = 103.0
    feed.record(1, Stats(4, 0))
    feed.record(1, None)  # a step without outputs: no stats
    now[0] = 107.0
    feed.record(1, Stats(0, 0))  # a step that computed nothing is no progress
    assert feed.progress([0, 1], {1: 2}) == {
        0: RankProgress(0, 100.0, SOURCE, None),  # nothing computed since the start
        1: RankProgress(29, 103.0, SOURCE, 2, held_since_unix=107.0),
    }
    assert (feed.records, feed.hostile) == (3, 0)


def test_a_rank_holds_its_requests_since_the_first_read_that_saw_them() -> None:
    """The stall clock's start: an idle rank's next request is work since it came, not since
    the rank's last token an hour before."""
    now = [100.0]
    feed = running_feed(now)
    feed.record(0, Stats(0, 10))
    assert (feed.progress([0], {0: 0}) or {})[0].held_since_unix is None  # idle
    now[0] = 3700.0  # an hour later a request arrives
    first = (feed.progress([0], {0: 1}) or {})[0]
    assert (first.last_progress_unix, first.held_since_unix) == (100.0, 3700.0)
    assert first.stall_age_s(3710.0) == 10.0  # not 3,610 s
    now[0] = 3705.0  # still held (more requests now): the same start
    assert (feed.progress([0], {0: 3}) or {})[0].held_since_unix == 3700.0
    now[0] = 3706.0
    for gone in ({0: 0}, {0: None}, None):  # none held, or unknown: the start is dropped
        assert (feed.progress([0], gone) or {})[0].held_since_unix is None
        assert (feed.progress([0], {0: 1}) or {})[0].held_since_unix == now[0]
        now[0] += 1.0
    feed.stop()
    feed.start()
    assert (feed.progress([0], {0: 1}) or {})[0].held_since_unix == now[0]  # a new start


def test_nothing_is_kept_while_no_exporter_runs_and_nothing_told_without_a_stat_logger() -> None:
    feed = ProgressFeed()
    feed.attach([0])
    feed.record(0, Stats(5, 0))  # before the exporter started: not counted
    assert feed.progress([0]) is None and feed.records == 0
    unattached = ProgressFeed()
    unattached.start()  # an exporter, but vLLM built no stat logger of ours (VLLM_PLUGINS)
    unattached.record(0, Stats(5, 0))
    assert unattached.progress([0]) is None  # unknown, never "computed nothing"
    feed.start()
    feed.record(0, Stats(5, 0))
    feed.stop()
    assert feed.progress([0]) is None
    feed.start()
    assert feed.progress([0]) == {0: RankProgress(0, feed.started_unix, SOURCE)}  # fresh


def test_only_the_ranks_vllm_built_the_logger_for_are_told() -> None:
    feed = running_feed([1.0])
    assert set(feed.progress([0, 1, 2, 7]) or {}) == {0, 1, 2}


@pytest.mark.parametrize(
    ("engine", "stats"),
    [
        (-1, Stats(5)),
        ("1", Stats(5)),
        (True, Stats(5)),
        (1 << 20, Stats(5)),
        (1, Stats(-5)),
        (1, Stats(1.0)),
        (1, Stats(True)),
        (1, Stats(MAX_TOKENS + 1)),
        (1, Stats(None)),
        (1, Stats(5, "7")),
        (1, object()),
        (1, Raising()),
    ],
)
def test_a_hostile_record_changes_nothing_and_never_raises(engine: Any, stats: Any) -> None:
    now = [5.0]
    feed = running_feed(now)
    now[0] = 9.0
    feed.record(engine, stats)
    assert feed.hostile == 1 and feed.records == 0
    assert (feed.progress([1]) or {})[1] == RankProgress(0, 5.0, SOURCE)


def test_a_count_that_would_pass_the_bound_is_not_added() -> None:
    feed = running_feed([1.0])
    feed.record(0, Stats(MAX_TOKENS))
    feed.record(0, Stats(1))
    assert (feed.progress([0]) or {})[0].tokens == MAX_TOKENS


def test_the_engines_kept_are_bounded() -> None:
    feed = ProgressFeed()
    feed.attach(range(MAX_ENGINES + 5))
    feed.start()
    for engine in range(MAX_ENGINES + 5):
        feed.record(engine, Stats(1))
    assert feed.records == MAX_ENGINES and feed.hostile == 5


def test_attach_reads_only_whole_numbers_and_survives_a_hostile_list() -> None:
    feed = ProgressFeed()
    feed.attach([0, "1", 2.0, True, 3])
    assert feed.attached == frozenset({0, 3})
    feed.attach(None)
    assert feed.attached == frozenset()
    feed.detach()
    assert feed.attached is None


def test_steps_that_compute_nothing_never_move_the_clock() -> None:
    now = [10.0]
    feed = running_feed(now)
    for later in (20.0, 30.0):
        now[0] = later
        feed.record(2, Stats(0, 0))  # vLLM records every step, one that computed nothing too
    assert (feed.progress([2]) or {})[2] == RankProgress(0, 10.0, SOURCE)
