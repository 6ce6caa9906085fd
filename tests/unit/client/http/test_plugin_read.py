"""A plugin target's ranks' requests as its gate answers come (``PluginReads``), with the
requests of a fake fetch instead of sockets: each answer's counts replace the last, an answer
that fails leaves every rank's unknown, and a dropped rank's are forgotten."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from exporter.client.fleet import Outcome
from exporter.client.http.plugin import RANK_ABSENT_ANSWERS
from exporter.client.http.plugin_read import PluginReads
from exporter.client.http.routes import Reply, Route
from exporter.client.http.target import HttpTarget, PluginTargetState
from exporter.protocol.activity import RequestCounts

READS = ("is_sleeping", "is_scheduler_paused", "get_weight_version", "has_work")


def gate(ranks: dict[int, Any]) -> Reply:
    """A gate answer naming ``ranks`` (rank → its ``requests``; a rank has work when any)."""
    engines = [
        {
            "engine": str(rank),
            "ok": True,
            "values": {"sleeping": False, "has_work": bool(req and req.get("running"))},
            "failures": [],
            "requests": req,
        }
        for rank, req in ranks.items()
    ]
    return Reply(200, json.dumps({"ok": True, "engines": engines}).encode())


class Server:
    """The answers a fake fetch gives, one per gate request (an exception: raised)."""

    def __init__(self, answers: list[Reply | Exception]) -> None:
        self.answers: Iterator[Reply | Exception] = iter(answers)
        self.asked = 0
        self.dropped: list[str] = []

    async def fetch(self, state: PluginTargetState, spec: Route) -> Reply:
        self.asked += 1
        answer = next(self.answers)
        if isinstance(answer, Exception):
            raise answer
        return answer


async def poll(reads: PluginReads, state: PluginTargetState) -> dict[str, list[Any]]:
    """One poll's reads of ``state`` (sharing one gate answer); then the next asks afresh."""
    found = {
        m: [(o.engine, o.outcome, o.value) for o in await reads.read(state, m, 1.0)] for m in READS
    }
    state.sampled_at = 0.0  # the next poll is past the sharing window
    return found


def counts(running: int, waiting: int = 0) -> dict[str, int]:
    return {"running": running, "waiting": waiting}


@pytest.fixture
def state() -> PluginTargetState:
    return PluginTargetState(HttpTarget("a", "http://127.0.0.1:9/dp"))


async def test_each_answers_counts_replace_the_last(state: PluginTargetState) -> None:
    server = Server([gate({0: counts(2, 1), 1: counts(0)}), gate({0: counts(0), 1: counts(3)})])
    reads = PluginReads(server.fetch, server.dropped.append)
    found = await poll(reads, state)
    assert server.asked == 1  # one answer for the poll's four reads
    assert found["has_work"] == [("a/0", Outcome.OK, True), ("a/1", Outcome.OK, False)]
    assert state.counts_by_label() == {"a/0": RequestCounts(2, 1), "a/1": RequestCounts(0, 0)}
    await poll(reads, state)
    assert state.counts_by_label() == {"a/0": RequestCounts(0, 0), "a/1": RequestCounts(3, 0)}


@pytest.mark.parametrize(
    "failure",
    [
        aiohttp.ClientConnectionError("gone"),
        OSError("reset"),
        Reply(500, b'{"error": "boom"}'),
        Reply(200, b"x" * 10, cut=True),
        Reply(200, b"not json"),
    ],
    ids=["connection", "os_error", "http_500", "over_the_limit", "not_json"],
)
async def test_an_answer_that_fails_leaves_every_ranks_counts_unknown(
    state: PluginTargetState, failure: Reply | Exception
) -> None:
    good = gate({0: counts(1), 1: counts(0)})
    server = Server([good, failure, good])
    reads = PluginReads(server.fetch, server.dropped.append)
    await poll(reads, state)
    assert all(c is not None for c in state.counts_by_label().values())
    await poll(reads, state)
    assert set(state.counts_by_label().values()) == {None}
    await poll(reads, state)
    assert state.counts_by_label() == {"a/0": RequestCounts(1, 0), "a/1": RequestCounts(0, 0)}


async def test_a_rank_missing_from_an_answer_has_unknown_counts_then_is_forgotten(
    state: PluginTargetState,
) -> None:
    answers: list[Reply | Exception] = [gate({0: counts(1), 1: counts(2), 2: counts(0)})]
    answers += [gate({0: counts(1), 2: counts(0)})] * RANK_ABSENT_ANSWERS
    server = Server(answers)
    reads = PluginReads(server.fetch, server.dropped.append)
    await poll(reads, state)
    assert state.counts_by_label()["a/1"] == RequestCounts(2, 0)
    await poll(reads, state)
    assert state.counts_by_label() == {
        "a/0": RequestCounts(1, 0),
        "a/1": None,  # not in the answer: unknown, never its last counts
        "a/2": RequestCounts(0, 0),
    }
    for _ in range(RANK_ABSENT_ANSWERS - 1):
        await poll(reads, state)
    assert server.dropped == ["a", "a/1"]  # the target's own label went with the first answer
    assert set(state.counts_by_label()) == {"a/0", "a/2"} and "1" not in state.rank_counts


async def test_hostile_counts_are_unknown_for_that_rank_only(state: PluginTargetState) -> None:
    server = Server([gate({0: counts(-1), 1: {"running": 1e30, "waiting": 0}, 2: counts(4, 4)})])
    reads = PluginReads(server.fetch, server.dropped.append)
    found = await poll(reads, state)
    assert [kind for _, kind, _ in found["has_work"]] == [Outcome.OK] * 3
    assert state.counts_by_label() == {"a/0": None, "a/1": None, "a/2": RequestCounts(4, 4)}
