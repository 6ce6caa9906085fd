"""A plugin target's ranks' requests as its gate answers come (``PluginReads``), with the
requests of a fake fetch instead of sockets: each answer's counts replace the last, an answer
that fails leaves every rank's unknown, and a dropped rank's are forgotten."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from exporter.client.fleet import EngineOutcome, Outcome, late_answers_allowed
from exporter.client.http.plugin import RANK_ABSENT_ANSWERS
from exporter.client.http.plugin_read import PLUGIN_SHARE_S, PluginReads
from exporter.client.http.routes import Reply, Route
from exporter.client.http.target import HttpTarget, PluginTargetState
from exporter.protocol.activity import RequestCounts
from tests.harness.waiting import eventually

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


def work(outcomes: list[EngineOutcome]) -> list[tuple[str, Outcome, Any]]:
    return [(o.engine, o.outcome, o.value) for o in outcomes]


async def poll(reads: PluginReads, state: PluginTargetState) -> dict[str, list[Any]]:
    """One poll's reads of ``state`` (one fan-out: one gate answer); then the next asks afresh."""
    asked_at = time.monotonic()
    with late_answers_allowed():
        found = {m: work(await reads.read(state, m, 1.0, asked_at)) for m in READS}
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


# -- fresh reads and late answers ---------------------------------------------------------------

#: The reads' deadline, and a server slower than 0.9 of it but within two deadlines: its answer
#: comes after the read gave up, while the read that follows still waits.
TIMEOUT_S = 0.2
LATE_S = 0.3
IDLE = {0: counts(0), 1: counts(0)}
BUSY = {0: counts(0), 1: counts(2)}


class SlowServer:
    """Every gate answer takes ``delay_s`` and says what ``ranks`` were when it was asked (the
    server's fan-out reads the ranks then): a late answer tells the past."""

    def __init__(self, ranks: dict[int, Any], delay_s: float = LATE_S) -> None:
        self.ranks = ranks
        self.delay_s = delay_s
        self.asked = 0
        self.answered = 0
        self.dropped: list[str] = []

    async def fetch(self, state: PluginTargetState, spec: Route) -> Reply:
        self.asked += 1
        reply = gate(self.ranks)
        await asyncio.sleep(self.delay_s)
        self.answered += 1
        return reply

    async def settled(self, state: PluginTargetState | None = None) -> None:
        """Every request asked so far has its answer (bounded), and ``state``'s request task
        has taken it in (it ends a loop turn after the fetch returns: ``wait_for``'s task)."""
        await eventually(lambda: self.answered == self.asked, 5, "the late answers")
        if state is not None and state.sample is not None:
            await asyncio.wait_for(asyncio.shield(state.sample), 5)


async def test_a_fresh_read_times_out_rather_than_answer_from_a_late_answer(
    state: PluginTargetState,
) -> None:
    """The gate's reads: the idle answer that came late never answers after rank 1 got work."""
    server = SlowServer(IDLE)
    reads = PluginReads(server.fetch, server.dropped.append)
    first = await reads.read(state, "has_work", TIMEOUT_S)
    assert [o.outcome for o in first] == [Outcome.TIMEOUT]
    await server.settled()  # the idle answer came, after the read's deadline
    server.ranks = BUSY
    for attempt in range(3):
        asked = server.asked
        found = work(await reads.read(state, "has_work", TIMEOUT_S))
        assert server.asked == asked + 1, attempt  # each read asked the server itself
        assert found == [("a", Outcome.TIMEOUT, None)], (attempt, found)
        await server.settled()


async def test_a_fresh_read_never_joins_a_request_started_before_it(
    state: PluginTargetState,
) -> None:
    """Neither one still running nor one answered a moment ago (a poll's): it asks anew, and
    the reads of its own fan-out share that one request."""
    server = SlowServer(IDLE, delay_s=0.0)
    reads = PluginReads(server.fetch, server.dropped.append)
    with late_answers_allowed():  # a poll's read, answered just now
        await reads.read(state, "is_sleeping", TIMEOUT_S)
    server.ranks = BUSY
    found = work(await reads.read(state, "has_work", TIMEOUT_S))
    assert server.asked == 2, "answered from a request started before the read"
    assert found == [("a/0", Outcome.OK, False), ("a/1", Outcome.OK, True)]
    server.delay_s = LATE_S
    await asyncio.sleep(2 * PLUGIN_SHARE_S)  # the next poll's read asks anew
    with late_answers_allowed():  # a poll's request, still running when the next read asks
        running = asyncio.ensure_future(reads.read(state, "is_sleeping", TIMEOUT_S))
    await eventually(lambda: server.asked == 3, 5, "the first request")
    server.ranks = IDLE
    found = work(await reads.read(state, "has_work", TIMEOUT_S))
    assert server.asked == 4, "joined a request started before the read"
    assert found == [("a/0", Outcome.TIMEOUT, None), ("a/1", Outcome.TIMEOUT, None)]
    await running
    await server.settled()
    # The reads of one fan-out (asked at the same moment) share one request.
    server.delay_s = 0.0
    asked_at = time.monotonic()
    both = await asyncio.gather(
        reads.read(state, "is_sleeping", TIMEOUT_S, asked_at),
        reads.read(state, "has_work", TIMEOUT_S, asked_at),
    )
    assert server.asked == 5
    assert work(both[1]) == [("a/0", Outcome.OK, False), ("a/1", Outcome.OK, False)]


async def test_the_polls_read_may_use_the_answer_that_came_late(state: PluginTargetState) -> None:
    """The poll's reads (``late_answers_allowed``) as documented: a slow server's answer that
    came after one poll's deadline answers the next poll (which still asks anew)."""
    server = SlowServer(IDLE)
    reads = PluginReads(server.fetch, server.dropped.append)
    with late_answers_allowed():
        first = await reads.read(state, "has_work", TIMEOUT_S)
        assert [o.outcome for o in first] == [Outcome.TIMEOUT]
        await server.settled(state)
        server.ranks = BUSY
        found = work(await reads.read(state, "has_work", TIMEOUT_S))
    assert server.asked == 2
    assert found == [("a/0", Outcome.OK, False), ("a/1", Outcome.OK, False)]  # the late answer
    await server.settled()
